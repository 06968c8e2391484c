"""The per-commit figures of docs/performance.md: decode with 64 running requests (128-token
prompts, 20 steps), one 512-token prefill (median of 3), one stream (20 steps), printed as JSON.

Only LLMEngine's public API, so it runs against any commit's checkout:

    git worktree add --detach /tmp/at-X X
    PYTHONPATH=/tmp/at-X/src python benchmarks/engine_step_speed.py [dtype=bfloat16 ...]

Extra `name=value` arguments are EngineArgs fields.
"""

import json
import statistics
import sys
import time

import numpy as np

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams

overrides = {k: int(v) if v.isdigit() else v for k, v in (a.split("=", 1) for a in sys.argv[1:])}
engine = LLMEngine(EngineArgs(**{"max_model_len": 2048, "kv_cache_memory": "1GiB", **overrides}))
rng = np.random.default_rng(0)


def prompt(n: int) -> dict:
    return {"prompt_token_ids": rng.integers(100, 20000, n).tolist()}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def drain() -> None:
    while engine.has_unfinished_requests():
        engine.step()


def decode_ms(n: int, steps: int = 20) -> float:
    ids = [f"d{n}-{i}" for i in range(n)]
    for rid in ids:
        engine.add_request(rid, prompt(128), greedy(steps + 40))
    started = set()  # requests past their prefill (they have a token)
    while len(started) < n:
        started |= {o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids}
    engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    ms = (time.perf_counter() - t) / steps * 1000
    engine.abort_request(ids)
    drain()
    return ms


engine.add_request("warm-up", prompt(32), greedy(4))
drain()
prefill = []
for i in range(3):
    engine.add_request(f"p{i}", prompt(512), greedy(1))
    t = time.perf_counter()
    drain()
    prefill.append(time.perf_counter() - t)
print(json.dumps({
    "dtype": str(engine.dtype),
    "attention_backend": getattr(engine, "attention_backend", engine.args.attention_backend),
    "prefill_512_tok_s": 512 / statistics.median(prefill),
    "decode64_ms": decode_ms(64),
    "decode1_ms": decode_ms(1),
}))  # fmt: skip
