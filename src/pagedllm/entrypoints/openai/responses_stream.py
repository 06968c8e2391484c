"""The Responses API's stream: chat's chunks in, OpenAI's named events out (response.created,
response.in_progress, then per output item its .added, content part, text / reasoning /
function-call argument deltas and .done events, then response.completed or .incomplete; a
failure: an `error` event and response.failed). Each event carries its `sequence_number`, and
there is no [DONE]."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable

from pagedllm.entrypoints.openai.errors import stream_error
from pagedllm.entrypoints.openai.protocol import ChatCompletionChunk, ChatStreamChoice
from pagedllm.entrypoints.openai.responses_protocol import (
    FunctionCallItem,
    MessageItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)


class ResponseEventStream:
    """One streamed response: its items open as their first delta comes and close when the
    next kind of output begins or the stream ends."""

    def __init__(
        self,
        response: ResponseObject,
        request_id: str,
        count_tokens: Callable[[str], int],
        on_done: Callable[[ResponseObject], None],
    ) -> None:
        self.response = response  # status "in_progress", output filled as items close
        self.request_id = request_id
        self.count_tokens = count_tokens
        self.on_done = on_done
        self.open: ReasoningItem | MessageItem | FunctionCallItem | None = None
        self.reasoning = ""
        self.pending_logprobs: list[dict] = []  # of tokens streamed before the text they precede

    async def events(self, chunks: AsyncIterator[ChatCompletionChunk]) -> AsyncIterator[dict]:
        yield self._snapshot("response.created")
        yield self._snapshot("response.in_progress")
        cut, tokens = False, (0, 0)
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if chunk.usage is not None:
                        tokens = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                    for choice in chunk.choices:
                        for event in self._choice(choice):
                            yield event
                        cut = cut or choice.finish_reason == "length"
        except Exception as e:  # noqa: BLE001 - the status is sent: report in-band
            error = json.loads(stream_error(e, self.request_id))["error"]
            yield {"type": "error", "code": str(error["code"]), "message": error["message"],
                   "param": error["param"]}  # fmt: skip
            self.response.status = "failed"
            self.response.error = ResponseError(message=error["message"])
            yield self._snapshot("response.failed")
            return
        if self.open is None and not self.response.output:  # no text at all: an empty message
            for event in self._open(MessageItem(status="in_progress")):
                yield event
        for event in self._close("incomplete" if cut else "completed"):
            yield event
        self.response.finish(cut)
        self.response.usage = ResponseUsage.of(*tokens, self.count_tokens(self.reasoning))
        self.on_done(self.response)
        yield self._snapshot(f"response.{self.response.status}")

    def _snapshot(self, kind: str) -> dict:
        return {"type": kind, "response": self.response.model_dump(mode="json")}

    def _choice(self, choice: ChatStreamChoice):
        delta = choice.delta
        logprobs = []
        if choice.logprobs is not None and choice.logprobs.content:
            logprobs = [entry.model_dump() for entry in choice.logprobs.content]
        if delta.reasoning_content:
            if not isinstance(self.open, ReasoningItem):
                yield from self._close()
                yield from self._open(ReasoningItem(status="in_progress"))
            self.reasoning += delta.reasoning_content
            self.open.content[0].text += delta.reasoning_content
            yield self._item_event("response.reasoning_text.delta", delta=delta.reasoning_content)
        if delta.content:
            if not isinstance(self.open, MessageItem):
                yield from self._close()
                yield from self._open(MessageItem(status="in_progress"))
            logprobs, self.pending_logprobs = self.pending_logprobs + logprobs, []
            part = self.open.content[0]
            part.text += delta.content
            part.logprobs += logprobs
            yield self._item_event(
                "response.output_text.delta", delta=delta.content, logprobs=logprobs
            )
        else:
            self.pending_logprobs += logprobs
        for call in delta.tool_calls or []:
            function = call.function
            arguments = (function.arguments if function else None) or ""
            if call.id is not None:  # a new call: its id and name come first, once
                yield from self._close()
                item = FunctionCallItem(
                    call_id=call.id, name=function.name, arguments="", status="in_progress"
                )
                yield from self._open(item)
            if arguments:
                self.open.arguments += arguments
                yield self._item_event("response.function_call_arguments.delta", delta=arguments)

    def _item_event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "item_id": self.open.id, "output_index": len(self.response.output)}
        if not isinstance(self.open, FunctionCallItem):
            event["content_index"] = 0
        return {**event, **fields}

    def _open(self, item):
        """The item's .added event (and its content part's), empty as OpenAI sends it."""
        self.open = item
        index = len(self.response.output)
        yield {"type": "response.output_item.added", "output_index": index,
               "item": item.model_dump(mode="json")}  # fmt: skip
        if isinstance(item, FunctionCallItem):
            return
        part = ReasoningText(text="") if isinstance(item, ReasoningItem) else OutputText(text="")
        item.content = [part]
        yield self._item_event("response.content_part.added", part=part.model_dump(mode="json"))

    def _close(self, status: str = "completed"):
        """The open item's .done events; it joins the response's output."""
        item = self.open
        if item is None:
            return
        if isinstance(item, FunctionCallItem):
            done = "response.function_call_arguments.done"
            yield self._item_event(done, arguments=item.arguments)
        else:
            part = item.content[0]
            if isinstance(item, ReasoningItem):
                yield self._item_event("response.reasoning_text.done", text=part.text)
            else:
                yield self._item_event(
                    "response.output_text.done", text=part.text, logprobs=part.logprobs
                )
            yield self._item_event("response.content_part.done", part=part.model_dump(mode="json"))
        item.status = status
        yield {"type": "response.output_item.done", "output_index": len(self.response.output),
               "item": item.model_dump(mode="json")}  # fmt: skip
        self.response.output.append(item)
        self.open = None


def _sse(event: dict, sequence_number: int) -> str:
    event["sequence_number"] = sequence_number
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def named_events(events: AsyncIterator[dict], request_id: str) -> AsyncIterator[str]:
    """The events as server-sent events named by their type, numbered in order."""
    sequence_number = 0
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                yield _sse(event, sequence_number)
                sequence_number += 1
        except Exception as e:  # noqa: BLE001 - the status is sent: report in-band
            error = json.loads(stream_error(e, request_id))["error"]
            event = {"type": "error", "code": str(error["code"]), "message": error["message"],
                     "param": error["param"]}  # fmt: skip
            yield _sse(event, sequence_number)
