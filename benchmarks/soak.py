"""`python -m benchmarks.soak`: many requests through a real HTTP server, then the leak checks.

The server runs in this process (uvicorn on a thread), the `bench serve` client in a spawned
process of its own, and, by default, the engine in its own process, as `pagedllm serve` runs it
(engine/core_client.py; `--no-engine-process`: the engine in this process too, its loop on a
thread). After the load the engine itself is inspected (in its process, through the calls of
engine/diagnostics.py): failed requests (from the `bench serve` client), then, once idle, the
scheduler's and pool's integrity check, the blocks still held (KV usage must be 0: blocks kept
for the prefix cache count as free), requests left in the engine, and the resident memory (RSS)
and the number of Python objects of each process (the server's and the engine's, or the one)
after a warm-up and after each of `--rounds` rounds of the requests (4 by default), read once
the engine is idle. Meanwhile a dashboard page's polls of /debug/kv (with the integrity check)
run twice a second, from before the warm-up to the end, and every one must pass. An engine
process restarted during the soak fails it (its readings are another process's).

Before the warm-up the KV pool is made resident (its pages written, every block's object made),
so that the pool's first use is not counted as growth. `--trim-heap` returns the C heap's free
pages (malloc_trim), in each process, before each RSS reading; the object types that grew most
from the warm-up to the end are printed; `--max-rss-growth PCT` fails the run when RSS grew more
than PCT percent from the warm-up to the end (in either process).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import math
import multiprocessing
import sys
import time
from typing import Any

from benchmarks import common
from benchmarks.soak_targets import (
    DashboardPoller,
    EngineProcess,
    InProcessEngine,
    serve_in_thread,
)
from pagedllm.config import EngineArgs


def type_growth(before: collections.Counter[str], after: collections.Counter[str],
                top: int = 15) -> list[tuple[str, int]]:  # fmt: skip
    """The `top` types whose instance counts grew most from `before` to `after` (grown only)."""
    grown = [(name, after[name] - before.get(name, 0)) for name in after]
    grown = [(name, delta) for name, delta in grown if delta > 0]
    return sorted(grown, key=lambda item: (-item[1], item[0]))[:top]


def rss_fields(rss: list[int], half: int) -> dict[str, float]:
    """A series of RSS readings (the warm-up's, then each round's): start, end, growth."""
    mib = 2**20
    return {
        "rss_start_mib": rss[0] / mib, "rss_end_mib": rss[-1] / mib,
        "rss_growth_mib": (rss[-1] - rss[0]) / mib,
        "rss_growth_pct": 100.0 * (rss[-1] - rss[0]) / rss[0],
        "rss_second_half_growth_mib": (rss[-1] - rss[half]) / mib,
    }  # fmt: skip


class ProcessMemory:
    """One process's memory after the warm-up and after each round, read with the engine idle:
    engine/diagnostics.py's memory_report (RSS after the trim with `--trim-heap`, and before it;
    the objects the garbage collector tracks; by type, at the first and the last reading)."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self.rss: list[int] = []
        self.rss_untrimmed: list[int] = []
        self.objects: list[int] = []
        self.types: list[collections.Counter[str]] = []

    def add(self, report: dict[str, Any]) -> None:
        self.pids.append(report["pid"])
        self.objects.append(report["num_objects"])
        self.rss_untrimmed.append(report["rss_before_trim_bytes"])
        self.rss.append(report["rss_bytes"])
        if "object_types" in report:
            self.types.append(collections.Counter(report["object_types"]))

    @property
    def growth_pct(self) -> float:
        return 100.0 * (self.rss[-1] - self.rss[0]) / self.rss[0]

    def fields(self, half: int, top: int) -> dict[str, Any]:
        """The JSON fields of its readings (`half`: the reading after the first half)."""
        mib = 2**20
        return {
            **rss_fields(self.rss, half),
            "rss_after_rounds_mib": [r / mib for r in self.rss],
            "rss_before_trim_after_rounds_mib": [r / mib for r in self.rss_untrimmed],
            "python_objects_after_rounds": self.objects,
            "python_objects_growth": self.objects[-1] - self.objects[0],
            "object_types_grown": dict(type_growth(self.types[0], self.types[-1], top)),
        }


def _run_load(url: str, requests: list, name: str, max_concurrency: int) -> dict[str, Any]:
    from pagedllm.bench.serve import run_benchmark

    return asyncio.run(run_benchmark(url, requests, name, math.inf, max_concurrency))


class LoadClient:
    """The `bench serve` client in a spawned process of its own, used for every round: the
    server's process then holds the server (and the dashboard poller's thread), and its RSS
    readings are not the client's."""

    def __enter__(self) -> LoadClient:
        context = multiprocessing.get_context("spawn")
        self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=context)
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(cancel_futures=True)

    def run(self, url: str, requests: list, name: str, max_concurrency: int) -> dict[str, Any]:
        """One round's requests; its `bench serve` summary."""
        return self._pool.submit(_run_load, url, requests, name, max_concurrency).result()


def merge_summaries(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' counts added up; the latency figures are those of the last round."""
    merged = dict(parts[-1])
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens", "duration_s"):
        merged[key] = sum(p[key] for p in parts)
    duration = merged["duration_s"]
    merged["request_throughput"] = merged["completed"] / duration if duration else 0.0
    merged["output_throughput"] = merged["total_output_tokens"] / duration if duration else 0.0
    total = merged["total_input_tokens"] + merged["total_output_tokens"]
    merged["total_token_throughput"] = total / duration if duration else 0.0
    merged["errors"] = sorted({e for p in parts for e in p["errors"]})[:5]
    return merged


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("soak")
    group.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                       help="run the engine in its own process, as `pagedllm serve` does, and "
                            "read both processes' memory (default); --no-engine-process: the "
                            "engine in this process, its loop on a thread")  # fmt: skip
    group.add_argument("--num-prompts", type=int, default=1000,
                       help="requests after the warm-up, all rounds (default: 1000)")  # fmt: skip
    group.add_argument("--rounds", type=int, default=4,
                       help="the requests are sent in this many rounds, RSS and the Python "
                            "objects read after each, once idle (default: 4)")  # fmt: skip
    group.add_argument("--max-concurrency", type=int, default=64,
                       help="most requests in flight (default: 64)")  # fmt: skip
    group.add_argument("--warmup-prompts", type=int, default=64,
                       help="requests before the first RSS reading (default: 64)")  # fmt: skip
    group.add_argument("--scale", type=float, default=0.1,
                       help="ShareGPT length scale (default: 0.1)")  # fmt: skip
    group.add_argument("--workload-seed", type=int, default=0, help="workload seed (default: 0)")
    group.add_argument("--trim-heap", action="store_true",
                       help="malloc_trim(0) before each RSS reading (in each process), so that "
                            "free pages the C heap keeps are not counted")  # fmt: skip
    group.add_argument("--no-resident-pool", dest="resident_pool", action="store_false",
                       help="do not make the KV pool resident before the warm-up (its first "
                            "use then counts as growth)")  # fmt: skip
    group.add_argument("--max-rss-growth", type=float, default=None, metavar="PCT",
                       help="exit 1 when RSS grew more than PCT percent from the warm-up to "
                            "the end, in either process (default: no limit)")  # fmt: skip
    group.add_argument("--top-types", type=int, default=15,
                       help="object types printed, those grown most (default: 15)")  # fmt: skip
    group.add_argument("--result-json", default=None, help="also write the results here")


def rss_verdict(growth_pct: dict[str, float], limit: float) -> tuple[bool, str]:
    """Whether each process's RSS growth (percent, by process name; "" for the one process of
    --no-engine-process) is within `limit` percent, and the line that says so."""
    over = [name for name, pct in growth_pct.items() if pct > limit]
    if list(growth_pct) == [""]:
        verdict = "FAILED: above" if over else "within"
        return not over, (f"RSS growth {growth_pct['']:+.2f}% from the warm-up to the end: "
                          f"{verdict} --max-rss-growth {limit:g}%")  # fmt: skip
    growths = ", ".join(f"{name} {pct:+.2f}%" for name, pct in growth_pct.items())
    verdict = f"FAILED: {' and '.join(over)} above" if over else "within"
    return not over, (f"RSS growth from the warm-up to the end: {growths}: {verdict} "
                      f"--max-rss-growth {limit:g}% (each process)")  # fmt: skip


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    if ns.num_prompts < 1 or ns.max_concurrency < 1 or ns.warmup_prompts < 0:
        raise ValueError("--num-prompts and --max-concurrency must be >= 1, --warmup-prompts >= 0")
    if not 1 <= ns.rounds <= ns.num_prompts:
        raise ValueError("--rounds must be between 1 and --num-prompts")
    if ns.max_rss_growth is not None and ns.max_rss_growth < 0:
        raise ValueError("--max-rss-growth must be >= 0")
    target = EngineProcess(engine_args) if ns.engine_process else InProcessEngine(engine_args)
    try:
        if target.info.tokenizer is None:
            raise ValueError("the soak's workload needs a model with a tokenizer")
        resident_bytes = target.start(ns.resident_pool)
        parts, memory, leaks, dashboard = _load(ns, target)
        restarts = target.restarts()
    finally:
        target.shutdown()
    return _report(ns, parts, memory, leaks, dashboard, resident_bytes, restarts)


def _load(ns: argparse.Namespace, target):
    """The warm-up, then the rounds, memory read after each; the leak checks at the end."""
    from pagedllm.bench.workload import workload_from_tokenizer

    info = target.info
    name = "soak"
    workload = workload_from_tokenizer(
        ns.num_prompts + ns.warmup_prompts, info.tokenizer, scale=ns.scale,
        seed=ns.workload_seed, max_model_len=info.max_model_len,
        vocab_size=info.model_config.vocab_size,
    )  # fmt: skip
    warmup, requests = workload[: ns.warmup_prompts], workload[ns.warmup_prompts :]
    memory = {process: ProcessMemory() for process in target.processes}

    def read(by_type: bool) -> str:
        for process, report in target.read_memory(ns.trim_heap, by_type).items():
            memory[process].add(report)
        mib = 2**20
        if list(memory) == [""]:
            return f"RSS {memory[''].rss[-1] / mib:.1f} MiB, {memory[''].objects[-1]} objects"
        line = "RSS " + ", ".join(f"{process} {m.rss[-1] / mib:.1f} MiB ({m.objects[-1]} objects)"
                                  for process, m in memory.items())  # fmt: skip
        pids = memory["engine"].pids
        if len(pids) > 1 and pids[-1] != pids[-2]:
            line += f", the engine process RESTARTED (pid {pids[-2]} -> {pids[-1]})"
        return line

    started = time.perf_counter()
    with (
        serve_in_thread(target.async_engine, name) as url,
        DashboardPoller(url) as dashboard,
        LoadClient() as client,
    ):
        # The dashboard polls from before the warm-up: its own state is in the baseline.
        if warmup:
            client.run(url, warmup, name, ns.max_concurrency)
        target.wait_idle()
        read(by_type=True)
        print(f"{len(requests)} requests in {ns.rounds} rounds, "
              f"concurrency {ns.max_concurrency}, at {url}", flush=True)  # fmt: skip
        # RSS read after each round: a leak grows round after round.
        bounds = [len(requests) * k // ns.rounds for k in range(ns.rounds + 1)]
        parts = []
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            parts.append(client.run(url, requests[lo:hi], name, ns.max_concurrency))
            target.wait_idle()
            line = read(by_type=len(parts) == ns.rounds)
            print(f"round {len(parts)}/{ns.rounds}: {hi} requests, {line}, "
                  f"{time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
        leaks = target.leak_report()
    return parts, memory, leaks, dashboard


def _report(ns, parts, memory, leaks, dashboard, resident_bytes, restarts) -> int:
    """Print the results (and write them as JSON); the exit status."""
    from pagedllm.bench.serve import format_summary

    mib = 1024 * 1024
    summary = merge_summaries(parts)
    half = ns.rounds // 2  # the reading after the first half of the rounds
    one = list(memory) == [""]
    result = {
        **summary, **leaks, "rounds": ns.rounds, "trim_heap": ns.trim_heap,
        "engine_process": ns.engine_process, "resident_pool_bytes": resident_bytes,
    }  # fmt: skip
    if one:
        result.update(memory[""].fields(half, ns.top_types))
    else:
        for process, m in memory.items():
            result.update({f"{process}_{k}": v for k, v in m.fields(half, ns.top_types).items()})
        total = [sum(rss) for rss in zip(*(m.rss for m in memory.values()), strict=True)]
        result.update({f"total_{k}": v for k, v in rss_fields(total, half).items()})
        result["total_rss_after_rounds_mib"] = [r / mib for r in total]
        result["engine_pids"] = list(dict.fromkeys(memory["engine"].pids))
        result["engine_restarts"] = restarts
    result.update({
        "dashboard_polls": dashboard.num_polls,
        "dashboard_bad_polls": len(dashboard.bad), "dashboard_errors": dashboard.bad[:5],
        "max_rss_growth_pct": ns.max_rss_growth,
    })  # fmt: skip
    print(format_summary(summary))
    print("(counts and throughput: all rounds; latencies: the last round)")
    for error in summary["errors"] + result["dashboard_errors"]:
        print(f"error: {error}")
    print(f"{'-' * 15}Leak checks{'-' * 15}")
    keys = ["idle", "integrity", "unfinished_requests", "open_streams", "leaked_blocks",
            "num_blocks", "num_preemptions_total", "dashboard_polls",
            "dashboard_bad_polls"]  # fmt: skip
    if not one:
        keys[3:3] = ["compiling_requests"]
        keys.append("engine_restarts")
    for key in keys:
        print(f"{key + ':':<40}{result[key]!s:>12}")
    print(f"{'-' * 15}Memory{'-' * 15}")
    print(f"{'KV pool made resident (MiB):':<40}{resident_bytes / mib:>12.1f}")
    scalars = ("rss_start_mib", "rss_end_mib", "rss_growth_mib", "rss_growth_pct",
               "rss_second_half_growth_mib")  # fmt: skip
    trimmed = " (after malloc_trim)" if ns.trim_heap else ""
    # One column per process, and their total; the one process of --no-engine-process has
    # unprefixed fields and no header.
    columns = [""] if one else [*memory, "total"]

    def field(column: str, key: str):
        return result[f"{column}_{key}" if column else key]

    def row(column: str) -> str:
        return f"  {column:<8}" if column else "  "

    def series(title: str, key: str, names) -> None:
        print(title)
        for c in names:
            print(row(c) + " ".join(f"{r:.1f}" for r in field(c, key)))

    if not one:
        print(f"{'':<40}" + "".join(f"{c:>12}" for c in columns))
    for key in scalars:
        print(f"{key + ':':<40}" + "".join(f"{field(c, key):>12.2f}" for c in columns))
    if not one:
        print(f"engine process pids: {', '.join(map(str, result['engine_pids']))}")
    series(f"RSS after warm-up, then each round{trimmed} (MiB):", "rss_after_rounds_mib", columns)
    if ns.trim_heap:
        series("RSS, same points, before malloc_trim (MiB):", "rss_before_trim_after_rounds_mib",
               memory)  # fmt: skip
    print("Python objects after warm-up, then each round:")
    for process, m in memory.items():
        print(row(process) + " ".join(str(n) for n in m.objects))
    for process, m in memory.items():
        which = f", {process} process" if process else ""
        grown = type_growth(m.types[0], m.types[-1], ns.top_types)
        print(f"Object types grown most from the warm-up to the end{which} "
              f"(of {len(m.types[-1])} types):")  # fmt: skip
        for type_name, delta in grown or [("(none grew)", 0)]:
            print(f"  {delta:>+8} {type_name}")
    if ns.result_json:
        with open(ns.result_json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), **result}, f, indent=2,
                      default=str)  # fmt: skip
    clean = (
        summary["failed"] == 0 and leaks["integrity"] == "ok" and leaks["leaked_blocks"] == 0
        and leaks["unfinished_requests"] == 0 and leaks["open_streams"] == 0
        and leaks.get("compiling_requests", 0) == 0 and result["dashboard_bad_polls"] == 0
    )  # fmt: skip
    if not one and (restarts or len(result["engine_pids"]) > 1):
        print(f"FAILED: the engine process restarted {restarts} times during the soak (pids "
              f"{', '.join(map(str, result['engine_pids']))}): a soak should have none, and "
              "its readings are not one process's")  # fmt: skip
        clean = False
    if ns.max_rss_growth is not None:
        within, line = rss_verdict({p: m.growth_pct for p, m in memory.items()}, ns.max_rss_growth)
        print(line)
        clean = clean and within
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
