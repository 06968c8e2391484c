"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API as a translation onto
the chat endpoint. A request becomes a ChatCompletionRequest (input items -> chat messages, flat
function tools -> chat's, text.format -> response_format), chat's machinery runs it (template,
tools, structured outputs, reasoning parser, limits, disconnects), and its answer comes back as
a Response object, or as Responses' named stream events (responses_stream.py).

Stored responses (store, default true) live in memory, the last `max_stored_responses` of
them (ServerConfig; least recently used first out): `GET` returns them, and
`previous_response_id` starts a new prompt with the conversation they end (their instructions
excluded, as OpenAI does)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationError

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponse
from pagedllm.entrypoints.openai.responses_protocol import (
    SUPPORTED_INCLUDES,
    FunctionCallItem,
    MessageItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
)
from pagedllm.entrypoints.openai.responses_stream import ResponseEventStream, named_events
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text", "output_text"}
_PLAIN = {"type": "text"}
# Chat's parameter names in its errors -> the Responses request's
_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "messages": "input", "response_format": "text.format"}  # fmt: skip


class ChatFromResponses(ChatCompletionRequest):
    """A Responses request as chat runs it, carrying what its answer needs besides."""

    responses: ResponsesRequest | None = Field(default=None, exclude=True)
    # The conversation before the answer (earlier turns and this input; no instructions)
    turn: list[dict[str, Any]] = Field(default_factory=list, exclude=True)


@dataclass
class StoredResponse:
    response: ResponseObject
    messages: list[dict[str, Any]]  # the conversation through this response's output


class ResponseStore:
    """The last `capacity` stored responses by id; the least recently used goes first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, entry: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry


class OpenAIServingResponses(OpenAIServingChat):
    id_prefix = "resp"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.store = ResponseStore(self.config.max_stored_responses)

    async def create_response(self, body: ResponsesRequest, raw):
        check_supported(body)
        history: list[dict] = []
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id)
            if previous is None:
                raise OpenAIError(
                    f"Previous response with id '{body.previous_response_id}' not found.",
                    param="previous_response_id",
                )
            history = previous.messages
        chat_body = to_chat_request(body, history)
        try:
            return await self.create(chat_body, raw)
        except OpenAIError as e:
            e.param = _PARAMS.get(e.param, e.param)
            raise

    def retrieve(self, response_id: str) -> ResponseObject:
        entry = self.store.get(response_id)
        if entry is None:
            raise OpenAIError(f"Response with id '{response_id}' not found.", 404, "response_id")
        return entry.response

    # -- chat's hooks, answering in the Responses shapes ----------------------------------------
    def response(self, body: ChatFromResponses, request_id, prompts, plan, finals):
        chat = super().response(body, request_id, prompts, plan, finals)
        response = self._skeleton(body, request_id)
        fill_response(response, chat, self.count_tokens)
        self._remember(body, response)
        return response

    async def stream_chunks(
        self, body: ChatFromResponses, request_id, prompts, plan, stream, include_usage
    ) -> AsyncIterator[dict]:
        chunks = self.chunk_objects(body, request_id, plan, stream, include_usage=True)
        events = ResponseEventStream(
            self._skeleton(body, request_id),
            request_id,
            count_tokens=self.count_tokens,
            on_done=lambda response: self._remember(body, response),
        )
        async for event in events.events(chunks):
            yield event

    def frame(self, chunks, request_id: str):
        return named_events(chunks, request_id)

    # -- helpers --------------------------------------------------------------------------------
    def count_tokens(self, text: str) -> int:
        """Tokens of a part of the output (the reasoning), as the tokenizer splits it alone."""
        if not text or self.tokenizer is None:
            return 0
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _stores(self, body: ResponsesRequest) -> bool:
        return body.store is not False and self.store.capacity > 0

    def _skeleton(self, chat_body: ChatFromResponses, request_id: str) -> ResponseObject:
        """The response before its output: the request's settings echoed."""
        body = chat_body.responses
        return ResponseObject(
            id=request_id.replace("-", "_", 1),  # resp-<hex> -> OpenAI's resp_<hex>
            status="in_progress",
            instructions=body.instructions,
            metadata=body.metadata,
            model=self.model_name(chat_body),
            parallel_tool_calls=chat_body.parallel_tool_calls,
            temperature=1.0 if body.temperature is None else body.temperature,
            tool_choice=body.tool_choice or "auto",
            tools=body.tools or [],
            top_p=1.0 if body.top_p is None else body.top_p,
            max_output_tokens=body.max_output_tokens,
            previous_response_id=body.previous_response_id,
            reasoning=body.reasoning,
            store=self._stores(body),
            text=body.text if body.text and body.text.format else TextConfig(format=_PLAIN),
            top_logprobs=body.top_logprobs,
            user=body.user,
        )

    def _remember(self, chat_body: ChatFromResponses, response: ResponseObject) -> None:
        if not self._stores(chat_body.responses):
            return
        output = input_messages([item.model_dump() for item in response.output])
        self.store.put(StoredResponse(response, [*chat_body.turn, *output]))


# -- the request, translated ------------------------------------------------------------------
def check_supported(body: ResponsesRequest) -> None:
    """400 naming the field for what this server does not do."""
    given = {
        "background": bool(body.background),
        "conversation": body.conversation is not None,
        "prompt": body.prompt is not None,  # stored prompt templates
        "max_tool_calls": body.max_tool_calls is not None,
        "reasoning.effort": body.reasoning is not None and body.reasoning.effort is not None,
    }
    for param, present in given.items():
        if present:
            raise OpenAIError(f"{param} is not supported by this server", param=param)
    if body.truncation not in (None, "disabled"):
        raise OpenAIError(
            f'truncation {body.truncation!r} is not supported: only "disabled" (a prompt '
            "longer than the context is a 400)",
            param="truncation",
        )
    for value in body.include or []:
        if value not in SUPPORTED_INCLUDES:
            raise OpenAIError(
                f"include value {value!r} is not supported; supported: "
                f"{', '.join(sorted(SUPPORTED_INCLUDES))}",
                param="include",
            )


def to_chat_request(body: ResponsesRequest, history: list[dict]) -> ChatFromResponses:
    turn = [*history, *input_messages(body.input)]
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += turn
    if not messages:
        raise OpenAIError("input is empty: give at least one message", param="input")
    logprobs = "message.output_text.logprobs" in (body.include or [])
    logprobs = logprobs or body.top_logprobs is not None
    tool_choice = chat_tool_choice(body.tool_choice)
    # text.format shapes text; a forced call's output is the call (agents send both at once)
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    text_format = response_format(body.text)  # checked either way
    chat = {
        "model": body.model,
        "messages": messages,
        "stream": body.stream,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user,
        "priority": body.priority,
        "structured_outputs": body.structured_outputs,
        "tools": chat_tools(body.tools),
        "tool_choice": tool_choice,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "response_format": None if forced else text_format,
        "logprobs": logprobs,
        "top_logprobs": body.top_logprobs if logprobs else None,
        "responses": body,
        "turn": turn,
    }
    try:
        return ChatFromResponses.model_validate(chat)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        field = str(first["loc"][0]) if first["loc"] else None  # the request's field
        raise OpenAIError(f"{where}: {first['msg']}", param=_PARAMS.get(field, field)) from None


def input_messages(items: str | list[dict]) -> list[dict]:
    """Input items (or a stored response's output items) -> chat messages: function calls join
    the assistant message before them, their outputs become `tool` messages, reasoning items
    are dropped (the model reads only the answers of earlier turns, as with chat)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise OpenAIError(
                    f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", param="input"
                )
            messages.append({"role": _ROLES[role], "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, f"{where}.output")
            call_id = _string(item, "call_id", where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind != "reasoning":
            raise OpenAIError(
                f"{where}.type {kind!r} is not supported: give messages, function_call, "
                "function_call_output or reasoning items",
                param="input",
            )
    return messages


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise OpenAIError(f"{where}.{key} must be a string", param="input")
    return value


def _content(content, where: str) -> str | list[dict]:
    """A message's content: its text, or its text parts as chat's."""
    if isinstance(content, str):
        return content
    _parts_text(content, f"{where}.content")  # checks the parts
    return [{"type": "text", "text": part["text"]} for part in content]


def _parts_text(parts, where: str) -> str:
    if not isinstance(parts, list):
        raise OpenAIError(f"{where} must be a string or a list of text parts", param="input")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise OpenAIError(
                f"{where}[{j}]: content of type {kind!r} is not supported; only text "
                "(input_text, output_text)",
                param="input",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Flat function tools -> chat's {"type": "function", "function": {...}}."""
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise OpenAIError(
                f"tools[{i}]: tools of type {tool.get('type')!r} are not supported (no built-in "
                "tools such as web_search or file_search here): give function tools",
                param="tools",
            )
        if not isinstance(tool.get("name"), str):
            raise OpenAIError(f"tools[{i}].name must be a string", param="tools")
        keys = ("name", "description", "parameters", "strict")
        function = {k: tool[k] for k in keys if tool.get(k) is not None}
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: str | dict | None):
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError(
        f'tool_choice must be "auto", "none", "required" or {{"type": "function", "name": ...}}, '
        f"got {choice!r}",
        param="tool_choice",
    )


def response_format(text: TextConfig | None) -> dict | None:
    """text.format -> chat's response_format (the same structured-output path)."""
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise OpenAIError(
                "text.format.schema must be a JSON schema object", param="text.format.schema"
            )
        keys = ("name", "description", "schema", "strict")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}
    raise OpenAIError(
        f'text.format.type must be "text", "json_object" or "json_schema", got {kind!r}',
        param="text.format",
    )


# -- the answer, translated -------------------------------------------------------------------
def fill_response(response: ResponseObject, chat: ChatCompletionResponse, count_tokens) -> None:
    """A whole chat answer -> the response's output items, status and usage."""
    choice = chat.choices[0]
    message = choice.message
    items: list = []
    if message.reasoning_content:
        items.append(ReasoningItem(content=[ReasoningText(text=message.reasoning_content)]))
    if message.content or not (message.tool_calls or items):
        logprobs = []
        if choice.logprobs is not None and choice.logprobs.content:
            logprobs = [entry.model_dump() for entry in choice.logprobs.content]
        text = OutputText(text=message.content or "", logprobs=logprobs)
        items.append(MessageItem(content=[text]))
    for call in message.tool_calls:
        function = call.function
        items.append(
            FunctionCallItem(call_id=call.id, name=function.name, arguments=function.arguments)
        )
    response.output = items
    response.finish(choice.finish_reason == "length")
    reasoning_tokens = count_tokens(message.reasoning_content or "")
    response.usage = ResponseUsage.of(
        chat.usage.prompt_tokens, chat.usage.completion_tokens, reasoning_tokens
    )
