"""`pagedllm bench throughput`: offline throughput on a ShareGPT-shaped workload.

Every request is queued at once (offline batch inference, as vLLM's benchmark_throughput does),
generates exactly its own `output_len` tokens (greedy, ignore_eos), and we time generation only,
not model loading. Alongside speed we measure how much of the reserved KV cache holds real token
state: pagedllm's block tables (sampled every engine step) against the static cache that a
padded Hugging Face batch implies.

`--baseline hf` (hf_baseline.py) runs the *same* requests through transformers' `generate` on
the same GGUF weights: static batches of `--hf-batch-size` in arrival order, left-padded, each
batch generating the longest output in it. Only useful tokens count (each request's own
output_len), so padding and over-generation cost HF time without adding to its throughput,
exactly as they would in serving.

After the pagedllm run, the GEMM peak of the engine's dtype is measured on the same machine and
the run's model FLOPs utilisation printed (roofline.py): (prompt + output tokens)/s × FLOPs per
token at the run's mean context ÷ that peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from collections.abc import Iterable
from typing import Any

from pagedllm.bench import hf_baseline
from pagedllm.bench.utils import (
    cpu_counters,
    greedy_agreement,
    greedy_params,
    others_cpu_share,
    print_run,
    speed_figures,
    table_lines,
    write_json,
)
from pagedllm.bench.workload import WorkloadRequest, workload_from_tokenizer, workload_tokenizer
from pagedllm.config import EngineArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument(
        "--num-prompts", type=int, default=64, help="number of requests (default: 64)"
    )
    group.add_argument(
        "--scale",
        type=float,
        default=0.25,
        help="length scale of the ShareGPT-shaped workload: 1.0 = ShareGPT's means "
        "(161 prompt / 338 output tokens), 0.25 = a quarter as long (default: 0.25)",
    )
    group.add_argument(
        "--workload-seed", type=int, default=0, help="seed of the synthetic workload (default: 0)"
    )
    group.add_argument(
        "--baseline",
        choices=("none", "hf"),
        default="none",
        help="also run the same requests through HF transformers generate (default: none)",
    )
    group.add_argument(
        "--hf-batch-size",
        type=int,
        default=32,
        help="static batch size of the HF baseline (default: 32)",
    )
    group.add_argument(
        "--output-json", type=str, default=None, help="write every figure to this JSON file"
    )


# -- KV-cache accounting ------------------------------------------------------------------------
class KVUsageTracker:
    """Samples a KVCacheManager after each engine step: reserved slots vs slots holding tokens.

    Reserved = distinct physical blocks in the block tables × block_size. Held = for each of those
    blocks, how many of its slots carry a computed token (a block shared by several requests
    counts once, with the fullest holder's count).
    """

    def __init__(self) -> None:
        self.num_samples = 0
        self.sum_reserved = 0
        self.sum_held = 0
        self.peak_reserved = 0
        self.held_at_peak = 0
        self.min_share: float | None = None

    def observe(self, kv_cache_manager, requests: dict) -> tuple[int, int]:
        """`requests` maps seq_id → Sequence (for num_computed_tokens)."""
        block_size = kv_cache_manager.block_size
        filled: dict[int, int] = {}
        for request_id, blocks in kv_cache_manager.req_to_blocks.items():
            request = requests.get(request_id)
            computed = request.num_computed_tokens if request is not None else 0
            for i, block in enumerate(blocks):
                n = min(block_size, max(0, computed - i * block_size))
                key = block.block_id
                if n > filled.get(key, -1):
                    filled[key] = n
        reserved = len(filled) * block_size
        held = sum(filled.values())
        if reserved:
            self.num_samples += 1
            self.sum_reserved += reserved
            self.sum_held += held
            share = held / reserved
            self.min_share = share if self.min_share is None else min(self.min_share, share)
            if reserved > self.peak_reserved:
                self.peak_reserved, self.held_at_peak = reserved, held
        return reserved, held

    @property
    def share_at_peak(self) -> float:
        return self.held_at_peak / self.peak_reserved if self.peak_reserved else 0.0

    @property
    def mean_share(self) -> float:
        """Held / reserved summed over all steps (a time-weighted average)."""
        return self.sum_held / self.sum_reserved if self.sum_reserved else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_samples": self.num_samples,
            "peak_reserved_slots": self.peak_reserved,
            "held_slots_at_peak": self.held_at_peak,
            "used_share_at_peak": self.share_at_peak,
            "used_share_mean_over_steps": self.mean_share,
            "used_share_min_over_steps": self.min_share,
        }


# -- pagedllm -----------------------------------------------------------------------------------
def run_pagedllm(engine, requests: list[WorkloadRequest]) -> dict[str, Any]:
    """Queue every request, then step the engine to completion, sampling KV use each step."""
    from pagedllm.distributed.parallel import COMM_BYTES  # torch: imported when a run starts

    # Warm-up (one tiny request) so first-call overheads are not timed.
    engine.add_request("bench-warm-up", requests[0][0][:8], greedy_params(4))
    while engine.has_unfinished_requests():
        engine.step()

    scheduler = engine.scheduler
    kv = scheduler.kv_cache_manager
    tracker = KVUsageTracker()
    outputs: dict[str, list[int]] = {}
    ids = []
    num_steps = 0
    comm_before = dict(COMM_BYTES)
    cpu_before = cpu_counters()
    start = time.perf_counter()
    for i, (prompt, output_len) in enumerate(requests):
        ids.append(engine.add_request(f"bench-{i}", prompt, greedy_params(output_len)))
    while engine.has_unfinished_requests():
        step_outputs = engine.step()
        num_steps += 1
        tracker.observe(kv, scheduler.running_seqs_by_id())
        for output in step_outputs:
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    others = others_cpu_share(cpu_before, cpu_counters())

    token_ids = [outputs[i] for i in ids]
    return {
        **speed_figures(requests, token_ids, sum(len(t) for t in token_ids), elapsed),
        "num_steps": num_steps,
        "num_preemptions": getattr(scheduler, "num_preemptions_total", None),
        # tensor parallelism: bytes rank 0 passed to collectives, per step, by kind
        "comm_bytes_per_step": {
            k: (v - comm_before.get(k, 0)) / max(num_steps, 1) for k, v in COMM_BYTES.items()
        },
        "others_cpu_share": others,
        "kv_cache": {
            "block_size": kv.block_size,
            "num_blocks": engine.num_blocks,
            "peak_pool_usage": tracker.peak_reserved / (kv.block_size * engine.num_blocks),
            **tracker.as_dict(),
        },
        "token_ids": token_ids,
    }


def mean_context_len(lengths: Iterable[tuple[int, int]]) -> float:
    """Mean context a processed token attends to, over (prompt_len, output_len) requests.

    Each of a request's L = prompt + output tokens is counted once, the t-th (1-based) attending
    to t tokens, itself included: Σ t = L(L+1)/2 per request. This is the prompt tokens seeing
    on average (prompt+1)/2 and output token j seeing prompt + j, give or take one token (the
    last sampled token is never fed back, the first comes from the last prompt position).
    Prefix-cache hits, which skip prompt tokens, are not subtracted.
    """
    total = weighted = 0
    for prompt_len, output_len in lengths:
        n = prompt_len + output_len
        total += n
        weighted += n * (n + 1) // 2
    return weighted / total if total else 0.0


def mfu_figures(
    config, total_tokens_per_s: float, context_len: float, peak: dict[str, Any]
) -> dict[str, Any]:
    """The MFU entry of the JSON results: the figure and every number it is made of."""
    from pagedllm.bench import roofline  # torch: imported when a benchmark runs

    fpt = roofline.flops_per_token(config, context_len)
    peak_flops = peak["best_gflops"] * 1e9
    return {
        "mfu": roofline.mfu(total_tokens_per_s, fpt, peak_flops),
        "model_gflops": total_tokens_per_s * fpt / 1e9,
        "peak_gflops": peak["best_gflops"],
        "flops_per_token": fpt,
        "mean_context_len": context_len,
        "tokens_per_s": total_tokens_per_s,
        "gemm_peak": peak,
    }


def mfu_line(name: str, m: dict[str, Any]) -> str:
    return (
        f"[{name}] model FLOPs utilisation: {m['mfu']:.1%} ({m['model_gflops']:.1f} GFLOP/s of "
        f"{m['peak_gflops']:.1f} GFLOP/s peak {m['gemm_peak']['dtype']} GEMM measured now; "
        f"{m['flops_per_token'] / 1e6:.1f} MFLOP/token at mean context "
        f"{m['mean_context_len']:.1f})"
    )


# -- reporting ----------------------------------------------------------------------------------
def format_table(results: dict[str, Any]) -> str:
    rows = [("system", "requests/s", "output tok/s", "total tok/s", "time (s)", "KV slots used",
             "MFU")]  # fmt: skip
    p = results["pagedllm"]
    rows.append(
        (
            "pagedllm",
            f"{p['requests_per_s']:.2f}",
            f"{p['output_tokens_per_s']:.1f}",
            f"{p['total_tokens_per_s']:.1f}",
            f"{p['elapsed_s']:.1f}",
            f"{p['kv_cache']['used_share_at_peak']:.1%} at peak",
            f"{p['mfu']['mfu']:.1%}" if "mfu" in p else "-",
        )
    )
    hf = results.get("hf")
    if hf is not None:
        rows.append(
            (
                f"HF generate (batch {hf['batch_size']})",
                f"{hf['requests_per_s']:.2f}",
                f"{hf['output_tokens_per_s']:.1f}",
                f"{hf['total_tokens_per_s']:.1f}",
                f"{hf['elapsed_s']:.1f}",
                f"{hf['kv_cache']['used_share']:.1%} of static",
                "-",
            )
        )
    lines = table_lines(rows)
    if hf is not None:
        lines.append(
            f"pagedllm / HF, useful output tokens/s: {results['speedup_output_tokens_per_s']:.2f}x"
        )
    return "\n".join(lines)


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    if ns.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    if ns.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {ns.hf_batch_size}")
    import torch

    from pagedllm.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(engine_args)
    load_s = time.perf_counter() - t0
    tokenizer = workload_tokenizer(engine)  # without one, every id of the embedding table
    vocab_size = engine.model_config.vocab_size
    requests = workload_from_tokenizer(
        ns.num_prompts,
        tokenizer,
        vocab_size=vocab_size,
        scale=ns.scale,
        seed=ns.workload_seed,
        max_model_len=engine.max_model_len,
    )
    num_in = sum(len(p) for p, _ in requests)
    num_out = sum(n for _, n in requests)
    print(
        f"workload: {len(requests)} requests, ShareGPT-shaped at scale {ns.scale} "
        f"(seed {ns.workload_seed}): {num_in} prompt tokens (mean {num_in / len(requests):.1f}), "
        f"{num_out} output tokens (mean {num_out / len(requests):.1f}); "
        f"torch threads: {torch.get_num_threads()}"
    )
    print(f"pagedllm: {engine.model_name} loaded in {load_s:.1f} s")

    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(sys.argv),
        "model": engine.model_name,
        "torch_num_threads": torch.get_num_threads(),
        "engine_args": {k: v for k, v in dataclasses.asdict(engine_args).items()},
        "workload": {
            "num_prompts": len(requests),
            "scale": ns.scale,
            "seed": ns.workload_seed,
            "num_prompt_tokens": num_in,
            "num_output_tokens": num_out,
            "input_lens": [len(p) for p, _ in requests],
            "output_lens": [n for _, n in requests],
        },
    }

    paged = run_pagedllm(engine, requests)
    paged_tokens = paged.pop("token_ids")
    results["pagedllm"] = paged
    print_run("pagedllm", paged)
    kv = paged["kv_cache"]
    print(
        f"[pagedllm] KV cache: at peak {kv['peak_reserved_slots']} slots reserved "
        f"({kv['peak_pool_usage']:.1%} of the pool), {kv['held_slots_at_peak']} hold tokens "
        f"= {kv['used_share_at_peak']:.1%} used; over all {paged['num_steps']} steps "
        f"{kv['used_share_mean_over_steps']:.1%} used; preemptions: {paged['num_preemptions']}"
    )
    if paged["num_useful_output_tokens"] != num_out:
        print(
            f"warning: pagedllm generated {paged['num_useful_output_tokens']} useful tokens, "
            f"expected {num_out}",
            file=sys.stderr,
        )
    if engine.args.tensor_parallel_size > 1:
        comm = paged["comm_bytes_per_step"]
        print(
            f"[pagedllm] tensor parallelism: {engine.args.tensor_parallel_size} ranks; per step, "
            "rank 0's tensors in collectives: "
            + ", ".join(f"{kind} {b / 1024:.1f} KiB" for kind, b in sorted(comm.items()))
        )
    # MFU: the peak is measured now, after the run, in the dtype the engine ran in.
    from pagedllm.bench import roofline

    peak = roofline.measure_gemm_peak(engine.dtype, device=engine.device)
    print(f"[pagedllm] {roofline.gemm_peak_line(peak)}")
    context = mean_context_len((len(p), n) for p, n in requests)
    paged["mfu"] = mfu_figures(engine.model_config, paged["total_tokens_per_s"], context, peak)
    print(mfu_line("pagedllm", paged["mfu"]))
    hf_model = engine_args.model
    del engine
    gc.collect()

    if ns.baseline == "hf":
        t0 = time.perf_counter()
        directory, gguf_file = hf_baseline.resolve_hf_source(hf_model)
        model = hf_baseline.load_hf_model(directory, gguf_file)
        source = directory / gguf_file if gguf_file else directory
        print(f"HF transformers: {source} loaded in {time.perf_counter() - t0:.1f} s")
        hf = hf_baseline.run_hf(model, requests, ns.hf_batch_size)
        hf_tokens = hf.pop("token_ids")
        hf["model_source"] = str(source)
        hf["greedy_agreement_with_pagedllm"] = greedy_agreement(
            paged_tokens, hf_tokens, hf["eos_token_ids"]
        )
        results["hf"] = hf
        print_run(f"HF batch {ns.hf_batch_size}", hf)
        hkv = hf["kv_cache"]
        print(
            f"[HF batch {ns.hf_batch_size}] KV cache (static, padded batches): "
            f"{hkv['reserved_slots']} slots reserved, {hkv['used_slots']} hold real tokens "
            f"= {hkv['used_share']:.1%} used, {hkv['waste_share']:.1%} wasted"
        )
        print(
            "greedy agreement with pagedllm (share of output tokens before the first divergence, "
            "up to the first EOS): "
            f"{hf['greedy_agreement_with_pagedllm']:.1%}"
        )
        results["speedup_output_tokens_per_s"] = (
            paged["output_tokens_per_s"] / hf["output_tokens_per_s"]
        )
        del model
        gc.collect()

    print()
    print(format_table(results))
    if ns.output_json:
        write_json(ns.output_json, results)
    return 0
