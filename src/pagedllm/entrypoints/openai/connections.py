"""What one connection may hold: its request body (size and time to arrive), how long it may
take to send a request's headers, how long it may sit idle between requests, and how many
connections and requests the server takes at once. A client that opens connections and sends
nothing, trickles its headers (slowloris) or its body, or keeps thousands of idle keep-alive
connections is cut off, and well-behaved clients keep their latency (docs/reliability.md).

uvicorn's HTTP/1.1 protocol has the idle timer (`timeout_keep_alive`, armed after a response)
and the concurrency bound (`limit_concurrency`, a 503 past it), but no time limit on a
request's headers: `limited_protocol` adds one. It also fixes each connection's kernel send
buffer (by default Linux grows it up to 4 MiB): a client that stops reading its stream then
stops the server's writer soon, and its request's unread outputs reach the engine's backlog
bound (engine/streams.py) instead of going on into the socket."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.entrypoints.openai.errors import error_body


def limited_protocol(timeout: float | None, send_buffer: int | None) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose next request's headers have not all
    arrived `timeout` seconds after it opened or after its last response (bytes trickling in
    do not reset the clock: that is what a slowloris client counts on), its socket's send
    buffer `send_buffer` bytes (None: the kernel's)."""

    class LimitedProtocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if send_buffer is not None and sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
            self._served = None  # the cycle that last completed (None: none yet)
            self._header_timer = None
            self._arm()

        def _arm(self) -> None:
            if timeout is not None:
                self._header_timer = self.loop.call_later(timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and self.cycle is not self._served:
                self._disarm()  # a request's headers arrived

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._served = self.cycle
            self._disarm()
            self._arm()  # the next request's headers are on the clock too

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.cycle is None or self.cycle is self._served:
                self.transport.close()

    return LimitedProtocol


def uvicorn_config(app, config, **options) -> uvicorn.Config:
    """uvicorn's Config for `app` as the ServerConfig's connection limits say (host, port and
    the rest in `options`)."""
    limits = config.connections
    http = "h11"
    if limits.header_timeout is not None or limits.send_buffer_bytes is not None:
        http = limited_protocol(limits.header_timeout, limits.send_buffer_bytes)
    return uvicorn.Config(
        app, http=http, limit_concurrency=limits.limit_concurrency,
        timeout_keep_alive=limits.timeout_keep_alive, **options,
    )  # fmt: skip


async def _no_body():
    return {"type": "http.disconnect"}


class BodyLimits:
    """ASGI middleware: a request body over `max_bytes` gets a 413, from its Content-Length
    before anything is read, or as soon as the bytes received pass the limit (a chunked body),
    so at most `max_bytes` are ever held; a body not all there `timeout` seconds after its
    headers gets a 408. The app then reads the buffered body. `on_refused(reason)` is told of
    each refusal (the error metrics)."""

    def __init__(self, app, max_bytes: int | None, timeout: float | None, on_refused=None):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        limit = self.max_bytes
        if length is not None and (
            not length.isdigit() or (limit is not None and int(length) > limit)
        ):
            return await self._too_large(send, length.decode(errors="replace"))
        try:
            async with asyncio.timeout(self.timeout):
                body = await self._read(receive)
        except TimeoutError:
            return await self._refuse(
                send, 408, "request_timeout",
                f"the request body did not arrive within {self.timeout:g} s "
                "(--timeout-request-body)",
            )  # fmt: skip
        except _TooLarge as e:
            return await self._too_large(send, f"more than {e.args[0]}")
        if body is None:
            return  # the client left before its body arrived: nobody to answer
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # then what follows the body: a disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            size += len(message.get("body", b""))
            if self.max_bytes is not None and size > self.max_bytes:
                raise _TooLarge(size)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, send, size: str) -> None:
        message = (
            f"the request body ({size} bytes) is larger than this server accepts: "
            f"{self.max_bytes} bytes (--max-request-body-bytes)"
        )
        await self._refuse(send, 413, "too_large", message)

    async def _refuse(self, send, status: int, reason: str, message: str) -> None:
        if self.on_refused is not None:
            self.on_refused(reason)
        # Connection: close, so that uvicorn drops the connection with its unread body
        response = JSONResponse(
            error_body(message, status), status_code=status, headers={"Connection": "close"}
        )
        await response({"type": "http"}, _no_body, send)


class _TooLarge(Exception):
    pass
