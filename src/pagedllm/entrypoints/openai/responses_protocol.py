"""OpenAI's Responses API (`POST /v1/responses`): the request and the response object, in
OpenAI's shapes. Input items and tools stay dicts here: serving_responses.py checks them one by
one, so that an unsupported kind gets a 400 naming its place in the request."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import OpenAIModel, OpenAIRequest

# `include` values this server honours: logprobs of the output text; encrypted reasoning is
# asked for by clients that do not store responses, and there is none to give (reasoning comes
# back in the clear), so it changes nothing.
SUPPORTED_INCLUDES = {"message.output_text.logprobs", "reasoning.encrypted_content"}


def item_id(prefix: str) -> str:
    """OpenAI's ids: resp_..., msg_..., fc_..., rs_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


class TextConfig(OpenAIModel):
    # {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", "schema",
    # "strict", "description"}; checked when translated.
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ReasoningConfig(OpenAIModel):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    # Flat function tools: {"type": "function", "name", "description", "parameters", "strict"}
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # None: True, as OpenAI
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    reasoning: ReasoningConfig | None = None
    # vLLM's extras: the chat endpoint's scheduling priority and output constraint
    priority: int = 0
    structured_outputs: dict[str, Any] | None = None
    # OpenAI's, not supported here: a 400 naming the field when given
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None


class OutputText(OpenAIModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: item_id("msg"))
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIModel):
    """The think text of a --reasoning-parser model: in `content`, not summarized."""

    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: item_id("rs"))
    summary: list = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: item_id("fc"))
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = ReasoningItem | MessageItem | FunctionCallItem


class InputTokensDetails(OpenAIModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, reasoning_tokens: int) -> ResponseUsage:
        return cls(
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            total_tokens=input_tokens + output_tokens,
            output_tokens_details=OutputTokensDetails(
                reasoning_tokens=min(reasoning_tokens, output_tokens)
            ),
        )


class ResponseError(OpenAIModel):
    code: str = "server_error"
    message: str


class IncompleteDetails(OpenAIModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseObject(OpenAIModel):
    """The Response object: the output and usage, and the request's settings echoed (the ones
    OpenAI's SDK requires, and those it reads when given)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"] = "completed"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    temperature: float | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    background: bool = False
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    text: TextConfig = Field(default_factory=lambda: TextConfig(format={"type": "text"}))
    top_logprobs: int | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None

    def finish(self, cut: bool) -> None:
        """The final status: "incomplete" when max_output_tokens (or the context) cut the
        output, its last item then incomplete too."""
        self.status = "incomplete" if cut else "completed"
        self.incomplete_details = IncompleteDetails() if cut else None
        if cut and self.output:
            self.output[-1].status = "incomplete"
