"""`pagedllm bench latency`: the end-to-end latency of one batch, as vLLM's `bench latency`.

One batch of `--batch-size` requests, each `--input-len` random prompt tokens (the model's
ordinary vocabulary, seeded) generating exactly `--output-len` tokens (greedy, ignore_eos), is
queued at once and stepped to its end: that is one iteration. `--num-iters-warmup` untimed
iterations, then `--num-iters` timed ones; reported: the mean and the 10th to 99th percentiles
of the batch's latency. The prefix cache is emptied before each iteration, so every one
prefills its prompts in full (they are the same prompts each time).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from pagedllm.bench.utils import cpu_counters, greedy_params, others_cpu_share, write_json
from pagedllm.bench.workload import normal_token_ids
from pagedllm.config import EngineArgs

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument("--input-len", type=int, default=32,
                       help="prompt tokens per request (default: 32)")  # fmt: skip
    group.add_argument("--output-len", type=int, default=128,
                       help="tokens each request generates (default: 128)")  # fmt: skip
    group.add_argument("--batch-size", type=int, default=8,
                       help="requests in the batch (default: 8)")  # fmt: skip
    group.add_argument("--num-iters-warmup", type=int, default=10,
                       help="untimed iterations first (default: 10)")  # fmt: skip
    group.add_argument("--num-iters", type=int, default=30,
                       help="timed iterations (default: 30)")  # fmt: skip
    group.add_argument("--output-json", type=str, default=None,
                       help="write the latencies to this JSON file")  # fmt: skip


def _check_args(ns: argparse.Namespace) -> None:
    for flag in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(ns, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}")
    if ns.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {ns.num_iters_warmup}")


def make_prompts(engine, batch_size: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """`batch_size` prompts of `input_len` ids drawn from the model's ordinary vocabulary."""
    tokenizer = engine.tokenizer
    special = (getattr(tokenizer, "all_special_ids", ()) or ()) if tokenizer is not None else ()
    vocab = normal_token_ids(engine.model_config.vocab_size, special)
    rng = np.random.default_rng(seed)
    return [vocab[rng.integers(0, vocab.size, size=input_len)].tolist() for _ in range(batch_size)]


def run_batch(engine, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """(seconds from queueing the batch to its last output, tokens generated)."""
    engine.reset_prefix_cache()
    params = greedy_params(output_len)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"latency-{i}", prompt, params)
    generated = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                generated += len(output.outputs[0].token_ids)
    return time.perf_counter() - start, generated


def summarize(latencies: list[float]) -> dict[str, Any]:
    values = np.asarray(latencies)
    return {
        "avg_latency": float(values.mean()),
        "latencies": [float(x) for x in latencies],
        "percentiles": {str(p): float(np.percentile(values, p)) for p in PERCENTILES},
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [f"Avg latency: {s['avg_latency']:.4f} seconds"]
    lines += [f"{p}% percentile latency: {v:.4f} seconds" for p, v in s["percentiles"].items()]
    return "\n".join(lines)


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    _check_args(ns)
    import dataclasses

    import torch

    from pagedllm.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(engine_args)
    load_s = time.perf_counter() - t0
    if ns.input_len + ns.output_len > engine.max_model_len:
        raise ValueError(
            f"--input-len + --output-len = {ns.input_len + ns.output_len} tokens, more than "
            f"max_model_len {engine.max_model_len}"
        )
    prompts = make_prompts(engine, ns.batch_size, ns.input_len)
    print(
        f"pagedllm: {engine.model_name} loaded in {load_s:.1f} s; a batch of {ns.batch_size} "
        f"requests, {ns.input_len} prompt tokens and {ns.output_len} output tokens each; "
        f"torch threads: {torch.get_num_threads()}"
    )
    print(f"warm-up: {ns.num_iters_warmup} untimed iteration(s)")
    for _ in range(ns.num_iters_warmup):
        run_batch(engine, prompts, ns.output_len)
    latencies = []
    cpu_before = cpu_counters()
    for _ in range(ns.num_iters):
        seconds, generated = run_batch(engine, prompts, ns.output_len)
        if generated != ns.batch_size * ns.output_len:
            print(f"warning: the batch generated {generated} tokens, expected "
                  f"{ns.batch_size * ns.output_len}", file=sys.stderr)  # fmt: skip
        latencies.append(seconds)
    others = others_cpu_share(cpu_before, cpu_counters())
    summary = summarize(latencies)
    print(format_summary(summary))
    if others is not None:
        note = " (busy machine: these figures are skewed)" if others > 0.1 else ""
        print(f"other processes used {others:.1%} of the machine's CPU meanwhile{note}")
    if ns.output_json:
        write_json(ns.output_json, {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": " ".join(sys.argv),
            "model": engine.model_name,
            "torch_num_threads": torch.get_num_threads(),
            "engine_args": dataclasses.asdict(engine_args),
            "batch_size": ns.batch_size,
            "input_len": ns.input_len,
            "output_len": ns.output_len,
            "num_iters_warmup": ns.num_iters_warmup,
            "num_iters": ns.num_iters,
            "others_cpu_share": others,
            **summary,
        })  # fmt: skip
    return 0
