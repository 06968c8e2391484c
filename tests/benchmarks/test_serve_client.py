"""bench serve's client: a request whose connection closes before any response is sent once
more (a keep-alive race that llama-server hits now and then); any other failure is kept."""

from __future__ import annotations

import asyncio

import httpx

from pagedllm.bench.serve import _send

SSE = (
    b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}\n\n'
    b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\ndata: [DONE]\n\n'
)


def _run(fail_times: int, error: type[Exception] = httpx.RemoteProtocolError):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) <= fail_times:
            raise error("Server disconnected without sending a response.")
        return httpx.Response(200, content=SSE)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await _send(client, "http://peer/v1/completions", "m", ([1, 2, 3], 2))

    return asyncio.run(go()), len(calls)


def test_closed_before_a_response_is_sent_once_more():
    result, calls = _run(fail_times=1)
    assert calls == 2 and result.retried and result.error is None
    assert result.output_len == 2 and result.ttft > 0


def test_a_second_close_or_another_error_fails_the_request():
    result, calls = _run(fail_times=2)
    assert calls == 2 and result.error and "RemoteProtocolError" in result.error
    result, calls = _run(fail_times=1, error=httpx.ConnectError)
    assert calls == 1 and not result.retried and "ConnectError" in result.error


def test_a_clean_request_is_not_retried():
    result, calls = _run(fail_times=0)
    assert calls == 1 and not result.retried and result.output_len == 2
