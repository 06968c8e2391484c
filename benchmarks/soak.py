"""`python -m benchmarks.soak`: many requests through a real HTTP server, then the leak checks.

The server runs in this process (uvicorn on a thread, the engine on its own), so that after the
load the engine itself can be inspected: failed requests (from the `bench serve` client), then,
once idle, the scheduler's and pool's integrity check, the blocks still held (KV usage must be 0:
blocks kept for the prefix cache count as free), requests left in the engine, and the resident
memory (RSS) and the number of Python objects of the process after a warm-up and after each of
`--rounds` rounds of the requests (4 by default), read once the engine is idle. Meanwhile a
dashboard page's polls of /debug/kv (with the integrity check) run twice a second, from before
the warm-up to the end, and every one must pass.

Before the warm-up the KV pool is made resident (its pages written, every block's object made),
so that the pool's first use is not counted as growth. `--trim-heap` returns the C heap's free
pages (malloc_trim) before each RSS reading; the object types that grew most from the warm-up to
the end are printed; `--max-rss-growth PCT` fails the run when RSS grew more than PCT percent
from the warm-up to the end.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import math
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from benchmarks import common
from pagedllm.bench.utils import free_port
from pagedllm.config import EngineArgs


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/<pid>/status")


@contextlib.contextmanager
def serve_in_thread(async_engine, served_model_name: str, **options) -> Iterator[str]:
    """A real uvicorn server on a free loopback port, on a thread; yields its base URL. Leaving
    the block stops the server (not the engine). `options`: other ServerConfig fields."""
    import httpx
    import uvicorn

    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.connections import uvicorn_config
    from pagedllm.entrypoints.openai.server_config import ServerConfig

    server_config = ServerConfig(served_model_name, **options)
    app = build_app(async_engine, server_config)
    port = free_port()
    config = uvicorn_config(app, server_config, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="pagedllm-http", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if not thread.is_alive() or time.time() > deadline:
            raise RuntimeError("the in-process server did not come up")
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def _num_objects() -> int:
    """Objects the garbage collector tracks, after a collection: leaked Python state grows it,
    native allocator churn does not."""
    gc.collect()
    return len(gc.get_objects())


def _type_name(obj: object) -> str:
    kind = type(obj)
    module = getattr(kind, "__module__", None)
    name = getattr(kind, "__qualname__", kind.__name__)
    return name if module in (None, "builtins") else f"{module}.{name}"


def object_types() -> collections.Counter[str]:
    """The objects the garbage collector tracks, counted by type, after a collection."""
    gc.collect()
    return collections.Counter(_type_name(obj) for obj in gc.get_objects())


def type_growth(before: collections.Counter[str], after: collections.Counter[str],
                top: int = 15) -> list[tuple[str, int]]:  # fmt: skip
    """The `top` types whose instance counts grew most from `before` to `after` (grown only)."""
    grown = [(name, after[name] - before.get(name, 0)) for name in after]
    grown = [(name, delta) for name, delta in grown if delta > 0]
    return sorted(grown, key=lambda item: (-item[1], item[0]))[:top]


def make_pool_resident(engine) -> int:
    """Touch every page of the engine's KV pool (and swap space, and a draft model's pool) and
    make every block's object, before any request: the pool is allocated uninitialized and the
    block pool makes a block's object the first time it hands it out, so otherwise both grow
    the process as the load first spreads over the blocks. Writes zeros, which no kernel reads
    (a slot is written before it is read): only safe while the engine holds no request.
    Returns the bytes written. Reaches into the engine's internals (this is a benchmark)."""
    import torch

    kv_manager = engine.scheduler.kv_cache_manager
    for name in ("block_pool", "cpu_block_pool"):
        block_pool = getattr(kv_manager, name, None)
        if block_pool is not None and hasattr(block_pool, "blocks"):
            block_pool.blocks  # noqa: B018 - makes the never-used blocks' objects
    runner = engine.executor.driver_worker.model_runner
    draft = getattr(getattr(runner, "proposer", None), "runner", None)
    tensors = []
    for kv_cache in (runner.kv_cache, getattr(draft, "kv_cache", None)):
        if kv_cache is not None:
            tensors += [kv_cache.pool, kv_cache.swap_pool]
    written = 0
    with torch.no_grad():
        for tensor in tensors:
            # Writes: reading a page never written maps the shared zero page, not counted in RSS.
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                tensor.zero_()
                written += tensor.numel() * tensor.element_size()
    return written


class MemoryReadings:
    """RSS and Python objects after the warm-up and after each round, read with the engine idle.
    With `trim_heap`, `pagedllm.heap.trim_heap()` (malloc_trim) runs before each RSS reading, so
    that free pages the C heap still holds are not counted; the RSS before it is kept too."""

    def __init__(self, trim_heap: bool) -> None:
        self.trim_heap = trim_heap
        self.rss: list[int] = []
        self.rss_untrimmed: list[int] = []
        self.objects: list[int] = []

    def read(self) -> None:
        self.objects.append(_num_objects())
        self.rss_untrimmed.append(rss_bytes())
        if self.trim_heap:
            from pagedllm.heap import trim_heap

            trim_heap()
        self.rss.append(rss_bytes())

    @property
    def growth_pct(self) -> float:
        return 100.0 * (self.rss[-1] - self.rss[0]) / self.rss[0]


def wait_idle(engine, timeout: float = 120.0) -> bool:
    """Wait until the engine holds no request (aborts are applied between steps)."""
    deadline = time.time() + timeout
    while engine.has_unfinished_requests() and time.time() < deadline:
        time.sleep(0.05)
    return not engine.has_unfinished_requests()


class DashboardPoller:
    """An open dashboard page during the load: polls /debug/kv with the integrity check every
    `interval` seconds on a thread, and counts the polls that failed or whose snapshot did not
    pass the check or add up (free + cached + used == total)."""

    def __init__(self, url: str, interval: float = 0.5) -> None:
        self.url = f"{url}/debug/kv?check=true"
        self.interval = interval
        self.num_polls = 0
        self.bad: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dashboard-poller", daemon=True)

    def __enter__(self) -> DashboardPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=60) as http:
            while True:
                self.num_polls += 1
                try:
                    response = http.get(self.url)
                    response.raise_for_status()
                    snap = response.json()
                    pool = snap["pool"]
                    counts = pool["counts"]
                    if not snap["integrity"]["ok"]:
                        self.bad.append(snap["integrity"]["error"])
                    elif counts["free"] + counts["cached"] + counts["used"] != pool["num_blocks"]:
                        self.bad.append(f"counts {counts} do not add up to {pool['num_blocks']}")
                except Exception as e:  # noqa: BLE001 - counted and reported
                    self.bad.append(repr(e))
                if self._stop.wait(self.interval):
                    return


def leak_report(async_engine) -> dict[str, Any]:
    """After the load, with the engine idle: what it still holds. Call from any thread once no
    request is in flight (the loop then only waits for commands)."""
    engine = async_engine.engine
    idle = wait_idle(engine)
    kv = engine.scheduler.kv_cache_manager
    integrity = "ok"
    try:
        engine.scheduler.check_integrity()
    except AssertionError as e:
        integrity = f"failed: {e}"
    return {
        "idle": idle,
        "integrity": integrity,
        "unfinished_requests": engine.get_num_unfinished_requests(),
        "open_streams": len(async_engine._streams),
        "leaked_blocks": engine.num_blocks - kv.num_free_blocks,
        "num_blocks": engine.num_blocks,
        "kv_cache_usage": kv.usage,
        "num_preemptions_total": engine.get_stats()["num_preemptions_total"],
    }


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
                       help="malloc_trim(0) before each RSS reading, so that free pages the C "
                            "heap keeps are not counted")  # fmt: skip
    group.add_argument("--no-resident-pool", dest="resident_pool", action="store_false",
                       help="do not make the KV pool resident before the warm-up (its first "
                            "use then counts as growth)")  # fmt: skip
    group.add_argument("--max-rss-growth", type=float, default=None, metavar="PCT",
                       help="exit 1 when RSS grew more than PCT percent from the warm-up to "
                            "the end (default: no limit)")  # fmt: skip
    group.add_argument("--top-types", type=int, default=15,
                       help="object types printed, those grown most (default: 15)")  # fmt: skip
    group.add_argument("--result-json", default=None, help="also write the results here")


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    from pagedllm.bench.serve import format_summary, run_benchmark
    from pagedllm.bench.workload import workload_from_tokenizer
    from pagedllm.engine.async_llm_engine import AsyncLLMEngine
    from pagedllm.engine.llm_engine import LLMEngine

    if ns.num_prompts < 1 or ns.max_concurrency < 1 or ns.warmup_prompts < 0:
        raise ValueError("--num-prompts and --max-concurrency must be >= 1, --warmup-prompts >= 0")
    if not 1 <= ns.rounds <= ns.num_prompts:
        raise ValueError("--rounds must be between 1 and --num-prompts")
    if ns.max_rss_growth is not None and ns.max_rss_growth < 0:
        raise ValueError("--max-rss-growth must be >= 0")
    engine = LLMEngine(engine_args)
    if engine.tokenizer is None:
        raise ValueError("the soak's workload needs a model with a tokenizer")
    resident_bytes = make_pool_resident(engine) if ns.resident_pool else 0
    async_engine = AsyncLLMEngine(engine)
    name = "soak"
    workload = workload_from_tokenizer(
        ns.num_prompts + ns.warmup_prompts, engine.tokenizer, scale=ns.scale,
        seed=ns.workload_seed, max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
    )  # fmt: skip
    warmup, requests = workload[: ns.warmup_prompts], workload[ns.warmup_prompts :]
    memory = MemoryReadings(ns.trim_heap)
    started = time.perf_counter()
    try:
        with serve_in_thread(async_engine, name) as url, DashboardPoller(url) as dashboard:
            # The dashboard polls from before the warm-up: its own state is in the baseline.
            if warmup:
                asyncio.run(run_benchmark(url, warmup, name, math.inf, ns.max_concurrency))
            wait_idle(engine)
            memory.read()
            types_start = object_types()
            print(f"{len(requests)} requests in {ns.rounds} rounds, "
                  f"concurrency {ns.max_concurrency}, at {url}", flush=True)  # fmt: skip
            # RSS read after each round: a leak grows round after round.
            bounds = [len(requests) * k // ns.rounds for k in range(ns.rounds + 1)]
            parts = []
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                run = run_benchmark(url, requests[lo:hi], name, math.inf, ns.max_concurrency)
                parts.append(asyncio.run(run))
                wait_idle(engine)
                memory.read()
                print(f"round {len(parts)}/{ns.rounds}: {hi} requests, "
                      f"RSS {memory.rss[-1] / 2**20:.1f} MiB, {memory.objects[-1]} objects, "
                      f"{time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
            types_end = object_types()
            leaks = leak_report(async_engine)
    finally:
        async_engine.shutdown()
    mib = 1024 * 1024
    summary = merge_summaries(parts)
    rss = memory.rss
    half = ns.rounds // 2  # the reading after the first half of the rounds
    grown_types = type_growth(types_start, types_end, ns.top_types)
    result = {
        **summary, **leaks, "rounds": ns.rounds, "trim_heap": ns.trim_heap,
        "resident_pool_bytes": resident_bytes,
        "rss_start_mib": rss[0] / mib, "rss_end_mib": rss[-1] / mib,
        "rss_growth_mib": (rss[-1] - rss[0]) / mib, "rss_growth_pct": memory.growth_pct,
        "rss_second_half_growth_mib": (rss[-1] - rss[half]) / mib,
        "rss_after_rounds_mib": [r / mib for r in rss],
        "rss_before_trim_after_rounds_mib": [r / mib for r in memory.rss_untrimmed],
        "python_objects_after_rounds": memory.objects,
        "python_objects_growth": memory.objects[-1] - memory.objects[0],
        "object_types_grown": dict(grown_types),
        "dashboard_polls": dashboard.num_polls,
        "dashboard_bad_polls": len(dashboard.bad), "dashboard_errors": dashboard.bad[:5],
        "max_rss_growth_pct": ns.max_rss_growth,
    }  # fmt: skip
    print(format_summary(summary))
    print("(counts and throughput: all rounds; latencies: the last round)")
    for error in summary["errors"] + result["dashboard_errors"]:
        print(f"error: {error}")
    print(f"{'-' * 15}Leak checks{'-' * 15}")
    for key in ("idle", "integrity", "unfinished_requests", "open_streams", "leaked_blocks",
                "num_blocks", "num_preemptions_total", "dashboard_polls",
                "dashboard_bad_polls"):  # fmt: skip
        print(f"{key + ':':<40}{result[key]!s:>12}")
    print(f"{'-' * 15}Memory{'-' * 15}")
    print(f"{'KV pool made resident (MiB):':<40}{resident_bytes / mib:>12.1f}")
    for key in ("rss_start_mib", "rss_end_mib", "rss_growth_mib", "rss_growth_pct",
                "rss_second_half_growth_mib"):  # fmt: skip
        print(f"{key + ':':<40}{result[key]:>12.2f}")
    trimmed = " (after malloc_trim)" if ns.trim_heap else ""
    print(f"RSS after warm-up, then each round{trimmed} (MiB):")
    print("  " + " ".join(f"{r:.1f}" for r in result["rss_after_rounds_mib"]))
    if ns.trim_heap:
        print("RSS, same points, before malloc_trim (MiB):")
        print("  " + " ".join(f"{r:.1f}" for r in result["rss_before_trim_after_rounds_mib"]))
    print("Python objects after warm-up, then each round:")
    print("  " + " ".join(str(n) for n in memory.objects))
    print(f"Object types grown most from the warm-up to the end (of {len(types_end)} types):")
    for type_name, delta in grown_types or [("(none grew)", 0)]:
        print(f"  {delta:>+8} {type_name}")
    if ns.result_json:
        with open(ns.result_json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), **result}, f, indent=2,
                      default=str)  # fmt: skip
    clean = (
        summary["failed"] == 0 and leaks["integrity"] == "ok" and leaks["leaked_blocks"] == 0
        and leaks["unfinished_requests"] == 0 and leaks["open_streams"] == 0
        and result["dashboard_bad_polls"] == 0
    )  # fmt: skip
    if ns.max_rss_growth is not None:
        within = memory.growth_pct <= ns.max_rss_growth
        verdict = "within" if within else "FAILED: above"
        print(f"RSS growth {memory.growth_pct:+.2f}% from the warm-up to the end: {verdict} "
              f"--max-rss-growth {ns.max_rss_growth:g}%")  # fmt: skip
        clean = clean and within
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
