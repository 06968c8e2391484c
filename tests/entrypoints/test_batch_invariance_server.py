"""Batch invariance through the real HTTP server (docs/determinism.md): the same greedy request,
and the same seeded sampled one, gives the same text and log-probabilities on a busy server as
on an idle one. A tiny random GGUF model in float32, the server on a thread (as test_load.py)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from benchmarks.soak_targets import serve_in_thread
from pagedllm import EngineArgs, kernels
from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from tests.model_loader.tiny_gguf import gpt2_vocab, random_hf_weights, write_tiny_llama

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")
PROMPT = "The same request, whatever else the server is doing: " * 3


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-invariance") / "tiny.gguf"
    write_tiny_llama(path, random_hf_weights(len(gpt2_vocab()[0])))
    args = EngineArgs(model=str(path), dtype="float32", max_model_len=512, block_size=16,
                      kv_cache_memory="64MiB", enable_prefix_caching=True)  # fmt: skip
    aengine = AsyncLLMEngine(LLMEngine(args))
    try:
        with serve_in_thread(aengine, "tiny") as base:
            yield base
    finally:
        aengine.shutdown()


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                              http_client=httpx.AsyncClient(timeout=300))  # fmt: skip


async def _complete(client, prompt: str, **params):
    out = await client.completions.create(model="tiny", prompt=prompt, logprobs=2, **params)
    choice = out.choices[0]
    return choice.text, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0, max_tokens=20),
        dict(temperature=0.8, top_p=0.95, seed=7, max_tokens=20),
    ],  # fmt: skip
    ids=["greedy", "seeded"],
)
def test_same_answer_on_a_busy_server(url, params):
    params = {**params, "extra_body": {"ignore_eos": True}}

    async def main():
        client = _client(url)
        idle = await _complete(client, PROMPT, **params)
        others = [
            _complete(
                client,
                f"Other request {i}: " + "words " * (3 + 11 * i % 40),
                temperature=1.0,
                max_tokens=5 + i % 17,
            )  # fmt: skip
            for i in range(16)
        ]
        # 8 copies of the request, each sent after another request: 24 at once.
        jobs = []
        for i, other in enumerate(others):
            jobs.append(other)
            if i % 2:
                jobs.append(_complete(client, PROMPT, **params))
        results = await asyncio.gather(*jobs)
        return idle, [r for i, r in enumerate(results) if i % 3 == 2]

    idle, busy = asyncio.run(main())
    assert len(idle[0]) > 0 and len(busy) == 8
    assert all(b == idle for b in busy)
