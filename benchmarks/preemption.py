"""`python -m benchmarks.preemption`: what preemption costs, swap vs recompute (paper Fig. 19).

When the KV-cache pool runs dry, the scheduler preempts the latest-arrived running group. Mode
"swap" copies its blocks to a CPU swap pool and back when it resumes; mode "recompute" drops them
and later re-prefills its prompt + generated tokens. Two measurements, `--part recovery|throughput`:

**Recovery time vs block size** (the PagedAttention paper, SOSP 2023, section 7.3, Fig. 19a).
The model is loaded once (an engine, for its flags: model, dtype, device, attention backend);
for each block size a `ModelRunner` over it gets its own KV pool and swap pool, and a
`KVCacheManager` (prefix caching off) the block table of one sequence holding `context_len`
tokens (a prompt and generated tokens, half each). Its recovery is timed as the engine's steps
run it, through `ModelRunner.execute_model` with a `SchedulerOutput`:

- swap: the step that swaps the group out (`KVCacheManager.swap_out`'s (device, cpu) pairs, run by
  `ModelRunner.execute_model` as one batched copy) plus the step that swaps it back in (to fresh
  device blocks); median over `--swap-repeats` round trips, each checked to bring back the K/V
  bit for bit. The block-table bookkeeping of both (torch-free) is timed apart.
- recompute: the runner's step that prefills all `context_len` tokens again as one chunk into
  fresh blocks (as the scheduler re-admits a group preempted for recompute), sampling the next
  token as that step does; median over `--repeats`. This is the worst case: with prefix caching
  on, the engine re-admits a group at its longest cached prefix, which may be most of it.

**Throughput as the pool shrinks** (what preemption costs end to end). The ShareGPT-shaped workload
of `bench throughput` (greedy, ignore_eos, each request's own output length, all queued at once)
runs with the KV pool set to fractions of its demand, in each preemption mode. Demand = the blocks
every request fills if all run at once: cdiv(prompt + output - 1, block_size) per request (the
last sampled token is never fed back, so its K/V are never written). `max_model_len` is the
longest request rounded up to a whole block, so that the engine's start-up check (the pool holds
one such request) admits small pools; a fraction below one request is raised to it, and said so.
Swap mode gets a swap space as large as the pool. Greedy outputs must not depend on the pool or
the mode: each run is compared with the 100% run of its mode, and a mismatch is reported as a bug.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common
from benchmarks.common import int_list
from pagedllm.bench.utils import (
    cpu_counters,
    greedy_agreement,
    others_cpu_share,
    print_run,
    speed_figures,
)
from pagedllm.bench.utils import greedy_params as _greedy_params
from pagedllm.bench.utils import median as _median
from pagedllm.bench.workload import WorkloadRequest, normal_token_ids, workload_from_tokenizer
from pagedllm.config import EngineArgs
from pagedllm.core.kv_cache_spec import cdiv

PARTS = ("recovery", "throughput")
MODES = ("recompute", "swap")
DEFAULT_BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
DEFAULT_CONTEXT_LENS = [256, 1024]
DEFAULT_POOL_FRACTIONS = [1.0, 0.5, 0.25, 0.1]

PAPER_SETUP = (
    "PagedAttention paper (SOSP 2023), section 7.3, Fig. 19: OPT-13B on an A100, swapping over "
    "PCIe to CPU memory vs recomputation, by block size"
)
PAPER_FINDING = (
    "swapping costs far more at small block sizes (many small CPU-GPU copies cannot use the PCIe "
    "bandwidth), recomputation costs the same at every block size (it does not use the KV "
    "blocks); so recompute wins at small blocks and swap at large ones, and end to end the two "
    "are comparable at block sizes 16 to 64"
)

# Engine flags this benchmark sets itself (the rest are honoured as given).
_OVERRIDDEN = (
    "max_model_len",
    "num_gpu_blocks_override",
    "kv_cache_memory",
    "preemption_mode",
    "swap_space",
)


# -- command line -------------------------------------------------------------------------------
def _fraction_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"pool fractions must be in (0, 1], got {text!r}")
    return values


def _mode_list(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values or any(v not in MODES for v in values):
        raise argparse.ArgumentTypeError(
            f"modes are a comma-separated subset of {', '.join(MODES)}, got {text!r}"
        )
    return list(dict.fromkeys(values))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument(
        "--part",
        choices=(*PARTS, "all"),
        default="all",
        help="recovery: swap vs recompute time of one preempted group by block size; "
        "throughput: the workload as the KV pool shrinks; all: both (default: all)",
    )
    group.add_argument(
        "--block-sizes",
        type=int_list,
        default=list(DEFAULT_BLOCK_SIZES),
        help="recovery: block sizes (default: 1,2,4,8,16,32,64,128); the throughput part uses "
        "--block-size",
    )
    group.add_argument(
        "--context-lens",
        "--context-len",
        type=int_list,
        default=list(DEFAULT_CONTEXT_LENS),
        help="recovery: tokens (prompt + generated) of the preempted group (default: 256,1024)",
    )
    group.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="recovery: timed recomputations per point, median reported (default: 5)",
    )
    group.add_argument(
        "--swap-repeats",
        type=int,
        default=20,
        help="recovery: timed swap round trips per point, median reported (default: 20)",
    )
    group.add_argument(
        "--num-prompts",
        type=int,
        default=32,
        help="throughput: number of requests, queued at once (default: 32)",
    )
    group.add_argument(
        "--scale",
        type=float,
        default=0.25,
        help="throughput: length scale of the ShareGPT-shaped workload, as in bench throughput "
        "(default: 0.25)",
    )
    group.add_argument(
        "--workload-seed", type=int, default=0, help="seed of the synthetic workload (default: 0)"
    )
    group.add_argument(
        "--pool-fractions",
        type=_fraction_list,
        default=list(DEFAULT_POOL_FRACTIONS),
        help="throughput: KV pool sizes as fractions of the workload's demand (default: "
        "1,0.5,0.25,0.1; 1 always runs, as the reference)",
    )
    group.add_argument(
        "--modes",
        type=_mode_list,
        default=list(MODES),
        help="throughput: preemption modes (default: recompute,swap)",
    )
    group.add_argument(
        "--output-json", type=str, default=None, help="write every figure to this JSON file"
    )


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


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- part 1: recovery time vs block size -------------------------------------------------------
def _sequence(context_len: int, vocab: np.ndarray, seed: int):
    """One sequence of `context_len` tokens: a prompt (the first half) and generated tokens."""
    from pagedllm.request import Request
    from pagedllm.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    tokens = vocab[rng.integers(0, vocab.size, size=context_len)].tolist()
    prompt_len = max(1, context_len - context_len // 2)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=context_len)
    seq = Request(f"preempted-{context_len}", tokens[:prompt_len], params)
    for token_id in tokens[prompt_len:]:
        seq.append_output_token(token_id)
    return seq


def measure_recovery(
    model,
    config,
    device,
    dtype,
    block_size: int,
    context_len: int,
    *,
    vocab: np.ndarray,
    repeats: int = 5,
    swap_repeats: int = 20,
    seed: int = 0,
) -> dict[str, Any]:
    """Recovery times of one preempted sequence of `context_len` tokens at `block_size` (see the
    module docstring): swap out + in through the runner's batched copies, and recompute as the
    runner's prefill of the whole context. One untimed warm-up of each first."""
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.scheduler import SchedulerOutput
    from pagedllm.worker.model_runner import ModelRunner

    num_seq_blocks = cdiv(context_len, block_size)
    # Room for the sequence and for the fresh blocks it is recomputed or swapped back into.
    num_blocks = 2 * num_seq_blocks
    runner = ModelRunner(model, config, block_size, device, dtype, seed=seed)
    runner.initialize_kv_cache(num_blocks, num_seq_blocks)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False,
                        num_cpu_blocks=num_seq_blocks,
                        sliding_windows=runner.kv_cache_spec.sliding_windows)  # fmt: skip
    seq = _sequence(context_len, vocab, seed)
    sid = seq.seq_id

    # Recompute: the sequence was preempted (blocks freed, nothing computed); the scheduler
    # re-admits it into fresh blocks and the runner prefills its whole context in one chunk.
    recompute_s, recompute_book_s, sampled = [], [], set()
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        kv.free(seq)
        seq.num_computed_tokens = 0
        if kv.allocate_slots(seq, context_len, []) is None:
            raise RuntimeError("the recovery pool is too small for the sequence")
        so = SchedulerOutput(
            scheduled_requests=[seq],
            num_scheduled_tokens={sid: context_len},
            block_ids={sid: kv.get_group_block_ids(sid)},
            total_num_scheduled_tokens=context_len,
        )
        t1 = time.perf_counter()
        _sync(device)
        t2 = time.perf_counter()
        out = runner.execute_model(so)
        _sync(device)
        t3 = time.perf_counter()
        if rep:  # the first is the warm-up
            recompute_book_s.append(t1 - t0)
            recompute_s.append(t3 - t2)
        sampled.add(tuple(out.sampled_token_ids[sid]))
    seq.num_computed_tokens = context_len

    # Swap: out (device -> cpu) in one step, back in (cpu -> fresh device blocks) in a later one.
    pool = runner.kv_cache.pool
    before = pool[:, :, kv.get_block_ids(sid)].clone()
    out_s, in_s, book_s, exact = [], [], [], True
    num_pairs = None
    for rep in range(swap_repeats + 1):
        t0 = time.perf_counter()
        swap_out = kv.swap_out([seq])
        so_out = SchedulerOutput([], {}, {}, 0, blocks_to_swap_out=swap_out)
        t1 = time.perf_counter()
        _sync(device)
        t2 = time.perf_counter()
        runner.execute_model(so_out)
        _sync(device)
        t3 = time.perf_counter()
        swap_in = kv.swap_in([seq])
        so_in = SchedulerOutput([], {}, {}, 0, blocks_to_swap_in=swap_in)
        t4 = time.perf_counter()
        _sync(device)
        t5 = time.perf_counter()
        runner.execute_model(so_in)
        _sync(device)
        t6 = time.perf_counter()
        num_pairs = (len(swap_out), len(swap_in))
        exact = exact and torch_equal(pool[:, :, kv.get_block_ids(sid)], before)
        if rep:
            book_s.append((t1 - t0) + (t4 - t3))
            out_s.append(t3 - t2)
            in_s.append(t6 - t5)
    kv.check_integrity()
    bytes_per_block = pool[:, :, 0].numel() * pool.element_size()
    round_trips = [a + b for a, b in zip(out_s, in_s, strict=True)]
    result = {
        "block_size": block_size,
        "context_len": context_len,
        "num_blocks": num_seq_blocks,
        "num_swapped_blocks": list(num_pairs),
        "bytes_per_block": bytes_per_block,
        "swap_out_ms": _ms(_median(out_s)),
        "swap_in_ms": _ms(_median(in_s)),
        "swap_ms": _ms(_median(round_trips)),
        "swap_bookkeeping_ms": _ms(_median(book_s)),
        "recompute_ms": _ms(_median(recompute_s)),
        "recompute_bookkeeping_ms": _ms(_median(recompute_book_s)),
        "swap_round_trip_exact": bool(exact),
        "recompute_deterministic": len(sampled) == 1,
        "swap_ms_all": [_ms(s) for s in round_trips],
        "recompute_ms_all": [_ms(s) for s in recompute_s],
    }
    result["recompute_over_swap"] = result["recompute_ms"] / result["swap_ms"]
    # Bytes moved each way, and the copies' rate over the round trip (both ways).
    result["bytes_swapped"] = num_pairs[0] * bytes_per_block
    result["swap_gb_per_s"] = 2 * result["bytes_swapped"] / _median(round_trips) / 1e9
    del runner, kv
    gc.collect()
    return result


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def run_recovery(engine, ns: argparse.Namespace) -> dict[str, Any]:
    """Every (context length, block size) point on the engine's loaded model."""
    limit = engine.model_config.max_position_embeddings
    too_long = [c for c in ns.context_lens if c > limit]
    if too_long:
        raise ValueError(
            f"--context-lens {too_long} exceed the model's context length {limit}: lower them"
        )
    tokenizer = engine.tokenizer
    vocab_size = engine.model_config.vocab_size
    special = (getattr(tokenizer, "all_special_ids", ()) or ()) if tokenizer is not None else ()
    vocab = normal_token_ids(vocab_size, special)
    points = []
    for context_len in ns.context_lens:
        for block_size in ns.block_sizes:
            cpu_before = cpu_counters()
            point = measure_recovery(
                engine.executor.driver_worker.model, engine.model_config, engine.device,
                engine.dtype, block_size,
                context_len, vocab=vocab, repeats=ns.repeats, swap_repeats=ns.swap_repeats,
                seed=ns.workload_seed,
            )  # fmt: skip
            point["others_cpu_share"] = others_cpu_share(cpu_before, cpu_counters())
            points.append(point)
            _print_point(point)
    return {
        "context_lens": list(ns.context_lens),
        "block_sizes": list(ns.block_sizes),
        "repeats": ns.repeats,
        "swap_repeats": ns.swap_repeats,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "copies": copies_note(engine.device),
        "points": points,
        "summary": {str(c): recovery_summary(points, c) for c in ns.context_lens},
        "paper": {"setup": PAPER_SETUP, "finding": PAPER_FINDING},
    }


def copies_note(device) -> str:
    if device.type == "cpu":
        return (
            "the KV pool is in host memory on this machine, so swap out and swap in are "
            "RAM-to-RAM copies (one batched gather + scatter per direction), not PCIe transfers"
        )
    return "swap copies go between device memory and pinned host memory"


def recovery_summary(points: list[dict[str, Any]], context_len: int) -> dict[str, Any]:
    rows = [p for p in points if p["context_len"] == context_len]
    return {
        "swap_cheaper_at": [p["block_size"] for p in rows if p["swap_ms"] < p["recompute_ms"]],
        "recompute_cheaper_at": [
            p["block_size"] for p in rows if p["recompute_ms"] <= p["swap_ms"]
        ],
        "swap_ms_range": [min(p["swap_ms"] for p in rows), max(p["swap_ms"] for p in rows)],
        "recompute_ms_range": [
            min(p["recompute_ms"] for p in rows),
            max(p["recompute_ms"] for p in rows),
        ],
    }


def _print_point(p: dict[str, Any]) -> None:
    others = p.get("others_cpu_share")
    busy = f" (other processes: {others:.0%} of the CPU)" if others and others > 0.1 else ""
    check = "" if p["swap_round_trip_exact"] else "; SWAP ROUND TRIP CHANGED THE K/V: a bug"
    print(
        f"[recovery context {p['context_len']}, block size {p['block_size']}] "
        f"{p['num_blocks']} blocks: swap out {p['swap_out_ms']:.3f} ms + in "
        f"{p['swap_in_ms']:.3f} ms = {p['swap_ms']:.3f} ms (block tables "
        f"{p['swap_bookkeeping_ms']:.3f} ms), recompute {p['recompute_ms']:.1f} ms{busy}{check}",
        flush=True,
    )


def format_recovery_table(points: list[dict[str, Any]], context_len: int) -> str:
    rows = [
        ("block size", "blocks", "swap out (ms)", "swap in (ms)", "swap out+in (ms)", "GB/s",
         "block tables (ms)", "recompute (ms)", "recompute / swap"),
    ]  # fmt: skip
    for p in points:
        if p["context_len"] != context_len:
            continue
        rows.append(
            (
                str(p["block_size"]),
                str(p["num_blocks"]),
                f"{p['swap_out_ms']:.3f}",
                f"{p['swap_in_ms']:.3f}",
                f"{p['swap_ms']:.3f}",
                f"{p['swap_gb_per_s']:.1f}",
                f"{p['swap_bookkeeping_ms']:.3f}",
                f"{p['recompute_ms']:.1f}",
                f"{p['recompute_over_swap']:.1f}x",
            )
        )
    return _table(rows)


def _table(rows: list[tuple[str, ...]], left: int = 1) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        cells = [c.ljust(w) for c, w in zip(row[:left], widths[:left], strict=True)]
        cells += [c.rjust(w) for c, w in zip(row[left:], widths[left:], strict=True)]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _print_recovery(recovery: dict[str, Any]) -> None:
    for context_len in recovery["context_lens"]:
        kv_bytes = next(
            p["bytes_swapped"] for p in recovery["points"] if p["context_len"] == context_len
        )
        print()
        print(
            f"recovery of one preempted group of {context_len} tokens (~{kv_bytes / 2**20:.1f} "
            f"MiB of K/V; {recovery['device']}, {recovery['dtype']}; medians of "
            f"{recovery['swap_repeats']} swap round trips and {recovery['repeats']} "
            "recomputations; GB/s = both directions' bytes / swap out+in; block tables = the "
            "scheduler-side bookkeeping of both swaps):"
        )
        print(format_recovery_table(recovery["points"], context_len))
        s = recovery["summary"][str(context_len)]
        print(
            f"here: swap out+in {s['swap_ms_range'][0]:.3f}-{s['swap_ms_range'][1]:.3f} ms, "
            f"recompute {s['recompute_ms_range'][0]:.1f}-{s['recompute_ms_range'][1]:.1f} ms; "
            f"swap cheaper at block sizes {s['swap_cheaper_at'] or 'none'}, recompute at "
            f"{s['recompute_cheaper_at'] or 'none'}"
        )
    print(f"note: {recovery['copies']}; recompute is a prefill on the same device.")
    print(f"paper, for context only (a GPU, PCIe copies, another model): {PAPER_FINDING}")
    print(f"  ({PAPER_SETUP})")


# -- part 2: throughput as the pool shrinks -----------------------------------------------------
def run_pool(engine, requests: list[WorkloadRequest]) -> dict[str, Any]:
    """Warm up (one tiny request; the prefix cache emptied after it), queue every request, step
    the engine until all finish; speed, preemption and swap counters of the run."""
    engine.add_request("bench-warm-up", {"prompt_token_ids": requests[0][0][:8]}, _greedy_params(4))
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
                f"bench-{i}", {"prompt_token_ids": prompt}, _greedy_params(output_len)
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
    table = _table(rows)
    if any(r["clamped_to_one_request"] for r in runs):
        table += "\n* raised to one request of max_model_len (the engine's minimum pool)"
    return table


# -- the command --------------------------------------------------------------------------------
def _check_args(ns: argparse.Namespace) -> None:
    if ns.repeats < 1 or ns.swap_repeats < 1:
        raise ValueError("--repeats and --swap-repeats must be >= 1")
    if ns.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    if not ns.scale > 0:
        raise ValueError(f"--scale must be positive, got {ns.scale}")


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    _check_args(ns)
    import torch

    from pagedllm.engine.llm_engine import LLMEngine

    parts = PARTS if ns.part == "all" else (ns.part,)
    defaults = EngineArgs()
    ignored = [f for f in _OVERRIDDEN if getattr(engine_args, f) != getattr(defaults, f)]
    if ignored:
        print(
            f"note: this benchmark sets {', '.join('--' + f.replace('_', '-') for f in ignored)} "
            "itself; the values given are ignored"
            + (" (--max-model-len still caps the workload)" if "max_model_len" in ignored else ""),
            file=sys.stderr,
        )
    # One engine with a token-sized pool, for the model (recovery part) and its tokenizer.
    base_args = dataclasses.replace(
        engine_args, max_model_len=16, num_gpu_blocks_override=cdiv(16, engine_args.block_size),
        kv_cache_memory=None, preemption_mode="recompute", enable_prefix_caching=False,
    )  # fmt: skip
    t0 = time.perf_counter()
    base = LLMEngine(base_args)
    print(
        f"model: {base.model_name}, loaded in {time.perf_counter() - t0:.1f} s; {base.device}, "
        f"{str(base.dtype).removeprefix('torch.')}; torch threads: {torch.get_num_threads()}",
        flush=True,
    )
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(sys.argv),
        "model": base.model_name,
        "torch_num_threads": torch.get_num_threads(),
        "engine_args": dataclasses.asdict(engine_args),
        "parts": list(parts),
    }
    ok = True
    if "recovery" in parts:
        recovery = run_recovery(base, ns)
        results["recovery"] = recovery
        _print_recovery(recovery)
        exact = all(p["swap_round_trip_exact"] for p in recovery["points"])
        if not exact:
            print("SWAP ROUND TRIPS CHANGED THE K/V: a bug", file=sys.stderr)
        ok = ok and exact
    vocab_size = base.model_config.vocab_size
    tokenizer = base.tokenizer
    if tokenizer is None:  # no tokenizer: every id of the embedding table is fair game
        tokenizer = types.SimpleNamespace(vocab_size=vocab_size, all_special_ids=())
    model_info = {
        "tokenizer": tokenizer,
        "vocab_size": vocab_size,
        "config": base.model_config,
        "dtype": base.dtype,
        "max_position_embeddings": base.model_config.max_position_embeddings,
    }
    del base
    gc.collect()
    if "throughput" in parts:
        if "recovery" in parts:
            print()
        throughput, identical = run_throughput(engine_args, ns, model_info)
        results["throughput"] = throughput
        print()
        print(
            f"throughput as the KV pool shrinks (block size {throughput['block_size']}, "
            f"demand {throughput['demand_blocks']} blocks, prefix caching "
            f"{'on' if throughput['enable_prefix_caching'] else 'off'}):"
        )
        print(format_throughput_table(throughput["runs"]))
        agree = throughput["full_pool_outputs_agree_across_modes"]
        print(
            "greedy outputs: "
            + ("identical in every run" if identical else "NOT identical in every run: a bug")
            + ("" if agree is None else f"; 100% runs of the two modes agree: {agree}")
        )
        ok = ok and identical
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"wrote {ns.output_json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
