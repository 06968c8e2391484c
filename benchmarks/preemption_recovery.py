"""Part 1 of `benchmarks.preemption`: the recovery time of one preempted sequence, swap vs
recompute, by block size (the PagedAttention paper, SOSP 2023, section 7.3, Fig. 19a).

The model is loaded once; for each block size a `ModelRunner` over it gets its own KV pool and
swap pool, and a `KVCacheManager` the block table of one sequence of `context_len` tokens. Its
swap round trips and its recomputation are timed as the engine's steps run them (see
`benchmarks.preemption`'s docstring for what each one counts).
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import numpy as np

from pagedllm.bench.utils import cpu_counters, median, others_cpu_share, table_lines
from pagedllm.bench.workload import normal_token_ids
from pagedllm.core.kv_cache_spec import cdiv

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


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sequence(context_len: int, vocab: np.ndarray, seed: int):
    """One sequence of `context_len` tokens: a prompt (the first half) and generated tokens."""
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.sequence import Sequence

    rng = np.random.default_rng(seed)
    tokens = vocab[rng.integers(0, vocab.size, size=context_len)].tolist()
    prompt_len = max(1, context_len - context_len // 2)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=context_len)
    seq = Sequence.of(f"preempted-{context_len}", tokens[:prompt_len], params)
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
    """Recovery times of one preempted sequence of `context_len` tokens at `block_size` (see
    `benchmarks.preemption`'s docstring): swap out + in through the runner's batched copies, and
    recompute as the runner's prefill of the whole context. One untimed warm-up of each first."""
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
        "swap_out_ms": _ms(median(out_s)),
        "swap_in_ms": _ms(median(in_s)),
        "swap_ms": _ms(median(round_trips)),
        "swap_bookkeeping_ms": _ms(median(book_s)),
        "recompute_ms": _ms(median(recompute_s)),
        "recompute_bookkeeping_ms": _ms(median(recompute_book_s)),
        "swap_round_trip_exact": bool(exact),
        "recompute_deterministic": len(sampled) == 1,
        "swap_ms_all": [_ms(s) for s in round_trips],
        "recompute_ms_all": [_ms(s) for s in recompute_s],
    }
    result["recompute_over_swap"] = result["recompute_ms"] / result["swap_ms"]
    # Bytes moved each way, and the copies' rate over the round trip (both ways).
    result["bytes_swapped"] = num_pairs[0] * bytes_per_block
    result["swap_gb_per_s"] = 2 * result["bytes_swapped"] / median(round_trips) / 1e9
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
    return "\n".join(table_lines(rows))


def print_recovery(recovery: dict[str, Any]) -> None:
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
