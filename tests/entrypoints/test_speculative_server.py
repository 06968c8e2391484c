"""Speculative decoding through the real HTTP server with the default model, on a request
that copies its prompt (where n-gram drafts are right): the same text as without drafts, greedy
and seeded, streamed with several tokens in a chunk; vLLM's counters on /metrics; a bad
--speculative-config refused at start-up, naming the flag."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import openai
import pytest

from benchmarks.soak_targets import serve_in_thread
from pagedllm import LLM, EngineArgs, SamplingParams, kernels
from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels"),
]
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
PROMPT = f"Code:\n{CODE}\nThe same code again, unchanged:\n"
# deterministic: a verifying step's logits equal one-row decode's bit for bit in bfloat16 too.
ENGINE = dict(max_model_len=1024, kv_cache_memory="256MiB", deterministic=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 5}
PARAMS = [
    dict(temperature=0, max_tokens=32),
    dict(temperature=0.5, top_p=0.95, seed=3, max_tokens=32),  # still copies the code
]


@pytest.fixture(scope="module")
def url():
    aengine = AsyncLLMEngine(LLMEngine(EngineArgs(speculative_config=SPEC, **ENGINE)))
    try:
        with serve_in_thread(aengine, "m") as base:
            yield base
    finally:
        aengine.shutdown()


@pytest.fixture(scope="module")
def expected():
    """The texts without drafts."""
    llm = LLM(**ENGINE)
    outs = llm.generate([PROMPT] * 2, [SamplingParams(**p) for p in PARAMS], use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("i", [0, 1], ids=["greedy", "seeded"])
def test_same_text_streamed_in_fewer_chunks(url, expected, i):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    whole = client.completions.create(model="m", prompt=PROMPT, **PARAMS[i])
    assert whole.choices[0].text == expected[i].text
    chunks = [
        c.choices[0].text
        for c in client.completions.create(model="m", prompt=PROMPT, stream=True, **PARAMS[i])
        if c.choices and c.choices[0].text
    ]
    assert "".join(chunks) == expected[i].text
    assert len(chunks) < len(expected[i].token_ids), "no chunk carried several tokens"


def test_metrics_count_drafts(url, expected):
    text = httpx.get(f"{url}/metrics").text

    def value(name, labels='engine="0",model_name="m"'):
        match = re.search(rf"^pagedllm:{name}_total\{{{labels}\}} (\S+)$", text, re.M)
        assert match, f"{name} is missing from /metrics"
        return float(match.group(1))

    drafts, drafted = value("spec_decode_num_drafts"), value("spec_decode_num_draft_tokens")
    accepted = value("spec_decode_num_accepted_tokens")
    assert 0 < accepted <= drafted and drafts > 0
    labels = 'engine="0",model_name="m",position="0"'
    first = value("spec_decode_num_accepted_tokens_per_pos", labels)
    assert 0 < first <= drafts


def test_bad_speculative_config_is_refused_at_start_up():
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--speculative-config",
         '{"method": "eagle", "num_speculative_tokens": 3}'],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    message = "--speculative-config: method must be one of ngram, suffix, draft_model"
    assert message in proc.stdout + proc.stderr
