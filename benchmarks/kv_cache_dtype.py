"""`python -m benchmarks.kv_cache_dtype`: what --kv-cache-dtype costs and buys: memory,
accuracy, and decode speed at long context.

One engine per KV cache dtype, built and freed in turn, the engine flags otherwise the same
(the weights too: only the cache differs). For each: bytes per token of KV cache and the
blocks the same --kv-cache-memory holds; accuracy against the `auto` cache (the model's dtype)
on a fixed prompt set, teacher-forced as `benchmarks.quantization` does it (the auto cache's
greedy continuations scored by every cache in one prefill: the mean and max |delta logprob| of
those tokens, and the share of positions whose most likely token is still the auto cache's);
and decode tokens/s of `--batch-size` requests of `--context-len` random tokens, after their
prefill, where attention reads the most K/V.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.quantization import (
    _greedy,
    _run_all,
    accuracy,
    continuation_logprobs,
    prompt_token_ids,
)
from pagedllm.bench.utils import cpu_counters, others_cpu_share, table_lines
from pagedllm.config import KV_CACHE_DTYPES, EngineArgs

DEFAULT = "auto,bfloat16,int8,fp8,fp8_e5m2"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument("--kv-cache-dtypes", default=DEFAULT.split(","),
                       type=common.choice_list(KV_CACHE_DTYPES, "KV cache dtypes"),
                       help=f"comma-separated (default: {DEFAULT}; auto first)")  # fmt: skip
    group.add_argument("--num-prompts", type=int, default=16, help="prompts scored (default: 16)")
    group.add_argument("--output-len", type=int, default=64,
                       help="tokens scored per prompt, decoded per long request")  # fmt: skip
    group.add_argument("--context-len", type=int, default=4096,
                       help="prompt tokens of each long request (default: 4096)")  # fmt: skip
    group.add_argument("--batch-size", type=int, default=4,
                       help="long requests decoding together (default: 4)")  # fmt: skip
    group.add_argument("--output-json", default=None, help="write every figure to this JSON file")


def long_context_decode(engine, ns) -> dict[str, Any]:
    """Decode tokens/s of batch_size requests of context_len random tokens, prefill not timed."""
    import torch

    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    first_tokens = engine.get_stats()["num_first_tokens_total"] + ns.batch_size
    for i in range(ns.batch_size):
        prompt = torch.randint(0, vocab, (ns.context_len,), generator=g).tolist()
        engine.add_request(f"long-{i}", {"prompt_token_ids": prompt}, _greedy(ns.output_len))
    # Step until every request has its first token (the prefills), then time the decodes.
    while engine.get_stats()["num_first_tokens_total"] < first_tokens:
        engine.step()
    cpu_before, tokens = cpu_counters(), 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(1 for _ in engine.step())
    elapsed = time.perf_counter() - start
    return {
        "long_decode_tokens": tokens,
        "long_decode_tokens_per_s": tokens / elapsed if elapsed > 0 else None,
        "long_others_cpu_share": others_cpu_share(cpu_before, cpu_counters()),
    }


def run_one(engine_args: EngineArgs, kv_dtype: str, reference, ns) -> tuple[dict, dict]:
    from pagedllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(dataclasses.replace(engine_args, kv_cache_dtype=kv_dtype))
    spec = engine.kv_cache_spec
    figures: dict[str, Any] = {
        "cache_dtype": engine.config.cache.cache_dtype,
        "bytes_per_token": spec.bytes_per_block // spec.block_size,
        "num_blocks": engine.num_blocks,
    }
    prompts = reference["prompts"] if reference else prompt_token_ids(engine, ns.num_prompts)
    if reference is None:
        outs = _run_all(engine, prompts, _greedy(ns.output_len))
        continuations = [list(o.outputs[0].token_ids) for o in outs]
        logprobs, ranks = continuation_logprobs(engine, prompts, continuations)
        reference = {"prompts": prompts, "continuations": continuations, "logprobs": logprobs}
    else:
        logprobs, ranks = continuation_logprobs(engine, prompts, reference["continuations"])
    figures.update(accuracy(reference["logprobs"], logprobs, ranks))
    figures.update(long_context_decode(engine, ns))
    del engine
    gc.collect()
    return figures, reference


def format_table(results: dict[str, dict[str, Any]], ns) -> str:
    ref = results["auto"]
    rows = [("--kv-cache-dtype", "stores", "bytes/token", "blocks", "mean |dlogp|",
             "max |dlogp|", "greedy agree", f"decode tok/s ({ns.batch_size} x {ns.context_len})",
             "vs auto")]  # fmt: skip
    for name, r in results.items():
        speed, base = r["long_decode_tokens_per_s"], ref["long_decode_tokens_per_s"]
        rows.append((
            name, r["cache_dtype"], f"{r['bytes_per_token']:,}", f"{r['num_blocks']:,}",
            f"{r['mean_abs_logprob_diff']:.4f}", f"{r['max_abs_logprob_diff']:.4f}",
            f"{r['greedy_agreement']:.1%}", f"{speed:.1f}", f"{speed / base:.2f}x",
        ))  # fmt: skip
    return "\n".join(table_lines(rows))


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    import torch

    for flag in ("num_prompts", "output_len", "context_len", "batch_size"):
        if getattr(ns, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    if engine_args.max_model_len is None:
        engine_args = dataclasses.replace(engine_args, max_model_len=ns.context_len + ns.output_len)
    names = ["auto", *(d for d in ns.kv_cache_dtypes if d != "auto")]
    results, reference = {}, None
    for name in names:
        results[name], reference = run_one(engine_args, name, reference, ns)
        r = results[name]
        busy = r["long_others_cpu_share"] or 0
        print(f"[{name}] {r['cache_dtype']}: {r['bytes_per_token']:,} B/token, "
              f"{r['long_decode_tokens_per_s']:.1f} tok/s at {ns.context_len} tokens; other "
              f"processes used {busy:.1%} of the CPU")  # fmt: skip
    print(f"\n{ns.num_prompts} prompts x {ns.output_len} tokens scored against the auto cache's "
          f"greedy continuation; torch threads: {torch.get_num_threads()}")  # fmt: skip
    print(format_table(results, ns))
    if ns.output_json:
        out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": " ".join(sys.argv),
               "engine_args": dataclasses.asdict(engine_args), "results": results}  # fmt: skip
        Path(ns.output_json).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
