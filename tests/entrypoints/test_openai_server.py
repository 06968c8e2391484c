"""`pagedllm serve` as a real subprocess on loopback, driven by the `openai` client and httpx."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pagedllm.bench.utils import free_port
from pagedllm.model_loader.loader import load_tokenizer, resolve_model
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

PAGEDLLM = [sys.executable, "-m", "pagedllm.entrypoints.cli"]
FLAGS = ["--max-model-len", "512", "--kv-cache-memory", "64MiB"]
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


class Server:
    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [*PAGEDLLM, "serve", "--port", str(self.port), *FLAGS, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        key = (env or {}).get("PAGEDLLM_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}  # /metrics needs it
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.reader.join(5)
                raise RuntimeError(f"the server exited:\n{self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("the server did not come up in 120 s")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def stop(self) -> str:
        """SIGTERM, as a service manager would; returns the server's log."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(5)
        return self.log

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=5).text
        values = {}
        for line in text.splitlines():
            if line.startswith("pagedllm:"):
                name, value = line.rsplit(" ", 1)
                values[name.split("{")[0]] = float(value)
        return values

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            busy = m["pagedllm:num_requests_running"] + m["pagedllm:num_requests_waiting"]
            if (not busy and m["pagedllm:kv_cache_usage_perc"] == 0) or time.time() > deadline:
                return m
            time.sleep(0.1)


@pytest.fixture(scope="module")
def server():
    s = Server("--log-stats-interval", "1")
    yield s
    log = s.stop()
    assert s.proc.returncode == 0, log
    assert f"serving {MODEL} at {s.url}/v1" in log and "server stopped" in log


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


def test_stats_log_line(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
    # The fixture's server logs every second while busy.
    wait_until(lambda: "Avg generation throughput:" in server.log, "the stats log line")
    line = next(x for x in server.lines if "Avg generation throughput:" in x)
    assert "Running:" in line and "KV cache usage:" in line and "Prefix cache hit rate:" in line


def test_models_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_streamed_equals_non_streamed_and_usage(client, tokenizer):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    choice = full.choices[0]
    assert choice.text and choice.finish_reason in ("length", "stop")
    assert full.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert full.usage.completion_tokens <= 16
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == choice.finish_reason and set(finishes[:-1]) <= {None}


def test_completion_prompt_forms_n_and_echo(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    one = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    # A list of prompts (text and token ids), n=2 each: indices prompt_index * n + i.
    many = client.completions.create(
        model=MODEL, prompt=[ids, ids], max_tokens=8, temperature=0, n=2
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert all(c.text == one.choices[0].text for c in many.choices)
    assert many.usage.prompt_tokens == 2 * len(ids)
    echo = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True
    )
    assert echo.choices[0].text == PROMPT + one.choices[0].text

    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=3)
    a = client.completions.create(n=3, **kwargs)
    b = client.completions.create(n=3, **kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # seed + i per sample
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(n=3, stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in a.choices]
    best = client.completions.create(n=2, best_of=4, **kwargs)
    assert [c.index for c in best.choices] == [0, 1]


def test_completion_logprobs_and_stop(client):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert top[token] == logprob == max(top.values())  # greedy: the most likely token

    full = out.choices[0].text
    stop = full.strip()[2:5]
    stopped = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full[: full.index(stop)]


def test_chat_streamed_equals_non_streamed_multi_turn_and_logprobs(client, tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        *CHAT,
    ]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=16, temperature=0
    )
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert full.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    assert full.usage.completion_tokens <= 16

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        message.content
    )
    assert chunks[-1].usage == full.usage

    lp = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode() == entry.token
    two = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0.9, seed=1, n=2
    )
    assert [c.index for c in two.choices] == [0, 1]


def test_streams_of_n_echo_logprobs_and_beam_search(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0.9, seed=1, n=2)
    full = client.chat.completions.create(**kwargs)
    streamed, roles = {0: "", 1: ""}, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            roles += [c.index] if c.delta.role else []
            streamed[c.index] += c.delta.content or ""
    assert roles == [0, 1]
    assert [streamed[0], streamed[1]] == [c.message.content for c in full.choices]

    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    full = client.completions.create(**kwargs).choices[0].text
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)) == (
        full
    )
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    tokens, offsets, text = [], [], ""
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text += c.text
            tokens += c.logprobs.tokens
            offsets += c.logprobs.text_offset
    assert "".join(tokens) == text and offsets == [len("".join(tokens[:i])) for i in range(6)]

    beam = dict(use_beam_search=True, length_penalty=1.0)
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=6, n=2, best_of=3, extra_body=beam)
    out = client.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1] and out.choices[0].text != out.choices[1].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert sorted(c.choices[0].text for c in chunks) == sorted(c.text for c in out.choices)


def test_echo_with_logprobs_scores_the_prompt_too(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    plain = client.completions.create(**kwargs).choices[0].logprobs
    echoed = client.completions.create(echo=True, **kwargs).choices[0]
    lp = echoed.logprobs
    n = len(ids)
    assert len(lp.tokens) == n + len(plain.tokens)
    # The first prompt token has nothing before it; every other token has a logprob.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    # The completion's part is what the same request without echo reports, offset by the prompt.
    assert lp.tokens[n:] == plain.tokens
    assert lp.token_logprobs[n:] == pytest.approx(plain.token_logprobs, abs=1e-4)
    assert lp.text_offset[n:] == [o + len(PROMPT) for o in plain.text_offset]
    assert lp.text_offset[:n] == [len("".join(lp.tokens[:i])) for i in range(n)]
    streamed_tokens, streamed_lps = [], []
    for chunk in client.completions.create(echo=True, stream=True, **kwargs):
        for c in chunk.choices:
            streamed_tokens += c.logprobs.tokens
            streamed_lps += c.logprobs.token_logprobs
    assert streamed_tokens == lp.tokens
    assert streamed_lps[0] is None
    assert streamed_lps[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)


def test_tokenize_and_detokenize(server, tokenizer):
    url = server.url
    ids = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT}).json()
    assert ids == {"count": 5, "max_model_len": 512, "tokens": tokenizer.encode(PROMPT)}
    chat = httpx.post(f"{url}/tokenize", json={"messages": CHAT}).json()
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    back = httpx.post(f"{url}/detokenize", json={"tokens": ids["tokens"]}).json()
    assert back == {"prompt": PROMPT}
    _error(httpx.post(f"{url}/detokenize", json={"tokens": [-1]}), 400)
    _error(httpx.post(f"{url}/tokenize", json={}), 400)
    _error(httpx.post(f"{url}/tokenize", json={"prompt": "x", "model": "other"}), 404)


def test_32_concurrent_requests(client, server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        async with aclient:
            calls = [
                aclient.completions.create(
                    model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=8, temperature=0
                )
                if i % 2
                else aclient.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"Count to {i}."}],
                    max_tokens=8,
                    temperature=0,
                )
                for i in range(32)
            ]
            return await asyncio.gather(*calls)

    before = server.metrics()
    results = asyncio.run(main())
    assert len(results) == 32 and all(r.usage.completion_tokens > 0 for r in results)
    after = server.wait_idle()
    assert after["pagedllm:num_requests_running"] == 0

    def grew(name):
        return after[name] - before.get(name, 0)

    assert grew("pagedllm:e2e_request_latency_seconds_count") == 32
    assert grew("pagedllm:time_to_first_token_seconds_count") == 32
    # One output per generated token (n = 1): one gap fewer than tokens, per request.
    assert grew("pagedllm:inter_token_latency_seconds_count") == sum(
        r.usage.completion_tokens - 1 for r in results
    )
    assert grew("pagedllm:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in results)
    assert grew("pagedllm:generation_tokens_total") == sum(
        r.usage.completion_tokens for r in results
    )


def test_client_disconnect_aborts_the_request(server):
    long = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST", f"{server.url}/v1/completions", json={**long, "stream": True}
        ) as response:
            assert response.status_code == 200
            # Held: a dropped line iterator is closed at once, and closes the connection.
            lines = response.iter_lines()
            for i, _ in enumerate(lines):
                if i >= 6:
                    break
            assert server.metrics()["pagedllm:num_requests_running"] == 1
        # Closed after a few chunks: the request is aborted and its blocks freed.
        m = server.wait_idle()
        assert m["pagedllm:num_requests_running"] == 0
        assert m["pagedllm:kv_cache_usage_perc"] == 0

        # A non-streaming client that gives up is aborted too.
        with pytest.raises(httpx.ReadTimeout):
            http.post(f"{server.url}/v1/completions", json=long, timeout=1.0)
        m = server.wait_idle()
        assert m["pagedllm:num_requests_running"] == 0
        assert m["pagedllm:kv_cache_usage_perc"] == 0

        assert http.get(f"{server.url}/health").status_code == 200
        after = http.post(f"{server.url}/v1/completions", json={"prompt": PROMPT})
        assert after.status_code == 200 and after.json()["choices"][0]["text"]


def test_bench_serve(server, tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [*PAGEDLLM, "bench", "serve", "--base-url", server.url, "--num-prompts", "6",
         "--scale", "0.1", "--request-rate", "20", "--max-concurrency", "4",
         "--result-json", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Successful requests:" in result.stdout and "Mean TTFT (ms):" in result.stdout
    summary = json.loads(out.read_text())
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_output_tokens"] > 6 and summary["mean_ttft_ms"] > 0


def _error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


@pytest.mark.parametrize(
    "path, body, status, message",
    [
        ("completions", {"prompt": "x", "max_tokens": 600}, 400,
         "maximum context length is 512 tokens. However, you requested 601 tokens "
         "(1 in the input, 600 in the completion)"),
        ("completions", {"prompt": "x " * 600}, 400, "maximum context length is 512 tokens"),
        ("chat/completions", {"messages": CHAT, "max_tokens": 500}, 400,
         "maximum context length is 512 tokens"),
        ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature must be"),
        ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p must be in (0, 1]"),
        ("completions", {"prompt": "x", "n": 0}, 400, "n must be an integer >= 1"),
        ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be"),
        ("completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs must be"),
        ("completions", {"prompt": "x", "n": 2, "best_of": 1}, 400, "best_of must be"),
        ("completions", {"prompt": "x", "n": "two"}, 400, "n: Input should be a valid integer"),
        ("completions", {"prompt": "x", "seed": 2**64}, 400, "seed must be a 64-bit"),
        ("completions", {"prompt": "x", "n": 10**6}, 400, "at most 16 (--max-n)"),
        ("completions", {"prompt": "x", "top_k": 10**12, "max_tokens": 10**12}, 400,
         "maximum context length"),
        ("completions", {"prompt": 3}, 400, "prompt"),
        ("completions", {"max_tokens": 3}, 400, "prompt: Field required"),
        ("completions", {"prompt": [999999]}, 400, "out of range"),
        ("completions", {"prompt": ""}, 400, "empty"),
        ("completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
        ("completions", {"prompt": "x", "stream": True, "best_of": 2}, 400, "best_of"),
        ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "`gpt-4` does not exist"),
        ("chat/completions", {"messages": []}, 400, "messages"),
        ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400,
         "max_tokens must be"),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         400, "only text content parts"),
        ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "logprobs must be"),
        ("chat/completions", {"messages": [{"content": "hi"}]}, 400, "role"),
    ],
)  # fmt: skip
def test_errors(server, path, body, status, message):
    error = _error(httpx.post(f"{server.url}/v1/{path}", json=body, timeout=30), status)
    assert message in error["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200  # the engine lives on


def test_malformed_json_and_unknown_route(server):
    response = httpx.post(
        f"{server.url}/v1/completions",
        content=b'{"prompt": "x",',
        headers={"content-type": "application/json"},
    )
    assert "not valid JSON" in _error(response, 400)["message"]
    _error(httpx.get(f"{server.url}/v1/nothing"), 404)
    # The stream of a bad request is refused before it starts, with the status.
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": [999999], "stream": True})
    _error(response, 400)
    assert server.wait_idle()["pagedllm:num_requests_running"] == 0


TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def test_api_key_served_model_name_and_chat_template(tokenizer):
    server = Server(
        "--served-model-name", "smol", "--chat-template", TEMPLATE,
        "--max-num-seqs", "1", "--max-num-queued-reqs", "1", "--graceful-shutdown-timeout", "1",
        env={"PAGEDLLM_API_KEY": "sekrit"},
    )  # fmt: skip
    try:
        url = f"{server.url}/v1/models"
        _error(httpx.get(url), 401)
        _error(httpx.get(url, headers={"Authorization": "Bearer wrong"}), 401)
        ok = httpx.get(url, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "smol"
        assert httpx.get(f"{server.url}/health").status_code == 200  # not under /v1
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekrit", max_retries=0)
        out = client.completions.create(model="smol", prompt=PROMPT, max_tokens=4)
        assert out.choices[0].text
        chat = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=4)
        rendered = f"user: {CHAT[0]['content']}\nassistant:"
        assert chat.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
        _check_waiting_queue_bound(server, client)
        _check_disconnect_while_queued(server, client)
        # SIGTERM with a stream open: it gets a second, then ends with an error event.
        response = httpx.Client(timeout=30).send(
            httpx.Request(
                "POST",
                f"{server.url}/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True},
                headers={"Authorization": "Bearer sekrit"},
            ),
            stream=True,
        )
        lines = response.iter_lines()
        assert next(lines).startswith("data: {")
    finally:
        log = server.stop()
    assert server.proc.returncode == 0, log
    rest = [line for line in lines if line]
    assert rest[-2:] == [
        'data: {"error": {"message": "the server is shutting down", "type": '
        '"ServiceUnavailableError", "param": null, "code": 503}}',
        "data: [DONE]",
    ]
    assert "stopping the requests still running after 1 s" in log


def _check_waiting_queue_bound(server, client):
    """One sequence at a time, one request may wait: a third gets 503, then all is well."""
    long = dict(model="smol", prompt=PROMPT, max_tokens=300, extra_body={"ignore_eos": True})
    with client.completions.create(stream=True, **long) as running:
        next(iter(running))
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.completions.create, **{**long, "max_tokens": 4})
            wait_until(lambda: server.metrics()["pagedllm:num_requests_waiting"] >= 1,
                       "a waiting request")  # fmt: skip
            with pytest.raises(openai.InternalServerError) as refused:
                client.completions.create(**{**long, "max_tokens": 4})
            assert refused.value.status_code == 503 and "overloaded" in str(refused.value)
            running.close()
            assert waiting.result(timeout=30).choices[0].text
    assert client.completions.create(**{**long, "max_tokens": 4}).choices[0].text


def _check_disconnect_while_queued(server, client):
    """A streaming client queued behind a long request leaves before its first token: its
    request is aborted at once, not when that token would have come."""
    long = dict(model="smol", prompt=PROMPT, max_tokens=300, extra_body={"ignore_eos": True})
    with client.completions.create(stream=True, **long) as running:
        next(iter(running))
        # The server answers a stream's headers with its first token, so a raw socket it is.
        host, port = server.url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": PROMPT, "max_tokens": 4, "stream": True}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer sekrit\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head.encode() + body)
            wait_until(lambda: server.metrics()["pagedllm:num_requests_waiting"] >= 1,
                       "a waiting request")  # fmt: skip
            assert server.metrics()["pagedllm:num_requests_waiting"] == 1
        wait_until(lambda: server.metrics()["pagedllm:num_requests_waiting"] == 0,
                   "no waiting request")  # fmt: skip
        m = server.metrics()
        assert m["pagedllm:num_requests_waiting"] == 0  # aborted while still queued
        assert m["pagedllm:num_requests_running"] == 1  # the long request runs on


def test_a_taken_port_fails_the_second_server(server):
    """uvicorn runs off the main thread (the engine loop has it): a bind failure there must still
    end the process with an error, not a silent exit 0."""
    result = subprocess.run(
        [*PAGEDLLM, "serve", "--port", str(server.port), *FLAGS],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode != 0
    assert "address already in use" in result.stdout + result.stderr
    assert server.proc.poll() is None  # the first one serves on
