"""The server's pieces without a model: request mapping, logprob formats, merged streams, the
app's error shapes and API key on a stub engine, and the `serve` flags."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from pagedllm.bench.serve import RequestResult, format_summary, summarize
from pagedllm.entrypoints.cli import build_parser, engine_args_from
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.metrics import stats_line
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.server_config import (
    ServerConfig,
    ServerLimits,
    _chat_template_arg,
    server_config_from,
)
from pagedllm.entrypoints.openai.serving_chat import chat_logprobs
from pagedllm.entrypoints.openai.serving_completion import completion_logprobs
from pagedllm.entrypoints.openai.streaming import merge
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def test_requests_map_to_sampling_params():
    body = CompletionRequest(
        prompt="x", max_tokens=7, temperature=0.5, top_k=3, min_p=0.1, repetition_penalty=1.2,
        min_tokens=2, ignore_eos=True, stop_token_ids=[5], stop="\n", seed=4,
        logit_bias={"3": -1}, skip_special_tokens=False, include_stop_str_in_output=True,
    )  # fmt: skip
    params = body.sampling_params(body.max_tokens, 2)
    assert (params.max_tokens, params.temperature, params.top_k, params.min_p) == (7, 0.5, 3, 0.1)
    assert params.stop == ["\n"] and params.stop_token_ids == [5] and params.logit_bias == {3: -1}
    assert params.ignore_eos and params.include_stop_str_in_output and params.logprobs == 2
    assert CompletionRequest(prompt="x").sampling_params(16, None).temperature == 1.0
    beam = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], use_beam_search=True, n=2, length_penalty=0.5
    ).sampling_params(None, None)
    assert beam.use_beam_search and beam.temperature == 0 and beam.max_tokens is None


def test_completion_and_chat_logprob_formats():
    entries = [
        {7: Logprob(-0.1, 1, "He"), 8: Logprob(-2.5, 2, "A"), 9: Logprob(-3.0, 3, "B")},
        {4: Logprob(-4.0, 5, "llo"), 1: Logprob(-0.2, 1, "y"), 2: Logprob(float("-inf"), 2, "!")},
    ]
    out = completion_logprobs([7, 4], entries, num_top=2, offset=3)
    assert out.tokens == ["He", "llo"] and out.token_logprobs == [-0.1, -4.0]
    assert out.text_offset == [3, 5]
    assert out.top_logprobs == [{"He": -0.1, "A": -2.5}, {"y": -0.2, "!": -9999.0, "llo": -4.0}]
    chat = chat_logprobs([7, 4], entries, num_top=1).content
    assert [(c.token, c.logprob, c.bytes) for c in chat] == [
        ("He", -0.1, list(b"He")),
        ("llo", -4.0, list(b"llo")),
    ]
    assert [[t.token for t in c.top_logprobs] for c in chat] == [["He"], ["y"]]


def test_merge_interleaves_and_closing_closes_every_generator():
    closed = []

    async def gen(name, n, delay):
        try:
            for i in range(n):
                await asyncio.sleep(delay)
                yield f"{name}{i}"
        finally:
            closed.append(name)

    async def main():
        items = [item async for item in merge([gen("a", 2, 0.001), gen("b", 3, 0.0015)])]
        stream = merge([gen("c", 100, 0.001), gen("d", 100, 0.001)])
        first = await anext(stream)
        await stream.aclose()
        return items, first

    items, first = asyncio.run(main())
    assert sorted(items) == [(0, "a0"), (0, "a1"), (1, "b0"), (1, "b1"), (1, "b2")]
    assert first[1] in ("c0", "d0") and sorted(closed) == ["a", "b", "c", "d"]


def _stub_engine(alive=True):
    engine = SimpleNamespace(
        tokenizer=None,
        max_model_len=64,
        model_name="stub",
        args=SimpleNamespace(model=None),
        model_config=SimpleNamespace(vocab_size=10),
        config=SimpleNamespace(lora=None, model=SimpleNamespace(runner="generate")),
        lora_stats=lambda: None,
        get_stats=lambda: {
            "num_running": 2,
            "num_waiting": 1,
            "num_swapped": 0,
            "kv_cache_usage": 0.25,
            "num_preemptions_total": 0,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
        },  # fmt: skip
    )
    engine.engine_stats = lambda: {"0": engine.get_stats()}

    def check_health():
        if not alive:
            from pagedllm.engine.async_llm_engine import EngineDeadError

            raise EngineDeadError("the engine loop has stopped")

    return SimpleNamespace(
        engine=engine, is_running=alive, is_restarting=False, check_health=check_health
    )


def _error(response, status, fragment):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and fragment in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_app_errors_metrics_and_api_key(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    client = TestClient(build_app(_stub_engine(), ServerConfig("stub")))
    _error(client.post("/v1/completions", json={"prompt": "x", "model": "m"}), 404, "`m`")
    _error(client.post("/v1/completions", json={"prompt": "x", "n": []}), 400, "n:")
    json_header = {"content-type": "application/json"}
    _error(client.post("/v1/completions", content=b"{", headers=json_header), 400, "not valid JSON")
    _error(client.post("/v1/completions", json={"prompt": "text"}), 400, "no tokenizer")
    _error(client.post("/v1/completions", json={"prompt": "x", "top_p": 5}), 400, "top_p")
    _error(client.post("/v1/completions", json={"prompt": [11]}), 400, "out of range")
    _error(client.post("/v1/completions", json={"prompt": [1] * 60, "max_tokens": 5}), 400,
           "you requested 65 tokens (60 in the input, 5 in the completion)")  # fmt: skip
    _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user"}]}), 400,
           "no chat template")  # fmt: skip
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 64
    metrics = client.get("/metrics").text
    assert 'pagedllm:num_requests_running{engine="0",model_name="stub"} 2.0' in metrics
    assert 'pagedllm:kv_cache_usage_perc{engine="0",model_name="stub"} 0.25' in metrics

    # Readiness: /health's answer, and 503 once the server drains
    assert client.get("/ready").status_code == 200
    client.app.state.draining = True
    _error(client.get("/ready"), 503, "shutting down")
    assert client.get("/health").status_code == 200  # alive while it drains

    dead = TestClient(build_app(_stub_engine(alive=False), ServerConfig("stub")))
    assert dead.get("/health").status_code == 503 and dead.get("/ready").status_code == 503
    _error(dead.post("/v1/completions", json={"prompt": [1]}), 503, "stopped")

    monkeypatch.setenv("PAGEDLLM_API_KEY", "k")
    keyed = TestClient(build_app(_stub_engine(), ServerConfig("stub")))
    _error(keyed.get("/v1/models"), 401, "API key")
    _error(keyed.get("/v1/models", headers={"Authorization": "Bearer x"}), 401, "API key")
    assert keyed.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert keyed.get("/health").status_code == 200 and keyed.get("/ready").status_code == 200


def test_serve_flags(tmp_path):
    ns = build_parser().parse_args(
        ["serve", "my-model", "--port", "9001", "--api-key", "k", "--block-size", "8",
         "--served-model-name", "m", "--chat-template", "{{ x }}"]
    )  # fmt: skip
    assert (ns.model_tag, ns.port, ns.host, ns.api_key, ns.served_model_name) == (
        "my-model", 9001, "127.0.0.1", "k", "m"
    )  # fmt: skip
    assert engine_args_from(ns).block_size == 8
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert _chat_template_arg(str(path)) == "{{ messages }}"
    assert _chat_template_arg("{{ inline }}") == "{{ inline }}"
    assert _chat_template_arg(None) is None


def test_serve_flags_make_one_server_config():
    parser = build_parser()
    config = server_config_from(parser.parse_args(["serve"]))
    assert config == ServerConfig(
        log_stats_interval=10.0, max_waiting_requests=1024, limits=ServerLimits()
    )  # the library's defaults but for the stats lines and the queue bound
    ns = parser.parse_args(
        ["serve", "--model", "m.gguf", "--host", "0.0.0.0", "--port", "9001", "--api-key", "k",
         "--chat-template", "{{ x }}", "--disable-log-stats", "--max-num-queued-reqs", "0",
         "--graceful-shutdown-timeout", "1", "--max-request-body-bytes", "0", "--max-n", "2",
         "--disable-metrics-auth", "--enable-log-requests", "--enable-auto-tool-choice",
         "--tool-call-parser", "json", "--no-dashboard"]
    )  # fmt: skip
    assert server_config_from(ns) == ServerConfig(
        served_model_name="m.gguf", host="0.0.0.0", port=9001, api_key="k",
        metrics_need_api_key=False, chat_template="{{ x }}", log_stats_interval=None,
        max_waiting_requests=None, graceful_shutdown_timeout=1.0,
        limits=ServerLimits(max_request_body_bytes=None, max_n=2), log_requests=True,
        enable_auto_tool_choice=True, tool_call_parser="json", enable_dashboard=False,
    )  # fmt: skip
    assert ServerConfig().named("x").served_model_name == "x"
    assert ServerConfig("m").named("x").served_model_name == "m"
    with pytest.raises(SystemExit, match="needs --tool-call-parser"):
        server_config_from(parser.parse_args(["serve", "--enable-auto-tool-choice"]))


def _fake_generate(texts):
    """A stub engine's generate: one token per text piece, finished with "length"."""

    async def generate(request, params, request_id, delta=False, cache_salt=None, **engine_args):
        assert request.request_id == request_id and request.params is params  # made whole
        ids = request.prompt_token_ids
        if any(t == 0 for t in ids):
            raise ValueError("token 0 is not allowed here")
        metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5,
                                 first_token_time=2.0, finished_time=3.0)  # fmt: skip
        for step in range(1, len(texts) + 1):
            done = step == len(texts)
            outputs = [
                CompletionOutput(
                    index=i,
                    text=texts[step - 1] if delta else "".join(texts[:step]),
                    token_ids=[step] if delta else list(range(1, step + 1)),
                    cumulative_logprob=None,
                    logprobs=None,
                    finish_reason="length" if done else None,
                )
                for i in range(params.n)
            ]
            yield RequestOutput(request_id, None, ids, outputs, done, metrics)
            await asyncio.sleep(0)

    return generate


def test_app_completions_streamed_and_not_and_request_metrics_on_a_stub_engine():
    stub = _stub_engine()
    stub.generate = _fake_generate(["Hel", "lo", "!"])
    client = TestClient(build_app(stub, ServerConfig("stub")))
    out = client.post("/v1/completions", json={"prompt": [[1, 2], [3]], "n": 2}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert {c["text"] for c in out["choices"]} == {"Hello!"}
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}

    body = {"prompt": [1, 2], "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "Hello!"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    # Bad input the engine refuses on the first item: a 400 before the stream starts.
    _error(client.post("/v1/completions", json={"prompt": [0], "stream": True}), 400, "token 0")
    _error(client.post("/v1/completions", json={"prompt": [0]}), 400, "token 0")

    metrics = client.get("/metrics").text
    assert 'pagedllm:e2e_request_latency_seconds_count{model_name="stub"} 3.0' in metrics
    assert 'pagedllm:time_to_first_token_seconds_sum{model_name="stub"} 3.0' in metrics
    assert 'pagedllm:generation_tokens_total{model_name="stub"} 15.0' in metrics
    assert 'pagedllm:prompt_tokens_total{model_name="stub"} 5.0' in metrics
    assert 'request_success_total{finished_reason="length",model_name="stub"} 3.0' in metrics


def test_stats_line():
    previous = {"num_prompt_tokens_total": 100, "num_generation_tokens_total": 50}
    stats = {
        "num_prompt_tokens_total": 300, "num_generation_tokens_total": 90, "num_running": 3,
        "num_waiting": 1, "num_swapped": 0, "kv_cache_usage": 0.125,
        "prefix_cache_queries": 8, "prefix_cache_hits": 2,
    }  # fmt: skip
    assert stats_line(previous, stats, 2.0) == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 tokens/s, "
        "Running: 3 reqs, Waiting: 1 reqs, Swapped: 0 reqs, KV cache usage: 12.5%, "
        "Prefix cache hit rate: 25.0%"
    )


def test_waiting_queue_bound_refuses_with_503():
    stub = _stub_engine()  # one request waiting
    stub.generate = _fake_generate(["a"])
    client = TestClient(build_app(stub, ServerConfig("stub", max_waiting_requests=2)))
    assert client.post("/v1/completions", json={"prompt": [1]}).status_code == 200
    _error(client.post("/v1/completions", json={"prompt": [[1], [2]]}), 503, "overloaded")
    full = TestClient(build_app(stub, ServerConfig("stub", max_waiting_requests=1)))
    response = full.post("/v1/completions", json={"prompt": [1]})
    _error(response, 503, "1 requests are waiting (at most 1")
    assert response.headers["retry-after"] == "1"


def test_bench_serve_summary():
    results = [
        RequestResult(prompt_len=10, output_len=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
        RequestResult(prompt_len=20, output_len=3, ttft=0.3, latency=0.7, itl=[0.2, 0.2]),
        RequestResult(prompt_len=7, error="HTTP 400"),
    ]
    s = summarize(results, duration=2.0)
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (
        2, 1, 30, 8
    )  # fmt: skip
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 4.0
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_e2el_ms"] == pytest.approx(600)
    assert s["mean_tpot_ms"] == pytest.approx(150)  # (0.4 / 4 + 0.4 / 2) / 2
    assert s["mean_itl_ms"] == pytest.approx(800 / 6) and s["errors"] == ["HTTP 400"]
    assert "Mean TPOT (ms):" in format_summary(s)
