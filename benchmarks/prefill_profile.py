"""`python -m benchmarks.prefill_profile MODEL`: one prompt's prefill through LLMEngine, step by
step (a hybrid model's prompt stops at its prefix-caching checkpoint: one more step), then the
same under cProfile, the functions that took the most time printed. The engine is warmed up
first with a prompt of the same length (other random tokens).

    python -m benchmarks.prefill_profile /tmp/gdn-1b-q4_1.gguf --prompt-len 512
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

from pagedllm.config import EngineArgs
from pagedllm.cpu_info import cpu_name
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams


def prefill(engine: LLMEngine, prompt: list[int]) -> list[float]:
    """Each step's milliseconds until the prompt's first token."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.add_request(str(time.perf_counter()), {"prompt_token_ids": prompt}, params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(round((time.perf_counter() - start) * 1000, 1))
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    engine = LLMEngine(EngineArgs(model=args.model, max_model_len=4096, kv_cache_memory="2GiB"))
    rng = np.random.default_rng(0)

    def prompt() -> list[int]:
        return rng.integers(100, 20000, args.prompt_len).tolist()

    prefill(engine, prompt())  # warm-up
    steps = prefill(engine, prompt())
    print(f"{cpu_name()}: steps of one {args.prompt_len}-token prefill (ms): {steps}")
    profiler = cProfile.Profile()
    profiler.enable()
    prefill(engine, prompt())
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
