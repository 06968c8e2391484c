"""`python -m benchmarks.quantization`: memory, speed and accuracy of fp32, bf16, int8 and int4.

One engine per configuration, built and freed in turn, on the same engine flags otherwise. For
each: the weight memory (bytes of parameters and buffers), single-stream decode tokens/s (one
request; the first step, prefill + first token, is not timed), batched throughput (`--batch-size`
requests queued at once, output tokens/s), and the accuracy cost against float32 on a fixed
prompt set. Accuracy is teacher-forced: float32 first generates a greedy continuation of every
prompt, then every configuration scores prompt + continuation in one prefill (prompt_logprobs),
so positions align however early a configuration would have diverged. Reported: the mean
absolute difference of the continuation tokens' log-probabilities from float32's, and greedy-token
agreement, the share of positions where the configuration's most likely token is float32's
greedy token (rank 1). All generation is greedy with ignore_eos.

A configuration is a dtype (float32, bfloat16, float16) or a method (int8, int4) whose
activations are bfloat16 (what `--dtype auto` gives on CPUs with bf16 instructions), or
`method:dtype` for other activations, e.g. `int4:float32`.
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
from pagedllm.bench.utils import cpu_counters, others_cpu_share, table_lines
from pagedllm.config import QUANTIZATION_METHODS, EngineArgs

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_CONFIGS = "float32,bfloat16,int8,int4"
REFERENCE = "float32"

# A fixed, varied prompt set (facts, code, story, instructions); `--num-prompts` cycles it.
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "import numpy as np\n\n# compute the mean of a list\n",
    "The most important thing to remember when learning a new language is",
    "Water boils at 100 degrees Celsius because",
    "Dear hiring manager, I am writing to apply for",
    "The difference between a list and a tuple in Python is",
    "In 1969, the first humans landed on",
    "A good breakfast should include",
    "The quick brown fox",
    "Here is a haiku about autumn:\n",
    "SELECT name, age FROM users WHERE",
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help="comma-separated: dtypes and int8 / int4 (bfloat16 activations), or method:dtype "
        f"(default: {DEFAULT_CONFIGS}; float32, the reference, always runs first)",
    )
    group.add_argument(
        "--num-prompts", type=int, default=16, help="prompts scored for accuracy (default: 16)"
    )
    group.add_argument(
        "--output-len", type=int, default=64, help="tokens generated per request (default: 64)"
    )
    group.add_argument(
        "--batch-size", type=int, default=32, help="requests of the batched run (default: 32)"
    )
    group.add_argument(
        "--output-json", type=str, default=None, help="write every figure to this JSON file"
    )


def parse_configs(text: str) -> list[tuple[str, str, str]]:
    """'float32,int4,int4:float32' -> [(label, dtype, quantization)], the reference first."""
    configs = []
    for label in [c.strip() for c in text.split(",") if c.strip()]:
        method, _, dtype = label.partition(":")
        if method in DTYPES and not dtype:
            method, dtype = "none", method
        elif method in QUANTIZATION_METHODS and method != "none":
            dtype = dtype or "bfloat16"
        else:
            raise ValueError(f"unknown configuration {label!r}: use {', '.join(DTYPES)}, "
                             "int8, int4 or method:dtype")  # fmt: skip
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype in {label!r}: use one of {', '.join(DTYPES)}")
        if label not in [c[0] for c in configs]:
            configs.append((label, dtype, method))
    reference = (REFERENCE, "float32", "none")
    return [reference, *(c for c in configs if c[1:] != reference[1:])]


def prompt_token_ids(engine, num_prompts: int) -> list[list[int]]:
    """The fixed prompts, cycled with a numbered prefix once past the set, so none repeats
    (no prefix-cache sharing between them). Without a tokenizer: bytes modulo the vocabulary."""
    texts = [
        PROMPTS[i % len(PROMPTS)] if i < len(PROMPTS) else f"{i}. {PROMPTS[i % len(PROMPTS)]}"
        for i in range(num_prompts)
    ]
    tokenizer = engine.tokenizer
    if tokenizer is None:
        vocab = engine.model_config.vocab_size
        return [[b % vocab for b in t.encode()] for t in texts]
    return [tokenizer.encode(t) for t in texts]


def _greedy(max_tokens: int, prompt_logprobs: int | None = None):
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(
        temperature=0.0, ignore_eos=True, max_tokens=max_tokens, prompt_logprobs=prompt_logprobs
    )


def _run_all(engine, prompts: list[list[int]], params) -> list:
    """Queue every prompt at once, step until done; outputs in prompt order."""
    tag = f"q{time.perf_counter_ns()}"
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"{tag}-{i}"] for i in range(len(prompts))]


def decode_speed(engine, prompt: list[int], output_len: int) -> dict[str, Any]:
    """One request alone: tokens/s over the decode steps after the first token."""
    engine.add_request("decode", {"prompt_token_ids": prompt}, _greedy(output_len))
    engine.step()  # prefill + first token, not timed
    steps = 0
    cpu_before = cpu_counters()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    return {
        "decode_tokens": steps,
        "decode_s": elapsed,
        "decode_tokens_per_s": steps / elapsed if elapsed > 0 else None,
        "decode_others_cpu_share": others_cpu_share(cpu_before, cpu_counters()),
    }


def batched_speed(engine, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    cpu_before = cpu_counters()
    start = time.perf_counter()
    outs = _run_all(engine, prompts, _greedy(output_len))
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "batch_size": len(prompts),
        "batch_output_tokens": tokens,
        "batch_s": elapsed,
        "batch_tokens_per_s": tokens / elapsed if elapsed > 0 else None,
        "batch_others_cpu_share": others_cpu_share(cpu_before, cpu_counters()),
    }


def continuation_logprobs(
    engine, prompts: list[list[int]], continuations: list[list[int]]
) -> tuple[list[list[float]], list[list[int]]]:
    """Teacher-forced: each continuation token's logprob and rank given prompt + the
    continuation before it, from one prefill of prompt + continuation."""
    full = [p + c for p, c in zip(prompts, continuations, strict=True)]
    outs = _run_all(engine, full, _greedy(1, prompt_logprobs=0))
    logprobs, ranks = [], []
    for out, p, c in zip(outs, prompts, continuations, strict=True):
        lps = out.prompt_logprobs[len(p) :]
        records = [d[t] for d, t in zip(lps, c, strict=True)]
        logprobs.append([r.logprob for r in records])
        ranks.append([r.rank for r in records])
    return logprobs, ranks


def accuracy(
    ref_logprobs: list[list[float]], logprobs: list[list[float]], ranks: list[list[int]]
) -> dict[str, Any]:
    diffs = [
        abs(a - b)
        for ra, rb in zip(ref_logprobs, logprobs, strict=True)
        for a, b in zip(ra, rb, strict=True)
    ]
    flat_ranks = [r for row in ranks for r in row]
    return {
        "num_scored_tokens": len(diffs),
        "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else 0.0,
        "max_abs_logprob_diff": max(diffs, default=0.0),
        "greedy_agreement": sum(r == 1 for r in flat_ranks) / len(flat_ranks) if diffs else 1.0,
    }


def _warm_up(engine, prompt: list[int]) -> None:
    _run_all(engine, [prompt[:8]], _greedy(4))


def run_config(
    engine_args: EngineArgs,
    dtype: str,
    method: str,
    prompts: list[list[int]] | None,
    reference: dict[str, Any] | None,
    ns: argparse.Namespace,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Build one engine, measure it, free it. Returns (figures, state for later configs)."""
    from pagedllm.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(dataclasses.replace(engine_args, dtype=dtype, quantization=method))
    load_s = time.perf_counter() - t0
    if prompts is None:
        prompts = prompt_token_ids(engine, max(ns.num_prompts, ns.batch_size))
    figures: dict[str, Any] = {
        "dtype": dtype,
        "quantization": method,
        "load_s": load_s,
        "weight_bytes": engine.weight_bytes,
    }
    _warm_up(engine, prompts[0])
    figures.update(decode_speed(engine, prompts[0], ns.output_len))
    figures.update(batched_speed(engine, prompts[: ns.batch_size], ns.output_len))
    scored = prompts[: ns.num_prompts]
    if reference is None:  # float32: its greedy continuations are what everyone is scored on
        outs = _run_all(engine, scored, _greedy(ns.output_len))
        continuations = [list(o.outputs[0].token_ids) for o in outs]
        ref_logprobs, ranks = continuation_logprobs(engine, scored, continuations)
        reference = {
            "prompts": prompts,
            "continuations": continuations,
            "logprobs": ref_logprobs,
        }
        logprobs = ref_logprobs
    else:
        logprobs, ranks = continuation_logprobs(engine, scored, reference["continuations"])
    figures.update(accuracy(reference["logprobs"], logprobs, ranks))
    figures["model"] = engine.model_name
    del engine
    gc.collect()
    return figures, reference


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def add_ratios(results: dict[str, dict[str, Any]]) -> None:
    """Each configuration's figures over float32's, from the same run."""
    ref = results[REFERENCE]
    for r in results.values():
        r["weight_bytes_ratio"] = _ratio(r["weight_bytes"], ref["weight_bytes"])
        r["decode_speedup"] = _ratio(r["decode_tokens_per_s"], ref["decode_tokens_per_s"])
        r["batch_speedup"] = _ratio(r["batch_tokens_per_s"], ref["batch_tokens_per_s"])


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_table(results: dict[str, dict[str, Any]]) -> str:
    header = ("config", "weights MiB", "vs fp32", "decode tok/s", "vs fp32", "batch tok/s",
              "vs fp32", "mean |dlogp|", "greedy agree")  # fmt: skip
    rows = [header]
    for label, r in results.items():
        rows.append(
            (
                label,
                f"{r['weight_bytes'] / 2**20:.1f}",
                _x(r["weight_bytes_ratio"]),
                f"{r['decode_tokens_per_s']:.1f}",
                _x(r["decode_speedup"]),
                f"{r['batch_tokens_per_s']:.1f}",
                _x(r["batch_speedup"]),
                f"{r['mean_abs_logprob_diff']:.4f}",
                f"{r['greedy_agreement']:.1%}",
            )
        )
    return "\n".join(table_lines(rows))


def run_benchmark(ns: argparse.Namespace, engine_args: EngineArgs) -> dict[str, Any]:
    for flag in ("num_prompts", "output_len", "batch_size"):
        if getattr(ns, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}")
    import torch

    configs = parse_configs(ns.configs)
    results: dict[str, dict[str, Any]] = {}
    prompts, reference = None, None
    for label, dtype, method in configs:
        figures, reference = run_config(engine_args, dtype, method, prompts, reference, ns)
        prompts = reference["prompts"]
        results[label] = figures
        busy = max(figures["decode_others_cpu_share"] or 0, figures["batch_others_cpu_share"] or 0)
        note = " (busy machine: speeds skewed)" if busy > 0.1 else ""
        print(
            f"[{label}] weights {figures['weight_bytes'] / 2**20:.1f} MiB, decode "
            f"{figures['decode_tokens_per_s']:.1f} tok/s, batch of {figures['batch_size']} "
            f"{figures['batch_tokens_per_s']:.1f} tok/s, loaded in {figures['load_s']:.1f} s; "
            f"other processes used up to {busy:.1%} of the CPU{note}"
        )
    add_ratios(results)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(sys.argv),
        "model": results[REFERENCE]["model"],
        "torch_num_threads": torch.get_num_threads(),
        "engine_args": dataclasses.asdict(engine_args),
        "num_prompts": ns.num_prompts,
        "output_len": ns.output_len,
        "configs": results,
    }


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    out = run_benchmark(ns, engine_args)
    print()
    print(
        f"{out['model']}: {ns.num_prompts} prompts x {ns.output_len} tokens scored against "
        f"float32's greedy continuation; torch threads: {out['torch_num_threads']}"
    )
    print(format_table(out["configs"]))
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(out, indent=2, default=str) + "\n")
        print(f"wrote {ns.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
