"""What the async engines (in this process, or a client of an engine process) hand their
callers: each request's stream of outputs into its caller's event loop, and the errors that
can end one.

A stream holds the outputs its caller has not read yet. A caller that stops reading (an HTTP
client that does not read its response: the socket's buffers fill, then the response's writer
blocks) would let them pile up while its request keeps its KV blocks; past `max_backlog`
unread outputs the request is aborted and the stream ends with a StreamBacklogError."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; nothing more can be served."""


class RequestFailedError(RuntimeError):
    """Processing one request's output raised: that request stopped, the engine goes on."""


class StreamBacklogError(RequestFailedError):
    """The caller left too many outputs unread: the request was aborted."""


# Unread outputs (one per step that advanced the request) a stream may hold before its request
# is aborted. A reader that keeps up holds one or two.
MAX_STREAM_BACKLOG = 512


def rejection(kind: str, message: str) -> Exception:
    """What a request the engine refused raises in its stream (core_channel.Rejected's kind):
    bad input a ValueError, a failure on its way in a RequestFailedError."""
    return ValueError(message) if kind == "bad_request" else RequestFailedError(message)


def settle(future, ok: bool, value) -> None:
    """A call's future from the engine's reply (a refused call: ValueError, its message)."""
    if future is not None and future.set_running_or_notify_cancel():
        if ok:
            future.set_result(value)
        else:
            future.set_exception(ValueError(value))


class RequestStream:
    """One request's outputs, put from any thread, read on the caller's event loop."""

    def __init__(
        self,
        request_id: str,
        on_overflow: Callable[[str], None],
        max_backlog: int = MAX_STREAM_BACKLOG,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """`loop`: the caller's event loop (by default the running one)."""
        self.request_id = request_id
        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.max_backlog = max_backlog
        self._on_overflow = on_overflow  # aborts the request in its engine
        self._overflowed = False
        # Set once the final output or an error was read: the engine holds nothing more for
        # the request (else the caller left early, and the request must be aborted).
        self.ended = False

    def put(self, item) -> bool:
        """Hand `item` (an output or an exception) to the caller's event loop; False when that
        loop is closed (the caller is gone: nothing will read it, and raising here would stop
        the engine for everyone)."""
        try:
            self.loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:  # "Event loop is closed"
            return False
        return True

    def _deliver(self, item) -> None:  # on the caller's loop
        if self._overflowed:
            return
        if 0 < self.max_backlog <= self.queue.qsize() and not isinstance(item, BaseException):
            self._overflowed = True
            self.queue.put_nowait(
                StreamBacklogError(
                    f"request {self.request_id} was aborted: its client left "
                    f"{self.max_backlog} outputs unread (it reads its stream too slowly)"
                )
            )
            self._on_overflow(self.request_id)
            return
        self.queue.put_nowait(item)

    async def outputs(self):
        """The outputs until the final one; an exception put in the stream is raised."""
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.ended = True
                raise item
            self.ended = item.finished
            yield item
            if item.finished:
                return
