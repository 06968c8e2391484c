"""Request and response models in OpenAI's shapes, plus vLLM's extra sampling fields."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, model_validator

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    # Unknown fields are ignored, as OpenAI clients send some we do not use.
    model_config = ConfigDict(extra="ignore")


def _check_unicode(data: Any) -> None:
    """Raise ValueError for a string that is not valid Unicode: JSON's escapes let a body carry
    a lone surrogate (\\ud800), which no tokenizer can encode nor any response hold. Iterative:
    a deeply nested body must not hit Python's recursion limit."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"a string holds a lone surrogate ({value[e.start]!a} at index {e.start}): "
                    "text must be valid Unicode"
                ) from None
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


class OpenAIRequest(OpenAIModel):
    """A request body: every string in it must be valid Unicode (checked before the fields)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _check_unicode(data)
        return data


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    # "schema" in the body (a BaseModel attribute name, hence the alias); absent: any object.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(OpenAIRequest):
    """The sampling fields completions and chat share (vLLM's extras included)."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: the logprob and rank of each prompt token and the prompt_logprobs most likely at
    # its place, in the response (`prompt_logprobs`; not in streamed chunks)
    prompt_logprobs: int | None = None
    # vLLM's: with --scheduling-policy priority, lower values run first
    priority: int = 0
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs (the fields of
    # StructuredOutputsParams) and its older guided_* fields; one of them at most.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's output constraint; ValueError naming the field for a bad one."""
        given = {}
        if self.response_format is not None and self.response_format.type != "text":
            fmt = self.response_format
            if fmt.type == "json_object":
                given["response_format"] = {"json_object": True}
            elif fmt.json_schema is None:
                raise ValueError('response_format of type "json_schema" needs a json_schema')
            else:
                schema = fmt.json_schema.json_schema
                given["response_format"] = {"json": schema or {"type": "object"}}
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                given[f"guided_{kind}"] = {kind: value}
        if len(given) > 1:
            raise ValueError(
                f"structured_outputs: give one output constraint, got {', '.join(given)}"
            )
        if not given:
            return None
        ((field, kwargs),) = given.items()
        try:
            return StructuredOutputsParams(**kwargs)
        except TypeError as e:  # an unknown key in structured_outputs
            raise ValueError(f"structured_outputs: {e}") from None
        except ValueError as e:
            raise ValueError(f"{field}: {str(e).removeprefix('structured_outputs ')}") from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field for an out-of-range value."""
        temperature = 1.0 if self.temperature is None else self.temperature
        if self.use_beam_search and self.temperature is None:
            temperature = 0.0
        return SamplingParams(
            n=self.n,
            best_of=self.best_of,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            temperature=temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty,
            prompt_logprobs=self.prompt_logprobs,
            structured_outputs=self.structured_outputs_params(),
        )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls... go to the template as they are
    role: str
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ToolDefinition(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    # None: "auto" when tools are given, else "none" (OpenAI's defaults).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(OpenAIRequest):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None  # rendered as a chat request with them would be
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str


# -- responses ------------------------------------------------------------------------------------
class CompletionLogProbs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIModel):
    """vLLM's entry for one token at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token, vLLM's shape: None for the first, then {token id: its PromptLogprob}.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogProb(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatChoiceLogProbs(OpenAIModel):
    content: list[ChatLogProbsContent] | None = None


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None  # with --reasoning-parser (vLLM's field)


class DeltaFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIModel):
    """A streamed piece of the tool call at `index`: the id, type and name come first, once."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatCompletionChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @field_serializer("delta")
    def _delta(self, delta: DeltaMessage) -> dict:
        return delta.model_dump(exclude_none=True)  # {"content": ...}, the role only first


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
