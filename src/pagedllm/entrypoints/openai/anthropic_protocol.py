"""Request and response models in the shapes of Anthropic's Messages API (`POST /v1/messages`,
`POST /v1/messages/count_tokens`), for the translation onto chat (serving_messages.py).

Content blocks this server reads: `text`; `tool_use` in assistant turns; `tool_result` (its
content a string or text blocks) in user turns; `thinking` in assistant turns, dropped (the
server's own answers carry one with --reasoning-parser, and clients send them back). Any other
block type is a validation error naming the message and the block."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedllm.entrypoints.openai.protocol import OpenAIModel, OpenAIRequest

_BLOCK_TYPES = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "tool_use", "thinking"),
}


class TextBlock(OpenAIModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(OpenAIModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(OpenAIModel):
    type: Literal["tool_result"] = "tool_result"
    tool_use_id: str
    content: str | list[TextBlock] | None = None  # text only (MessageParam checks)
    is_error: bool | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(block.text for block in self.content)
        return self.content or ""


class ThinkingBlock(OpenAIModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic's proof of origin; this server has none to give


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


class MessageParam(OpenAIModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @model_validator(mode="before")
    @classmethod
    def _supported_blocks(cls, data: Any) -> Any:
        """Name the unsupported block (image, document, ...) instead of pydantic's union error."""
        if not isinstance(data, dict) or not isinstance(data.get("content"), list):
            return data
        allowed = _BLOCK_TYPES.get(data.get("role"))
        if allowed is None:
            return data  # the role's own error says what is wrong
        for i, block in enumerate(data["content"]):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in allowed:
                raise ValueError(
                    f"content[{i}]: block type {kind!r} is not supported in a {data['role']} "
                    f"message (supported: {', '.join(allowed)})"
                )
            inner = block.get("content") if kind == "tool_result" else None
            for j, part in enumerate(inner if isinstance(inner, list) else []):
                part_kind = part.get("type") if isinstance(part, dict) else None
                if part_kind != "text":
                    raise ValueError(
                        f"content[{i}].content[{j}]: a tool_result holds text blocks only, "
                        f"got {part_kind!r}"
                    )
        return data


class ToolParam(OpenAIModel):
    """A client tool. Anthropic's server tools (web search, code execution...) have a `type`
    and run on Anthropic's side: not supported."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise ValueError(
                f"tool type {data['type']!r} is not supported: only client tools (name, "
                "description, input_schema)"
            )
        return data


class ToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # the tool, with type "tool"
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError('tool_choice of type "tool" needs the tool\'s name')
        return self


class OutputFormat(OpenAIModel):
    type: Literal["json_schema"]
    # "schema" in the body (a BaseModel attribute name, hence the alias)
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIModel):
    format: OutputFormat | None = None  # structured outputs; `effort` is accepted, not used


class CountTokensRequest(OpenAIRequest):
    """What a prompt is made of: the conversation, the system prompt, the tools."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_text(cls, system: Any) -> Any:
        if isinstance(system, list):
            for i, block in enumerate(system):
                kind = block.get("type") if isinstance(block, dict) else None
                if kind != "text":
                    raise ValueError(f"system[{i}]: only text blocks are supported, got {kind!r}")
        return system


class MessagesRequest(CountTokensRequest):
    max_tokens: int  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None  # accepted, not used


# -- responses ------------------------------------------------------------------------------------
class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextBlock | ToolUseBlock | ThinkingBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: Usage


def error_body(kind: str, message: str) -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}
