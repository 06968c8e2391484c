"""`python -m benchmarks.prefix_hit_ttft MODEL [MODEL ...]`: time to first token of a prompt
computed cold, then sent again (a prefix-cache hit), then extended by a next turn (a hit on the
earlier prompt's blocks), one request at a time, for each model in turn; printed as JSON.

A hybrid model (Mamba-2, Gated DeltaNet layers) can only take a hit where its recurrent state
was checkpointed (core/state_checkpoints.py: at each prompt's last full block), so this shows
what a repeated or extended prompt costs it beside a dense model's. Each figure is the median of
`--repeats` fresh prompts (distinct random token ids, so no run hits another's blocks).

    python -m benchmarks.prefix_hit_ttft /tmp/llama-1b-q4_1.gguf /tmp/gdn-1b-q4_1.gguf
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import numpy as np

from pagedllm.config import EngineArgs
from pagedllm.cpu_info import cpu_name
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from adding the request to its first token (alone in the engine)."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(str(start), {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def measure(model: str, prompt_len: int, turn_len: int, repeats: int) -> dict:
    engine = LLMEngine(EngineArgs(model=model, max_model_len=4096, kv_cache_memory="2GiB"))
    rng = np.random.default_rng(0)
    ttft(engine, rng.integers(100, 20000, 64).tolist())  # warm-up
    cold, again, extended = [], [], []
    for _ in range(repeats):
        prompt = rng.integers(100, 20000, prompt_len).tolist()
        cold.append(ttft(engine, prompt))
        again.append(ttft(engine, prompt))
        extended.append(ttft(engine, prompt + rng.integers(100, 20000, turn_len).tolist()))
    del engine
    gc.collect()
    ms = {k: round(statistics.median(v) * 1000, 1)
          for k, v in (("cold", cold), ("hit", again), ("extended_hit", extended))}  # fmt: skip
    return {"model": model, **ms, "cold_over_hit": round(ms["cold"] / ms["hit"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--turn-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps({"cpu": cpu_name(), "prompt_len": args.prompt_len,
                      "turn_len": args.turn_len}))  # fmt: skip
    for model in args.models:
        print(json.dumps(measure(model, args.prompt_len, args.turn_len, args.repeats)))


if __name__ == "__main__":
    main()
