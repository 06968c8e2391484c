"""Streams and disconnects: several engine generators merged, work cancelled when its client
leaves, a streaming response that stops at the disconnect, and OpenAI's server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse

from pagedllm.entrypoints.openai.errors import stream_error

logger = logging.getLogger("pagedllm")
T = TypeVar("T")


async def merge(gens: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async generators as they come, tagged with the generator's index.
    Closing the merged stream cancels the pumps, which closes (aborts) every generator. The
    queue holds one item per generator: a consumer that stops leaves the items unread in the
    generators (the engine's streams bound them), not here."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(gens))
    done = object()

    async def pump(i: int, gen: AsyncIterator[T]) -> None:
        try:
            async for item in gen:
                await queue.put((i, item))
            await queue.put((i, done))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))
        finally:
            await gen.aclose()  # type: ignore[attr-defined]

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client goes away first, cancel it (aborting its requests) -> None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled():
        logger.info("client disconnected: request aborted")
        return None
    return task.result()


class DisconnectAwareStream(StreamingResponse):
    """A streaming response that stops (and closes its iterator, aborting the request) as soon
    as the client disconnects, not at the next chunk it fails to send; `on_disconnect` is told."""

    def __init__(self, *args, on_disconnect=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.on_disconnect = on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        streaming = asyncio.create_task(super().__call__(scope, receive, send))
        watcher = asyncio.create_task(listen())
        try:
            await asyncio.wait({streaming, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not streaming.done():
                logger.info("client disconnected mid-stream: request aborted")
                if self.on_disconnect is not None:
                    self.on_disconnect()
        finally:
            for task in (streaming, watcher):
                task.cancel()
            await asyncio.gather(streaming, watcher, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


async def events(chunks: AsyncIterator[str], request_id: str) -> AsyncIterator[str]:
    """A stream's JSON chunks as server-sent events, then [DONE]; a failure after the status
    was sent ends it with an in-band error event."""
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except Exception as e:  # noqa: BLE001 - the status is sent: report in-band
            yield sse(stream_error(e, request_id))
    yield sse("[DONE]")
