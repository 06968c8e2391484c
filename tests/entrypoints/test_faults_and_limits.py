"""Fault isolation, limits and security defaults of the server, over real HTTP on loopback.

A tiny random Llama (the default model's vocabulary, so its tokenizer applies) keeps this fast:
the tests check what the server does with faults and hostile requests, not what the model says.
Faults are injected in-process (uvicorn in a thread over the real AsyncLLMEngine); the logging
and bind defaults run `pagedllm serve` as a subprocess.
"""

import json
import os
import re
import subprocess
import threading
import time
import uuid

import httpx
import openai
import pytest
import uvicorn

from pagedllm.config import EngineArgs
from pagedllm.engine import llm_engine, output_processor
from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.openai import serving_completion
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.server_config import ServerConfig, ServerLimits
from tests.conftest import runner_of, save_tiny_llama
from tests.server_process import free_port, start_server

TOKENIZER = "SmolLM2-135M-Instruct"
POISON = [7, 7, 7, 7, 7]  # the prompt whose detokenizer raises
GOOD = [[11, 12, 13], [21, 22, 23, 24], [31, 32], [41, 42, 43, 44, 45]]
BODY_LIMIT = 64 << 10
TIMEOUT = 120  # seconds: generous, the machine may be busy


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-49k")
    save_tiny_llama(path, vocab_size=49152, max_position_embeddings=512)
    return str(path)


def _engine(model: str) -> AsyncLLMEngine:
    args = EngineArgs(
        model=model, tokenizer=TOKENIZER, device="cpu", max_model_len=256, kv_cache_memory="16MiB"
    )
    return AsyncLLMEngine(llm_engine.LLMEngine(args))


class InProcessServer:
    """uvicorn in a thread, on loopback, over an AsyncLLMEngine the test can reach into."""

    def __init__(self, async_engine: AsyncLLMEngine, **options) -> None:
        self.engine = async_engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = build_app(async_engine, ServerConfig("tiny", **options))
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + TIMEOUT
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)

    def stop_app(self) -> None:
        """Stop serving; the engine (maybe shared with another app) goes on."""
        self.server.should_exit = True
        self.thread.join(30)

    def stop(self) -> None:
        self.stop_app()
        self.engine.shutdown()

    def wait_idle(self) -> dict:
        """The engine's stats once nothing runs, waits or holds a block."""
        deadline = time.time() + TIMEOUT
        while True:
            stats = self.engine.engine.get_stats()
            busy = stats["num_running"] + stats["num_waiting"] + stats["num_swapped"]
            if not busy and stats["kv_cache_usage"] == 0:
                return stats
            assert time.time() < deadline, stats
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tiny_model):
    limits = ServerLimits(max_request_body_bytes=BODY_LIMIT, max_logprobs=5)
    s = InProcessServer(_engine(tiny_model), limits=limits)
    yield s
    s.stop()


def _error(response: httpx.Response, status: int, fragment: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and fragment in error["message"], error
    return error


def _sse_events(response: httpx.Response):
    """The stream's `data:` payloads, as they come."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[6:]


# -- fault isolation ----------------------------------------------------------------------------
def test_a_failing_request_fails_alone(server, monkeypatch):
    url = f"{server.url}/v1/completions"
    base = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}
    # The reference texts, each request alone.
    with httpx.Client(timeout=TIMEOUT) as http:
        alone = [http.post(url, json={**base, "prompt": p}).json() for p in GOOD]
    expected = [r["choices"][0]["text"] for r in alone]
    assert all(r["choices"][0]["finish_reason"] == "length" for r in alone)

    faults = []  # (request id, requests running with it) per injected fault

    class PoisonedDetokenizer(IncrementalDetokenizer):
        def __init__(self, tokenizer, prompt_token_ids, params):
            super().__init__(tokenizer, prompt_token_ids, params)
            self.poisoned = list(prompt_token_ids) == POISON

        def update(self, new_token_ids, stop_terminated=False):
            if self.poisoned:
                faults.append(server.engine.engine.scheduler.num_running)
                raise RuntimeError("injected detokenizer fault")
            return super().update(new_token_ids, stop_terminated)

    monkeypatch.setattr(output_processor, "IncrementalDetokenizer", PoisonedDetokenizer)
    runner = runner_of(server.engine.engine)
    execute_model = runner.execute_model

    def slow_step(*args, **kwargs):
        if len(faults) < 2:  # slow steps (200 take 10 s) until both poisoned requests failed:
            time.sleep(0.05)  # the good requests surely still decode when those come
        return execute_model(*args, **kwargs)

    monkeypatch.setattr(runner, "execute_model", slow_step)

    texts: list[str | None] = [None] * len(GOOD)
    started = [threading.Event() for _ in GOOD]

    def good(i: int) -> None:
        body = {**base, "prompt": GOOD[i], "stream": True}
        parts = []
        with httpx.Client(timeout=TIMEOUT) as http, http.stream("POST", url, json=body) as r:
            for event in _sse_events(r):
                started[i].set()
                if event != "[DONE]":
                    parts.append(json.loads(event)["choices"][0]["text"])
        texts[i] = "".join(parts)

    threads = [threading.Thread(target=good, args=(i,)) for i in range(len(GOOD))]
    for t in threads:
        t.start()
    for event in started:
        assert event.wait(TIMEOUT)
    # While the good requests decode: the poisoned prompt, non-streamed and streamed.
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as failed:
        client.completions.create(model="tiny", prompt=POISON, max_tokens=5)
    assert failed.value.status_code == 500
    body = failed.value.body
    message = (body.get("error", body) if isinstance(body, dict) else {}).get("message", "")
    assert message.startswith("request cmpl-") and "-0 failed: RuntimeError(" in message
    assert "injected detokenizer fault" in message
    with httpx.Client(timeout=TIMEOUT) as http:
        body = {"prompt": POISON, "max_tokens": 5, "stream": True}
        response = http.post(url, json=body)
        # The fault comes with the first token, before the stream starts: a 500 too.
        error = _error(response, 500, "injected detokenizer fault")
        assert error["type"] == "InternalServerError" and "request cmpl-" in error["message"]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        # A healthy request during all this succeeds.
        assert http.post(f"{server.url}/v1/chat/completions", json=chat).status_code == 200
    for t in threads:
        t.join(TIMEOUT)
    assert texts == expected  # the others finished, their text unchanged
    assert len(faults) == 2 and min(faults) >= 2, faults  # faults hit shared batches
    assert server.wait_idle()["kv_cache_usage"] == 0  # every block back in the pool
    assert server.engine.is_running and not server.engine.output_processor.states


def test_offline_a_failing_request_fails_alone_in_the_batch(tiny_model, monkeypatch):
    """The engine itself (LLM.generate, no server): the failed request's output carries the
    error, the rest of the batch is what it is without the fault, and the pool is whole."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=tiny_model, tokenizer=TOKENIZER, device="cpu", max_model_len=256,
              kv_cache_memory="16MiB")  # fmt: skip
    engine = llm.llm_engine
    prompts = [{"prompt_token_ids": p} for p in [*GOOD, POISON]]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["zz"]),
    ]
    before = llm.generate(prompts, params, use_tqdm=False)

    class LateFault(IncrementalDetokenizer):
        def __init__(self, tokenizer, prompt_token_ids, params):
            super().__init__(tokenizer, prompt_token_ids, params)
            self.poisoned = list(prompt_token_ids) == POISON

        def update(self, new_token_ids, stop_terminated=False):
            if self.poisoned and self.num_tokens >= 5:
                raise RuntimeError("injected offline fault")
            return super().update(new_token_ids, stop_terminated)

    monkeypatch.setattr(output_processor, "IncrementalDetokenizer", LateFault)
    after = llm.generate(prompts, params, use_tqdm=False)
    for ok, again in zip(before[:4], after[:4], strict=True):
        assert again.error is None
        assert [(c.text, c.token_ids) for c in again.outputs] == [
            (c.text, c.token_ids) for c in ok.outputs
        ]
    failed = after[4]
    assert failed.finished and failed.outputs == [] and "injected offline fault" in failed.error
    assert failed.error.startswith(f"request {failed.request_id} failed")
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.num_blocks
    assert not engine.has_unfinished_requests() and not engine.output_processor.states


def test_a_fault_in_an_open_stream_ends_it_with_an_error_event(server, monkeypatch):
    """The fault on a later token: the stream has started, so the error comes in-band."""

    class LateFault(IncrementalDetokenizer):
        def __init__(self, tokenizer, prompt_token_ids, params):
            super().__init__(tokenizer, prompt_token_ids, params)
            self.poisoned = list(prompt_token_ids) == POISON

        def update(self, new_token_ids, stop_terminated=False):
            if self.poisoned and self.num_tokens >= 3:
                raise ValueError("injected late fault")
            return super().update(new_token_ids, stop_terminated)

    monkeypatch.setattr(output_processor, "IncrementalDetokenizer", LateFault)
    body = {"prompt": POISON, "max_tokens": 20, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=TIMEOUT) as http,
        http.stream("POST", f"{server.url}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        events = list(_sse_events(response))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 4 and all("choices" in c for c in chunks[:3])  # 3 tokens, then:
    error = chunks[-1]["error"]
    assert error["code"] == 500 and "injected late fault" in error["message"]
    assert error["message"].startswith("request cmpl-")
    # A ValueError here is not bad input: a 500, not a 400.
    assert server.wait_idle()["kv_cache_usage"] == 0 and server.engine.is_running


def test_a_fault_formatting_one_answer_is_a_500_naming_it(server, monkeypatch):
    """The HTTP layer's own per-request work (logprobs in OpenAI's format) raising."""

    def broken(*args, **kwargs):
        raise ZeroDivisionError("injected formatting fault")

    monkeypatch.setattr(serving_completion, "completion_logprobs", broken)
    url = f"{server.url}/v1/completions"
    body = {"prompt": GOOD[0], "max_tokens": 3, "logprobs": 2}
    with httpx.Client(timeout=TIMEOUT) as http:
        error = _error(http.post(url, json=body), 500, "injected formatting fault")
        assert error["message"].startswith("request cmpl-")
        with http.stream("POST", url, json={**body, "stream": True}) as response:
            assert response.status_code == 200
            events = list(_sse_events(response))
        assert events[-1] == "[DONE]" and len(events) == 2
        error = json.loads(events[0])["error"]
        assert error["code"] == 500 and error["message"].startswith("request cmpl-")
        assert "injected formatting fault" in error["message"]
        # Without logprobs (nothing to format) the same request is served.
        assert http.post(url, json={**body, "logprobs": None}).status_code == 200
    assert server.wait_idle()["kv_cache_usage"] == 0


def test_a_dead_engine_loop_gives_503s_and_nothing_hangs(tiny_model, monkeypatch):
    s = InProcessServer(_engine(tiny_model))
    runner = runner_of(s.engine.engine)
    execute_model = runner.execute_model
    kill = threading.Event()

    def step(*args, **kwargs):
        if kill.is_set():
            raise RuntimeError("injected model fault")
        time.sleep(0.01)  # slow steps: the requests are surely still running when it dies
        return execute_model(*args, **kwargs)

    monkeypatch.setattr(runner, "execute_model", step)
    try:
        url = f"{s.url}/v1/completions"
        body = {"prompt": GOOD[0], "max_tokens": 240, "ignore_eos": True}
        results = {}
        started = threading.Event()

        def streamed() -> None:
            with (
                httpx.Client(timeout=TIMEOUT) as http,
                http.stream("POST", url, json={**body, "stream": True}) as r,
            ):
                events = []
                for event in _sse_events(r):
                    started.set()
                    events.append(event)
                results["stream"] = events

        def plain() -> None:
            with httpx.Client(timeout=TIMEOUT) as http:
                results["plain"] = http.post(url, json={**body, "prompt": GOOD[1]})

        threads = [threading.Thread(target=streamed), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert started.wait(TIMEOUT)
        deadline = time.time() + TIMEOUT
        while s.engine.engine.get_stats()["num_running"] < 2:  # both in flight
            assert time.time() < deadline
            time.sleep(0.01)
        kill.set()
        for t in threads:
            t.join(TIMEOUT)
            assert not t.is_alive(), "an in-flight request hung"
        events = results["stream"]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "the engine loop died" in error["message"]
        assert "injected model fault" in error["message"]
        _error(results["plain"], 503, "the engine loop died")

        with httpx.Client(timeout=10) as http:
            _error(http.get(f"{s.url}/health"), 503, "the engine loop has stopped")
            for path, new in (
                ("/v1/completions", {"prompt": GOOD[2], "max_tokens": 2}),
                ("/v1/completions", {"prompt": GOOD[2], "max_tokens": 2, "stream": True}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ):
                response = http.post(f"{s.url}{path}", json=new)
                _error(response, 503, "injected model fault")
                assert response.headers["retry-after"] == "1"
            assert http.get(f"{s.url}/v1/models").status_code == 200  # the rest still answers
    finally:
        s.stop()


# -- limits -------------------------------------------------------------------------------------
def test_body_size_limit_413_by_length_and_by_bytes_read(server):
    url = f"{server.url}/v1/completions"
    big = json.dumps({"prompt": "x" * BODY_LIMIT, "max_tokens": 1}).encode()
    with httpx.Client(timeout=TIMEOUT) as http:
        error = _error(http.post(url, content=big), 413, f"{BODY_LIMIT} bytes")
        assert error["type"] == "RequestTooLargeError"
        assert "--max-request-body-bytes" in error["message"]

        # No Content-Length (chunked): refused once the bytes read pass the limit.
        def chunks():
            for _ in range(2 * BODY_LIMIT // 4096):
                yield b" " * 4096

        _error(http.post(url, content=chunks()), 413, f"{BODY_LIMIT} bytes")
        # A body just under the limit is read and served.
        prompt = " ".join(["hi"] * ((BODY_LIMIT - 100) // 3))
        ok = json.dumps({"prompt": prompt[: BODY_LIMIT - 100], "max_tokens": 1}).encode()
        assert len(ok) < BODY_LIMIT
        response = http.post(url, content=ok, headers={"content-type": "application/json"})
        assert response.status_code in (200, 400), response.text  # 400: the prompt's length
        assert response.status_code != 413
        assert http.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        ("/v1/completions", {"n": 17}, "n", "at most 16 (--max-n)"),
        ("/v1/completions", {"n": 2, "best_of": 17}, "best_of", "at most 16 (--max-n)"),
        ("/v1/completions", {"n": 17, "use_beam_search": True}, "n", "--max-n"),
        ("/v1/completions", {"logprobs": 6}, "logprobs", "at most 5 (--max-logprobs)"),
        ("/v1/completions", {"logprobs": 6, "echo": True}, "logprobs", "at most 5"),
        ("/v1/completions", {"logprobs": 21}, "logprobs", "in [0, 20]"),  # the engine's cap
        ("/v1/completions", {"stop": ["s"] * 65}, "stop", "at most 64 (--max-stop)"),
        ("/v1/completions", {"stop_token_ids": [3] * 65}, "stop_token_ids", "--max-stop"),
        ("/v1/completions", {"prompt": [[5]] * 129}, "prompt", "at most 128 (--max-prompts)"),
        ("/v1/chat/completions", {"n": 17}, "n", "--max-n"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 6}, "top_logprobs",
         "[0, 5] (--max-logprobs)"),
        ("/v1/chat/completions", {"stop": ["s"] * 65}, "stop", "--max-stop"),
    ],
)  # fmt: skip
def test_request_limits_400(server, path, body, param, fragment):
    base = {"prompt": [5, 6]} if path == "/v1/completions" else {}
    if path != "/v1/completions":
        base = {"messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=TIMEOUT) as http:
        response = http.post(f"{server.url}{path}", json={**base, "max_tokens": 2, **body})
    assert _error(response, 400, fragment)["param"] == param


def test_requests_at_the_limits_are_served(server):
    url = f"{server.url}/v1/completions"
    at_limit = [
        {"prompt": [5, 6], "n": 16},
        {"prompt": [5, 6], "logprobs": 5, "echo": True},
        {"prompt": [5, 6], "stop": [f"s{i}" for i in range(64)], "stop_token_ids": [3] * 64},
    ]
    with httpx.Client(timeout=TIMEOUT) as http:
        for body in at_limit:
            response = http.post(url, json={**body, "max_tokens": 2})
            assert response.status_code == 200, response.text
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = http.post(
            f"{server.url}/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 5}
        )
        assert response.status_code == 200, response.text
    server.wait_idle()


def test_limit_and_security_flag_defaults():
    ns = build_parser().parse_args(["serve"])
    assert ns.host == "127.0.0.1"  # loopback unless told otherwise
    assert (ns.max_request_body_bytes, ns.max_n, ns.max_logprobs) == (8 << 20, 16, 20)
    assert (ns.max_stop, ns.max_prompts, ns.max_waiting_requests) == (64, 128, 1024)
    assert not ns.enable_log_requests and not ns.disable_metrics_auth and ns.api_key is None
    ns = build_parser().parse_args(["serve", "--max-request-body-bytes", "1MiB"])
    assert ns.max_request_body_bytes == 1 << 20
    for bad in (dict(max_logprobs=21), dict(max_n=0), dict(max_prompts=0), dict(max_stop=-1),
                dict(max_request_body_bytes=0)):  # fmt: skip
        with pytest.raises(ValueError, match="--max-"):
            ServerLimits(**bad)


# -- security defaults --------------------------------------------------------------------------
_BODIES = {
    "/v1/completions": {"prompt": [5, 6], "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [5, 6]},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1},
    "/v1/messages": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
    },
    "/v1/messages/count_tokens": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/embeddings": {"input": "hi"},
    "/pooling": {"input": "hi"},
}
# Routes whose answer past the key check is not a 200 on this (generating) server: the status
# that shows the key was taken.
_PAST_THE_KEY = {"/v1/embeddings": 400, "/pooling": 400, "/v1/responses/{response_id}": 404}


@pytest.mark.parametrize("metrics_open", [False, True])
def test_api_key_guards_every_route_but_health(server, metrics_open):
    key = "sk-" + uuid.uuid4().hex
    keyed = InProcessServer(
        server.engine, api_key=key, metrics_need_api_key=not metrics_open
    )  # the same engine behind a second app
    try:
        routes = [
            (method, route.path)
            for route in keyed.server.config.app.routes
            for method in sorted(getattr(route, "methods", ()) or ())
            if method != "HEAD"
        ]
        paths = {path for _, path in routes}
        assert {"/health", "/metrics", "/v1/models", "/v1/completions", "/version"} <= paths
        open_paths = {"/health", "/ready", "/metrics"} if metrics_open else {"/health", "/ready"}
        checked = 0
        with httpx.Client(base_url=keyed.url, timeout=TIMEOUT) as http:
            for method, path in routes:
                body = _BODIES.get(path) if method == "POST" else None
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                    response = http.request(method, path, json=body, headers=headers)
                    if path in open_paths:
                        assert response.status_code == 200, (method, path)
                    elif path.startswith("/v1/messages"):  # Anthropic's error shape there
                        assert response.status_code == 401, (method, path)
                        assert response.json()["error"]["type"] == "authentication_error"
                    else:
                        _error(response, 401, "API key")
                    checked += 1
                # The key as a Bearer token, or as Anthropic's clients send it
                for right in ({"Authorization": f"Bearer {key}"}, {"x-api-key": key}):
                    response = http.request(method, path, json=body, headers=right)
                    expected = _PAST_THE_KEY.get(path, 200)
                    assert response.status_code == expected, (method, path, response.text)
                    checked += 1
        assert checked == 5 * len(routes) and len(routes) >= 16
    finally:
        keyed.stop_app()


def _serve(model: str, *flags: str) -> tuple[subprocess.Popen, str, list[str]]:
    return start_server(
        ["--model", model, "--tokenizer", TOKENIZER, "--device", "cpu", "--max-model-len", "256",
         "--kv-cache-memory", "16MiB", *flags],
        TIMEOUT, env={**os.environ, "PAGEDLLM_LOGGING_LEVEL": "DEBUG"},
    )  # fmt: skip


@pytest.mark.parametrize("log_requests", [False, True])
def test_prompts_reach_the_log_only_with_the_flag(tiny_model, log_requests):
    flags = ["--enable-log-requests"] if log_requests else []
    proc, url, lines = _serve(tiny_model, *flags)
    secret = f"secret-prompt-{uuid.uuid4().hex}"
    try:
        assert f"serving {tiny_model} at http://127.0.0.1:" in "".join(lines)  # loopback
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            for path, body in (
                ("/v1/completions", {"prompt": secret, "max_tokens": 2}),
                ("/v1/completions", {"prompt": secret, "max_tokens": 2, "stream": True}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": secret}]}),
                ("/v1/completions", {"prompt": secret, "max_tokens": 1000}),  # a 400
                ("/tokenize", {"prompt": secret}),
            ):
                http.post(path, json=body)
    finally:
        proc.terminate()
        proc.wait(30)
    log = "".join(lines)
    assert "server stopped" in log
    # The start-up line: where the time to serving went (the engine process started first).
    started = r"ready in [0-9.]+ s: imports [0-9.]+ s, engine \(started before the imports\) "
    assert re.search(started + r"[0-9.]+ s, server", log), log
    assert (secret in log) == log_requests, log
    if log_requests:  # the three requests that reached the engine
        assert sum(secret in line for line in lines) == 3, log


def test_engine_exception_in_add_request_fails_that_request_only(server, monkeypatch):
    """A non-ValueError while adding one request used to kill the engine loop."""
    inputs = server.engine.engine.input_processor
    original = inputs.process

    def process(core, grammar=None):
        if core.prompt_token_ids == POISON:
            raise KeyError("injected add fault")
        return original(core, grammar)

    monkeypatch.setattr(inputs, "process", process)
    with httpx.Client(timeout=TIMEOUT) as http:
        url = f"{server.url}/v1/completions"
        _error(http.post(url, json={"prompt": POISON, "max_tokens": 2}), 500, "injected add")
        assert http.post(url, json={"prompt": GOOD[0], "max_tokens": 2}).status_code == 200
    assert server.engine.is_running and server.wait_idle()["kv_cache_usage"] == 0


def test_a_raised_max_n_still_meets_the_engines_max_num_seqs(server):
    """--max-n above --max-num-seqs (256 here): the engine's own refusal still answers."""
    wide = InProcessServer(server.engine, limits=ServerLimits(max_n=1000))
    try:
        body = {"prompt": [5, 6], "n": 300, "max_tokens": 1}
        with httpx.Client(timeout=TIMEOUT) as http:
            _error(http.post(f"{wide.url}/v1/completions", json=body), 400, "max_num_seqs")
    finally:
        wide.stop_app()
