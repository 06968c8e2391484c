"""Failed and rejected requests on /metrics (`pagedllm:request_errors_total`, by reason), over
real HTTP on loopback with a tiny random Llama: each kind of refusal or failure is provoked once
and counted once under its reason, and nothing else is counted."""

from __future__ import annotations

import uuid

import httpx
import pytest

from benchmarks.soak_targets import serve_in_thread
from pagedllm.config import EngineArgs
from pagedllm.engine import output_processor
from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.server_config import ServerLimits
from tests.conftest import save_tiny_llama
from tests.waiting import wait_until

POISON = [7, 7, 7, 7, 7]  # the prompt whose detokenizer fails after 3 tokens
BODY_LIMIT = 4 << 10


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-49k-error-metrics")
    save_tiny_llama(path, vocab_size=49152, max_position_embeddings=512)
    args = EngineArgs(model=str(path), tokenizer="SmolLM2-135M-Instruct", dtype="float32",
                      max_model_len=256, kv_cache_memory="16MiB")  # fmt: skip
    engine = AsyncLLMEngine(LLMEngine(args))
    yield engine
    engine.shutdown()


def _errors(url: str, headers: dict | None = None) -> dict[str, float]:
    counts = {}
    for line in httpx.get(f"{url}/metrics", headers=headers).text.splitlines():
        if line.startswith("pagedllm:request_errors_total{"):
            labels, value = line.rsplit(" ", 1)
            reason = labels.split('reason="', 1)[1].split('"', 1)[0]
            counts[reason] = float(value)
    return counts


def _grew(before: dict, after: dict) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


class LateFault(IncrementalDetokenizer):
    def __init__(self, tokenizer, prompt_token_ids, params):
        super().__init__(tokenizer, prompt_token_ids, params)
        self.poisoned = list(prompt_token_ids) == POISON

    def update(self, new_token_ids, stop_terminated=False):
        if self.poisoned and self.num_tokens >= 3:
            raise ValueError("injected late fault")
        return super().update(new_token_ids, stop_terminated)


def test_rejections_and_failures_counted_by_reason(engine, monkeypatch):
    monkeypatch.setattr(output_processor, "IncrementalDetokenizer", LateFault)
    limits = ServerLimits(max_request_body_bytes=BODY_LIMIT)
    with serve_in_thread(engine, "m", limits=limits) as url, httpx.Client(timeout=60) as http:
        before = _errors(url)
        completions = f"{url}/v1/completions"
        assert http.post(completions, json={"prompt": [5], "max_tokens": -1}).status_code == 400
        assert http.post(completions, content=b"{", headers={"content-type": "application/json"}
                         ).status_code == 400  # fmt: skip
        assert http.post(completions, json={"prompt": [5], "model": "x"}).status_code == 404
        assert http.get(f"{url}/v1/nothing-here").status_code == 404
        assert http.post(completions, json={"prompt": "a" * BODY_LIMIT}).status_code == 413
        body = {"prompt": POISON, "max_tokens": 20, "ignore_eos": True, "stream": True}
        with http.stream("POST", completions, json=body) as response:
            assert "injected late fault" in response.read().decode()  # in-band, after a 200
        body = {"prompt": [5, 6], "max_tokens": 200, "ignore_eos": True, "stream": True}
        with http.stream("POST", completions, json=body) as response:
            next(response.iter_lines())  # the first event, then the client leaves
        ok = http.post(completions, json={"prompt": [5, 6], "max_tokens": 2})
        assert ok.status_code == 200  # not counted
        expected = {"bad_request": 2, "not_found": 2, "too_large": 1, "stream_error": 1,
                    "client_disconnected": 1}  # fmt: skip
        # The mid-stream disconnect is noticed a moment later.
        wait_until(lambda: _grew(before, _errors(url)) == expected,
                   lambda: _grew(before, _errors(url)))  # fmt: skip


def test_unauthorized_and_overloaded(engine):
    key = "sk-" + uuid.uuid4().hex
    auth = {"Authorization": f"Bearer {key}"}
    with serve_in_thread(engine, "m", api_key=key, max_waiting_requests=0) as url:
        before = _errors(url, auth)
        body = {"prompt": [5, 6], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
        full = httpx.post(f"{url}/v1/completions", json=body, headers=auth)
        assert full.status_code == 503 and "overloaded" in full.json()["error"]["message"]
        assert _grew(before, _errors(url, auth)) == {"unauthorized": 1, "overloaded": 1}
