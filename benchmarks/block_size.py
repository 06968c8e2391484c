"""`python -m benchmarks.block_size`: normalized latency of the paged engine by block size (the
PagedAttention paper's Fig. 18a).

The requests, arrivals and virtual clock are load.py's, on the paged policy, at one
request rate per workload. Each block size gets its own KV pool of the same bytes (the pool's
shape depends on the block size), block manager and scheduler; the model is loaded once. Small
blocks cost more block-table work per token; large ones waste the tail of each request's last
block (internal fragmentation) and so batch fewer requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

from benchmarks import common, load
from pagedllm.bench.utils import cpu_counters, others_cpu_share, table_lines
from pagedllm.config import EngineArgs, parse_bytes

DEFAULT_BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
DEFAULT_RATE = {"sharegpt": 1.5, "alpaca": 3.0}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument("--block-sizes", type=common.int_list, default=DEFAULT_BLOCK_SIZES,
                       help="block sizes, comma-separated "
                       "(default: 1,2,4,8,16,32,64,128,256)")  # fmt: skip
    for shape, rate in DEFAULT_RATE.items():
        group.add_argument(f"--{shape}-rate", type=float, default=rate,
                           help=f"request rate (req/s) of the {shape} workload "
                           f"(default: {rate:g})")  # fmt: skip
    common.add_workload_args(group)


def with_block_size(engine, block_size: int):
    """A fresh engine for `block_size` on an idle engine's executor: the same model, a KV pool of
    the same bytes rebuilt for the block size (recompute preemption: no swap space)."""
    from pagedllm.engine.llm_engine import LLMEngine

    if engine.has_unfinished_requests():
        raise ValueError("the engine must be idle to change its block size")
    args = dataclasses.replace(engine.args, block_size=block_size)
    return LLMEngine(args, executor=engine.executor)


def run(engine_args: EngineArgs, ns: argparse.Namespace) -> dict[str, Any]:
    from pagedllm.engine.llm_engine import LLMEngine

    if not ns.block_sizes:
        raise ValueError("--block-sizes: give at least one")
    args = load.bench_engine_args(engine_args)
    args.preemption_mode = "recompute"
    t0 = time.perf_counter()
    engine = LLMEngine(args)
    load_s = time.perf_counter() - t0
    workloads = load.make_workloads(engine, ns)
    cpu_before = cpu_counters()
    runs = []
    for block_size in ns.block_sizes:
        engine = with_block_size(engine, block_size)
        load.warm_up(engine)
        for shape, requests in workloads.items():
            rate = getattr(ns, f"{shape}_rate")
            r = load.run_one(engine, "paged", shape, requests, rate, ns.arrival_seed)
            r = {"block_size": block_size, "num_blocks": engine.num_blocks, **r}
            print(f"[block size {block_size}] {load.format_run(r)}", flush=True)
            runs.append(r)
    summary = load.engine_summary(engine)
    for key in ("block_size", "num_blocks", "kv_pool_token_slots", "kv_pool_bytes"):
        summary.pop(key)
    summary["kv_cache_memory_bytes"] = parse_bytes(args.kv_cache_memory)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(sys.argv),
        "engine": summary,
        "engine_args": dataclasses.asdict(args),
        "load_s": load_s,
        "workloads": {s: load.workload_summary(r) for s, r in workloads.items()},
        "arrival_seed": ns.arrival_seed,
        "runs": runs,
        "others_cpu_share": others_cpu_share(cpu_before, cpu_counters()),
    }


def _mib(num_bytes: int | None) -> str:
    return "?" if num_bytes is None else f"{num_bytes / 2**20:.0f} MiB"


def format_table(result: dict[str, Any]) -> str:
    e = result["engine"]
    lines = [
        f"{e['model']} on {e['device']} ({e['dtype']}): paged, KV pool of "
        f"{_mib(e['kv_cache_memory_bytes'])} at every block size (whole blocks), max_model_len "
        f"{e['max_model_len']}, prefix caching off; virtual clock",
        *table_lines(load.table_rows(result["runs"], first="block_size")),
    ]
    others = result.get("others_cpu_share")
    if others is not None:
        note = " (busy machine: latencies are skewed)" if others > 0.1 else ""
        lines.append(f"other processes used {others:.1%} of the CPU{note}")
    return "\n".join(lines)


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    from benchmarks import plots

    if ns.plot:
        plots.pyplot()
    result = run(engine_args, ns)
    print()
    print(format_table(result))
    load.write_outputs(result, ns, plots.plot_block_size)
    ok = all(r["num_finished"] == r["num_requests"] and not r["num_failed"] for r in result["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
