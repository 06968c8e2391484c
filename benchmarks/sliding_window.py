"""`python -m benchmarks.sliding_window`: the KV-cache memory that sliding-window layers give back.

One request per prompt length (random token ids, greedy, `--output-len` tokens) runs twice on one
engine (default model: Gemma 3 270M, 15 sliding layers with a 512-token window and 3 global
ones): once as pagedllm runs it, the sliding groups releasing the blocks that leave the window,
and once with a block manager whose groups all keep every block (the attention is the same: it
only reads the window either way). The KV memory is measured, not computed: pool blocks in use,
read after every step, times the bytes of a block, at the peak of the run and at its last decode
step. Prompts are prefilled in chunks of `--max-num-batched-tokens` (default here: 512), as a
server does with long prompts; a chunk's blocks are all live in its step, so the sliding groups'
peak is about window + chunk tokens. The two runs must give the same tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common
from pagedllm.bench.utils import cpu_counters, others_cpu_share, write_json
from pagedllm.config import EngineArgs
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.sampling_params import SamplingParams

DEFAULT_MODEL = "gemma3-270m"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument("--prompt-lens", type=common.int_list, default=[512, 2048, 8192],
                       help="prompt lengths, comma-separated (default: 512,2048,8192)")  # fmt: skip
    group.add_argument("--output-len", type=int, default=16, help="tokens generated per request")
    group.add_argument("--output-json", type=Path, default=None, help="write the results here")


def _run(engine, prompt: list[int], output_len: int) -> dict[str, Any]:
    """One request alone: the peak blocks in use after any step, those at its last decode step
    (before it finishes and frees them), and the tokens."""
    kv = engine.scheduler.kv_cache_manager
    params = SamplingParams(temperature=0, max_tokens=output_len, min_tokens=output_len)
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    peak = last = 0
    tokens, start = None, time.perf_counter()
    while engine.has_unfinished_requests():
        used = kv.num_blocks - kv.num_free_blocks
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        if engine.has_unfinished_requests():
            last = used = kv.num_blocks - kv.num_free_blocks
        peak = max(peak, used)
    seconds = time.perf_counter() - start
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
    return {"peak_blocks": peak, "last_blocks": last, "tokens": tokens, "seconds": seconds}


def _with_windows(engine, sliding_windows):
    """A fresh engine on an idle engine's executor (model and pool) whose block manager releases
    blocks by `sliding_windows` (one per KV cache group; None keeps them)."""
    from pagedllm.engine.llm_engine import LLMEngine

    def manager(config, num_blocks: int, num_cpu_blocks: int, windows):
        cache = config.cache
        return KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                              num_cpu_blocks, sliding_windows)  # fmt: skip

    return LLMEngine(engine.args, executor=engine.executor, kv_cache_manager=manager)


def run(engine_args: EngineArgs, prompt_lens: list[int], output_len: int) -> dict[str, Any]:
    from pagedllm.engine.llm_engine import LLMEngine

    engine_args.model = engine_args.model or DEFAULT_MODEL
    engine_args.max_model_len = engine_args.max_model_len or max(prompt_lens) + output_len
    engine_args.enable_prefix_caching = False  # each run computes its prompt
    engine_args.max_num_batched_tokens = engine_args.max_num_batched_tokens or 512
    if engine_args.kv_cache_memory is None:
        engine_args.kv_cache_memory = "1GiB"
    engine = LLMEngine(engine_args)
    spec = engine.kv_cache_spec
    windows = spec.sliding_windows
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    cpu_before = cpu_counters()
    rows = []
    for n in prompt_lens:
        prompt = rng.integers(10, vocab, n).tolist()
        released = _run(_with_windows(engine, windows), prompt, output_len)
        kept = _run(_with_windows(engine, [None] * len(windows)), prompt, output_len)
        rows.append({
            "prompt_len": n,
            "tokens": n + output_len,
            "peak_blocks_released": released["peak_blocks"],
            "peak_blocks_kept": kept["peak_blocks"],
            "last_blocks_released": released["last_blocks"],
            "last_blocks_kept": kept["last_blocks"],
            "seconds_released": released["seconds"],
            "seconds_kept": kept["seconds"],
            "same_tokens": released["tokens"] == kept["tokens"],
        })  # fmt: skip
    return {
        "model": engine.model_name,
        "kv_cache_groups": spec.describe(),
        "block_size": spec.block_size,
        "bytes_per_block": spec.bytes_per_block,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "output_len": output_len,
        "chunk": engine.max_num_batched_tokens,
        "rows": rows,
        "others_cpu_share": others_cpu_share(cpu_before, cpu_counters()),
    }


def format_table(result: dict[str, Any]) -> str:
    mib = result["bytes_per_block"] / 2**20
    lines = [
        f"{result['model']}: {result['kv_cache_groups']}; blocks of {result['block_size']} "
        f"tokens, {result['bytes_per_block'] / 2**10:.0f} KiB each ({result['dtype']}); "
        f"one request at a time, prefill chunks of {result['chunk']}, {result['output_len']} "
        "output tokens",
        "KV MiB in use: released = sliding blocks released (pagedllm), kept = every block kept",
        f"{'tokens':>7}  {'peak released':>13}  {'peak kept':>9}  {'saved':>5}  "
        f"{'decode released':>15}  {'decode kept':>11}  {'saved':>5}  {'s rel/kept':>10}  same",
    ]
    for r in result["rows"]:
        peak_saved = 1 - r["peak_blocks_released"] / r["peak_blocks_kept"]
        last_saved = 1 - r["last_blocks_released"] / r["last_blocks_kept"]
        lines.append(
            f"{r['tokens']:>7}  {r['peak_blocks_released'] * mib:>13.1f}  "
            f"{r['peak_blocks_kept'] * mib:>9.1f}  {peak_saved:>5.0%}  "
            f"{r['last_blocks_released'] * mib:>15.1f}  {r['last_blocks_kept'] * mib:>11.1f}  "
            f"{last_saved:>5.0%}  {r['seconds_released']:>4.1f}/{r['seconds_kept']:<5.1f}  "
            f"{'yes' if r['same_tokens'] else 'NO'}"
        )
    others = result["others_cpu_share"]
    lines.append(f"other processes used up to {others:.1%} of the CPU")
    return "\n".join(lines)


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    result = run(engine_args, ns.prompt_lens, ns.output_len)
    print(format_table(result))
    if ns.output_json:
        write_json(ns.output_json, result)
    return 0 if all(r["same_tokens"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
