"""Part 2 of `benchmarks.preemption`: throughput as the KV pool shrinks, swap vs recompute.

The ShareGPT-shaped workload of `bench throughput` runs on a fresh engine for each preemption
mode and each pool size, a fraction of the workload's demand (the blocks every request fills if
all run at once); greedy outputs are compared with the full pool's run of the same mode (see
`benchmarks.preemption`'s docstring).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from typing import Any

from pagedllm.bench.utils import (
    cpu_counters,
    greedy_agreement,
    greedy_params,
    others_cpu_share,
    print_run,
    speed_figures,
    table_lines,
)
from pagedllm.bench.workload import WorkloadRequest, workload_from_tokenizer
from pagedllm.config import EngineArgs
from pagedllm.core.kv_cache_spec import cdiv


# -- arithmetic ---------------------------------------------------------------------------------
def round_up(n: int, multiple: int) -> int:
    return cdiv(n, multiple) * multiple


def request_blocks(prompt_len: int, output_len: int, block_size: int) -> int:
    """Blocks a request fills by its end: its last sampled token is never fed back, so the K/V
    of prompt_len + output_len - 1 tokens are written."""
    return cdiv(prompt_len + output_len - 1, block_size)


def pool_demand(requests: list[WorkloadRequest], block_size: int) -> int:
    """Blocks the workload needs to run every request at once, to its end."""
    return sum(request_blocks(len(p), n, block_size) for p, n in requests)


def fitting_max_model_len(
    requests: list[WorkloadRequest], block_size: int, limit: int | None = None
) -> int:
    """The longest request (prompt + output) rounded up to a whole block, within `limit` (the
    model's context length)."""
    longest = max(len(p) + n for p, n in requests)
    length = round_up(longest, block_size)
    return length if limit is None else max(longest, min(length, limit))


def pool_blocks(fraction: float, demand: int, min_blocks: int) -> tuple[int, bool]:
    """(blocks, clamped): `fraction` of `demand`, rounded half up, raised to `min_blocks` (one
    request of max_model_len, the engine's start-up minimum) if below; `clamped` says it was."""
    blocks = max(1, int(fraction * demand + 0.5))
    return max(blocks, min_blocks), blocks < min_blocks


# -- part 2: throughput as the pool shrinks -----------------------------------------------------
def run_pool(engine, requests: list[WorkloadRequest]) -> dict[str, Any]:
    """Warm up (one tiny request; the prefix cache emptied after it), queue every request, step
    the engine until all finish; speed, preemption and swap counters of the run."""
    engine.add_request("bench-warm-up", {"prompt_token_ids": requests[0][0][:8]}, greedy_params(4))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()
    scheduler = engine.scheduler
    kv = scheduler.kv_cache_manager
    stats0 = engine.get_stats()
    hits0 = kv.prefix_cache_hits
    outputs: dict[str, list[int]] = {}
    ids = []
    num_steps = max_running = max_swapped = 0
    peak_usage = 0.0
    cpu_before = cpu_counters()
    start = time.perf_counter()
    for i, (prompt, output_len) in enumerate(requests):
        ids.append(
            engine.add_request(
                f"bench-{i}", {"prompt_token_ids": prompt}, greedy_params(output_len)
            )
        )
    while engine.has_unfinished_requests():
        step_outputs = engine.step()
        num_steps += 1
        max_running = max(max_running, scheduler.num_running)
        max_swapped = max(max_swapped, scheduler.num_swapped)
        peak_usage = max(peak_usage, kv.usage)
        for output in step_outputs:
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    others = others_cpu_share(cpu_before, cpu_counters())
    stats = engine.get_stats()

    def delta(key: str) -> int:
        return stats[key] - stats0[key]

    token_ids = [outputs[i] for i in ids]
    return {
        **speed_figures(requests, token_ids, sum(len(t) for t in token_ids), elapsed),
        "num_steps": num_steps,
        "num_preemptions": delta("num_preemptions_total"),
        "num_swap_preemptions": delta("num_swap_preemptions_total"),
        "num_swapped_out_blocks": delta("num_swapped_out_blocks"),
        "num_swapped_in_blocks": delta("num_swapped_in_blocks"),
        "prefix_cache_hit_tokens": kv.prefix_cache_hits - hits0,
        "max_num_running": max_running,
        "max_num_swapped": max_swapped,
        "peak_kv_cache_usage": peak_usage,
        "others_cpu_share": others,
        "token_ids": token_ids,
    }


def compare_outputs(reference: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """Whether `other`'s greedy outputs equal the reference run's, request by request."""
    mismatched = [i for i, (a, b) in enumerate(zip(reference, other, strict=True)) if a != b]
    return {
        "outputs_identical": not mismatched,
        "num_mismatched_requests": len(mismatched),
        "mismatched_requests": mismatched,
        "token_agreement": greedy_agreement(reference, other),
    }


def run_throughput(
    engine_args: EngineArgs, ns: argparse.Namespace, model_info: dict[str, Any]
) -> tuple[dict[str, Any], bool]:
    """Every (mode, pool fraction) run, each on a fresh engine; (results, all outputs agree)."""
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.worker.model_runner import kv_cache_spec

    block_size = engine_args.block_size
    limit = model_info["max_position_embeddings"]
    if engine_args.max_model_len is not None:
        limit = min(limit, engine_args.max_model_len)
    requests = workload_from_tokenizer(
        ns.num_prompts, model_info["tokenizer"], vocab_size=model_info["vocab_size"],
        scale=ns.scale, seed=ns.workload_seed, max_model_len=limit,
    )  # fmt: skip
    max_model_len = fitting_max_model_len(
        requests, block_size, model_info["max_position_embeddings"]
    )
    demand = pool_demand(requests, block_size)
    min_blocks = cdiv(max_model_len, block_size)
    bytes_per_block = kv_cache_spec(
        model_info["config"], block_size, model_info["dtype"]
    ).bytes_per_block
    fractions = [1.0, *(f for f in dict.fromkeys(ns.pool_fractions) if f != 1.0)]
    num_in = sum(len(p) for p, _ in requests)
    num_out = sum(n for _, n in requests)
    workload = {
        "num_prompts": len(requests),
        "scale": ns.scale,
        "seed": ns.workload_seed,
        "num_prompt_tokens": num_in,
        "num_output_tokens": num_out,
        "input_lens": [len(p) for p, _ in requests],
        "output_lens": [n for _, n in requests],
    }
    print(
        f"workload: {len(requests)} requests, ShareGPT-shaped at scale {ns.scale} (seed "
        f"{ns.workload_seed}): {num_in} prompt tokens, {num_out} output tokens (mean "
        f"{num_out / len(requests):.1f}, max {max(workload['output_lens'])}); block size "
        f"{block_size}: demand {demand} blocks ({demand * bytes_per_block / 2**20:.1f} MiB) to run "
        f"all at once; max_model_len {max_model_len} (one request: {min_blocks} blocks)",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    reference_tokens: dict[str, list[list[int]]] = {}
    for mode in ns.modes:
        for fraction in fractions:
            num_blocks, clamped = pool_blocks(fraction, demand, min_blocks)
            if clamped:
                print(
                    f"note: {fraction:.0%} of the demand is less than one request of "
                    f"max_model_len {max_model_len}: the pool is raised to {num_blocks} blocks "
                    f"({num_blocks / demand:.1%})",
                    flush=True,
                )
            args = dataclasses.replace(
                engine_args,
                max_model_len=max_model_len,
                num_gpu_blocks_override=num_blocks,
                kv_cache_memory=None,
                preemption_mode=mode,
                # As large as the pool (the engine caps it there): half a block of slack keeps
                # float rounding from costing a block.
                swap_space=(num_blocks + 0.5) * bytes_per_block / 2**30 if mode == "swap" else 0.0,
            )
            t0 = time.perf_counter()
            engine = LLMEngine(args)
            load_s = time.perf_counter() - t0
            name = f"{mode}, pool {fraction:.0%}"
            print(f"[{name}] {num_blocks} blocks, swap space {engine.num_cpu_blocks} blocks; "
                  f"engine built in {load_s:.1f} s", flush=True)  # fmt: skip
            run = run_pool(engine, requests)
            tokens = run.pop("token_ids")
            run = {
                "mode": mode,
                "pool_fraction": fraction,
                "num_blocks": engine.num_blocks,
                "num_cpu_blocks": engine.num_cpu_blocks,
                "actual_fraction": engine.num_blocks / demand,
                "clamped_to_one_request": clamped,
                **run,
            }
            del engine
            gc.collect()
            if fraction == 1.0:
                reference_tokens[mode] = tokens
            ref = runs_by(runs, mode, 1.0) or run
            run["output_tokens_per_s_vs_full"] = (
                run["output_tokens_per_s"] / ref["output_tokens_per_s"]
            )
            run.update(compare_outputs(reference_tokens[mode], tokens))
            runs.append(run)
            print_run(name, run)
            _print_pool_run(name, run)
    modes_agree = None
    if len(reference_tokens) > 1:
        first, *others = reference_tokens.values()
        modes_agree = all(first == t for t in others)
    all_identical = all(r["outputs_identical"] for r in runs) and modes_agree is not False
    result = {
        "block_size": block_size,
        "max_model_len": max_model_len,
        "demand_blocks": demand,
        "bytes_per_block": bytes_per_block,
        "min_blocks": min_blocks,
        "enable_prefix_caching": engine_args.enable_prefix_caching,
        "workload": workload,
        "runs": runs,
        "full_pool_outputs_agree_across_modes": modes_agree,
        "all_outputs_identical": all_identical,
    }
    return result, all_identical


def runs_by(runs: list[dict[str, Any]], mode: str, fraction: float) -> dict[str, Any] | None:
    return next((r for r in runs if r["mode"] == mode and r["pool_fraction"] == fraction), None)


def _print_pool_run(name: str, r: dict[str, Any]) -> None:
    same = (
        "identical to the 100% run"
        if r["outputs_identical"]
        else f"{r['num_mismatched_requests']} requests DIFFER from the 100% run (token agreement "
        f"{r['token_agreement']:.1%}): a bug"
    )
    print(
        f"[{name}] {r['num_steps']} steps, at most {r['max_num_running']} running; "
        f"{r['num_preemptions']} preemptions ({r['num_swap_preemptions']} by swap), "
        f"{r['num_swapped_out_blocks']} blocks swapped out, {r['num_swapped_in_blocks']} in; "
        f"prefix-cache hits {r['prefix_cache_hit_tokens']} tokens; outputs {same}",
        flush=True,
    )


def format_throughput_table(runs: list[dict[str, Any]]) -> str:
    rows = [
        ("mode", "pool", "blocks", "output tok/s", "requests/s", "time (s)", "preemptions",
         "by swap", "blocks out/in", "vs 100%", "outputs"),
    ]  # fmt: skip
    for r in runs:
        pool = f"{r['pool_fraction']:.0%}" + ("*" if r["clamped_to_one_request"] else "")
        rows.append(
            (
                r["mode"],
                pool,
                str(r["num_blocks"]),
                f"{r['output_tokens_per_s']:.1f}",
                f"{r['requests_per_s']:.2f}",
                f"{r['elapsed_s']:.1f}",
                str(r["num_preemptions"]),
                str(r["num_swap_preemptions"]),
                f"{r['num_swapped_out_blocks']}/{r['num_swapped_in_blocks']}",
                f"{r['output_tokens_per_s_vs_full']:.2f}x",
                "identical" if r["outputs_identical"] else "DIFFER",
            )
        )
    table = "\n".join(table_lines(rows))
    if any(r["clamped_to_one_request"] for r in runs):
        table += "\n* raised to one request of max_model_len (the engine's minimum pool)"
    return table


def print_throughput(throughput: dict[str, Any]) -> None:
    """The table of every run and the verdict on the greedy outputs."""
    print()
    print(
        f"throughput as the KV pool shrinks (block size {throughput['block_size']}, "
        f"demand {throughput['demand_blocks']} blocks, prefix caching "
        f"{'on' if throughput['enable_prefix_caching'] else 'off'}):"
    )
    print(format_throughput_table(throughput["runs"]))
    agree = throughput["full_pool_outputs_agree_across_modes"]
    identical = throughput["all_outputs_identical"]
    print(
        "greedy outputs: "
        + ("identical in every run" if identical else "NOT identical in every run: a bug")
        + ("" if agree is None else f"; 100% runs of the two modes agree: {agree}")
    )
