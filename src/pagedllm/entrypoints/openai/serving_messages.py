"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as a
translation onto chat: the request becomes a ChatCompletionRequest, chat's machinery runs (the
template, tools, reasoning parser, limits, metrics, LoRA model names, disconnects), and its
answer or its stream's chunks come back as a Message or as Anthropic's named server-sent events.
Errors on these paths, whichever layer answers them, take Anthropic's shape (AnthropicErrors)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from pydantic import ValidationError

from pagedllm.entrypoints.openai.anthropic_protocol import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    Usage,
    error_body,
)
from pagedllm.entrypoints.openai.errors import OpenAIError, engine_error, request_failed
from pagedllm.entrypoints.openai.protocol import ChatCompletionChunk, ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.tools import offered_tools
from pagedllm.outputs import RequestOutput

logger = logging.getLogger("pagedllm")
MESSAGES_PATH = "/v1/messages"
_ERROR_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def anthropic_error(status: int, engine_running: bool) -> tuple[str, int]:
    """(Anthropic's error type, status) for one of the server's statuses. A 503 while the engine
    runs is a full queue: Anthropic's 529 overloaded_error, which its clients retry."""
    if status == 503:
        return ("overloaded_error", 529) if engine_running else ("api_error", 503)
    kind = _ERROR_KINDS.get(status)
    if kind is None:
        kind = "api_error" if status >= 500 else "invalid_request_error"
    return kind, status


# -- the request ----------------------------------------------------------------------------------
def chat_messages(body: CountTokensRequest) -> list[dict]:
    """The system prompt and the conversation as chat messages: tool_use blocks become the
    assistant's tool_calls, tool_result blocks `role: "tool"` messages (in their order among
    the user turn's text)."""
    system = body.system
    if isinstance(system, list):
        system = "\n".join(block.text for block in system)
    out = [{"role": "system", "content": system}] if system else []
    for message in body.messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            texts = [block.text for block in message.content if block.type == "text"]
            entry = {"role": "assistant", "content": "\n".join(texts)}
            calls = [
                {"id": block.id, "type": "function",
                 "function": {"name": block.name,
                              "arguments": json.dumps(block.input, ensure_ascii=False)}}
                for block in message.content if block.type == "tool_use"
            ]  # fmt: skip
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
        else:
            texts = []
            for block in message.content:
                if block.type == "text":
                    texts.append(block.text)
                    continue
                if texts:
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                result = f"Error: {block.text()}" if block.is_error else block.text()
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
            if texts or not message.content:
                out.append({"role": "user", "content": "\n".join(texts)})
    if body.messages[-1].role == "assistant":
        raise OpenAIError(
            "messages: the last message must be the user's (continuing a final assistant "
            "message, prefill, is not supported)",
            param="messages",
        )
    return out


def _tool_choice(body: CountTokensRequest) -> tuple[str | dict | None, bool]:
    """(chat's tool_choice, parallel_tool_calls)."""
    choice = body.tool_choice
    if choice is None:
        return None, True  # chat's default, as Anthropic's: "auto" when tools are given
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that generates (or, for count_tokens, renders) as `body` asks."""
    tool_choice, parallel = _tool_choice(body)
    request = {
        "model": body.model,
        "messages": chat_messages(body),
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
    }
    if body.tools:
        request["tools"] = [
            {"type": "function",
             "function": {"name": t.name, "description": t.description,
                          "parameters": t.input_schema}}
            for t in body.tools
        ]  # fmt: skip
    if isinstance(body, MessagesRequest):
        request.update(
            max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
            top_p=body.top_p, top_k=body.top_k, stream=body.stream,
            stream_options={"include_usage": True} if body.stream else None,
        )  # fmt: skip
        output = body.output_config and body.output_config.format
        if output:
            schema = {"name": "output", "schema": output.json_schema}
            request["response_format"] = {"type": "json_schema", "json_schema": schema}
    try:
        return ChatCompletionRequest.model_validate(request)
    except ValidationError as e:
        raise OpenAIError(f"invalid request: {e.errors()[0].get('msg')}") from None


# -- the answer -----------------------------------------------------------------------------------
def message_id(request_id: str) -> str:
    return "msg_" + request_id.split("-", 1)[1]


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish_reason: str | None, matched: int | str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish_reason and stop_reason (the stop
    string that ended it, if one did)."""
    if finish_reason in _STOP_REASONS:
        return _STOP_REASONS[finish_reason], None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _tool_input(arguments: str) -> dict:
    """A call's arguments as the input object; {} when max_tokens cut them short."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def message_from_chat(response, request_id: str) -> Message:
    """A chat completion (one choice) as Anthropic's Message."""
    choice = response.choices[0]
    message = choice.message
    content: list = []
    if message.reasoning_content:
        content.append(ThinkingBlock(thinking=message.reasoning_content))
    if message.content:
        content.append(TextBlock(text=message.content))
    for call in message.tool_calls:
        content.append(ToolUseBlock(id=tool_use_id(call.id), name=call.function.name,
                                    input=_tool_input(call.function.arguments)))  # fmt: skip
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason)
    usage = Usage(input_tokens=response.usage.prompt_tokens,
                  output_tokens=response.usage.completion_tokens)  # fmt: skip
    return Message(id=message_id(request_id), model=response.model, content=content,
                   stop_reason=reason, stop_sequence=sequence, usage=usage)  # fmt: skip


class _Blocks:
    """The streamed content blocks: which one is open, and the events that open and close
    them (a new block each time the kind, or the tool call, changes)."""

    def __init__(self) -> None:
        self.index = -1
        self.key: tuple | None = None

    def open(self, key: tuple, block: dict) -> list[dict]:
        if key == self.key:
            return []
        events = self.close()
        self.index, self.key = self.index + 1, key
        events.append({"type": "content_block_start", "index": self.index, "content_block": block})
        return events

    def delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def close(self) -> list[dict]:
        if self.key is None:
            return []
        self.key = None
        return [{"type": "content_block_stop", "index": self.index}]


async def message_events(
    chunks: AsyncIterator[ChatCompletionChunk], request_id: str, model: str, input_tokens: int
) -> AsyncIterator[dict]:
    """Chat's stream chunks (one choice, usage last) as Anthropic's stream events."""
    message = Message(id=message_id(request_id), model=model, content=[], stop_reason=None,
                      usage=Usage(input_tokens=input_tokens, output_tokens=0))  # fmt: skip
    yield {"type": "message_start", "message": message.model_dump()}
    blocks = _Blocks()
    reason, sequence, output_tokens = "end_turn", None, 0
    async for chunk in chunks:
        if chunk.usage is not None:
            output_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            delta = choice.delta
            if delta.reasoning_content:
                for event in blocks.open(("thinking",), ThinkingBlock(thinking="").model_dump()):
                    yield event
                yield blocks.delta({"type": "thinking_delta", "thinking": delta.reasoning_content})
            if delta.content:
                for event in blocks.open(("text",), {"type": "text", "text": ""}):
                    yield event
                yield blocks.delta({"type": "text_delta", "text": delta.content})
            for call in delta.tool_calls or []:
                function = call.function
                if call.id is not None:  # a call's first delta: its id and name
                    block = {"type": "tool_use", "id": tool_use_id(call.id),
                             "name": function.name, "input": {}}  # fmt: skip
                    for event in blocks.open(("tool_use", call.index), block):
                        yield event
                if function is not None and function.arguments:
                    yield blocks.delta({"type": "input_json_delta",
                                        "partial_json": function.arguments})  # fmt: skip
            if choice.finish_reason is not None:
                reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason)
    for event in blocks.close():
        yield event
    yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
           "usage": {"output_tokens": output_tokens}}  # fmt: skip
    yield {"type": "message_stop"}


def sse_event(event: dict) -> str:
    """A named server-sent event (Anthropic's clients read the `event:` line)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class AnthropicServingMessages(OpenAIServingChat):
    """Chat's request skeleton and hooks, with Anthropic's answer, events and ids. `create`
    takes the ChatCompletionRequest chat_request made."""

    id_prefix = "msg"

    def response(self, body, request_id: str, prompts, plan, finals: list[RequestOutput]):
        chat = super().response(body, request_id, prompts, plan, finals)
        return message_from_chat(chat, request_id)

    async def stream_chunks(
        self, body, request_id: str, prompts, plan, stream, include_usage: bool
    ) -> AsyncIterator[dict]:
        # Closing this stream closes the chunks and the engine's stream at once (aborting).
        async with (
            contextlib.aclosing(stream),
            contextlib.aclosing(self.chunk_objects(body, request_id, plan, stream, True)) as chunks,
        ):
            input_tokens = len(prompts[0]["prompt_token_ids"])
            model = self.model_name(body)
            async for event in message_events(chunks, request_id, model, input_tokens):
                yield event

    async def frame(self, chunks: AsyncIterator[dict], request_id: str) -> AsyncIterator[str]:
        """Named events; a failure after the status was sent ends the stream with an `error`
        event (no [DONE]: Anthropic's streams end with message_stop)."""
        async with contextlib.aclosing(chunks):
            try:
                async for event in chunks:
                    yield sse_event(event)
            except Exception as e:  # noqa: BLE001 - the status is sent: report in-band
                error = engine_error(e)
                if not isinstance(error, OpenAIError):
                    error = request_failed(request_id, e)
                kind, _ = anthropic_error(error.status, self.async_engine.is_running)
                yield sse_event(error_body(kind, error.message))

    def check_tool_choice(self, body: MessagesRequest) -> None:
        """Chat's "auto" check, in the Messages API's words (its default with tools is auto)."""
        choice = body.tool_choice.type if body.tool_choice else "auto"
        if (
            body.tools
            and choice == "auto"
            and not (self.config.enable_auto_tool_choice and self.config.tool_call_parser)
        ):
            raise OpenAIError(
                'tool_choice "auto" (the default with tools) needs the server started with '
                '--enable-auto-tool-choice and --tool-call-parser; give tool_choice {"type": '
                '"any"}, {"type": "tool", "name": ...} or {"type": "none"}',
                param="tool_choice",
            )

    def count_tokens(self, body: CountTokensRequest) -> int:
        """The prompt's tokens as generation would render it: the tools shown unless
        tool_choice is "none" (every other choice renders them alike)."""
        self.check_model(body.model)
        request = chat_request(body)
        plan = offered_tools(request.tools, self.config.tool_call_parser)
        if request.tool_choice == "none":
            plan.mode = "none"
        return len(self.render(request.messages, True, plan)["prompt_token_ids"])


class AnthropicErrors:
    """ASGI middleware: error answers on the /v1/messages paths, given in OpenAI's shape by any
    layer (body validation, the API key, the body size limit, the route), rewritten in
    Anthropic's: {"type": "error", "error": {"type", "message"}}, with its statuses."""

    def __init__(self, app, engine_running: Callable[[], bool]) -> None:
        self.app = app
        self.engine_running = engine_running

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path != MESSAGES_PATH and not path.startswith(MESSAGES_PATH + "/"):
            return await self.app(scope, receive, send)
        held: dict | None = None  # an error's response start, sent with its rewritten body
        parts: list[bytes] = []

        async def rewrite(message) -> None:
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held = message
                return
            if held is None or message["type"] != "http.response.body":
                return await send(message)
            parts.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            status, body = self._translate(held["status"], b"".join(parts))
            headers = [(k, v) for k, v in held.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewrite)

    def _translate(self, status: int, body: bytes) -> tuple[int, bytes]:
        try:
            error = json.loads(body).get("error")
        except (ValueError, AttributeError):
            return status, body
        if not isinstance(error, dict) or "message" not in error:
            return status, body  # not an error answer (a disconnected client's 499)
        kind, status = anthropic_error(status, self.engine_running())
        return status, json.dumps(error_body(kind, str(error["message"]))).encode()


def add_messages_routes(app: FastAPI, chat: OpenAIServingChat) -> None:
    """The Messages routes over chat's engine, config, metrics and adapters. Call it after the
    app's other middleware: its error rewriting must wrap them all."""
    messages = AnthropicServingMessages(chat.async_engine, chat.config, chat.metrics, chat.loras)
    app.add_middleware(AnthropicErrors, engine_running=lambda: chat.async_engine.is_running)

    @app.post(MESSAGES_PATH)
    async def create_message(body: MessagesRequest, request: Request):
        with _internal_errors():
            messages.check_tool_choice(body)
            return await messages.create(chat_request(body), request)

    @app.post(MESSAGES_PATH + "/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        with _internal_errors():
            return {"input_tokens": messages.count_tokens(body)}


@contextlib.contextmanager
def _internal_errors():
    """An unexpected failure as an OpenAIError (500), so that it too gets Anthropic's shape
    (the app's catch-all answers outside every middleware)."""
    try:
        yield
    except OpenAIError:
        raise
    except Exception as e:
        logger.exception("request failed", exc_info=e)
        raise OpenAIError(f"internal error: {e!r}", 500) from e
