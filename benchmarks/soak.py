"""`python -m benchmarks.soak`: many requests through a real HTTP server, then the leak checks.

The server runs in this process (uvicorn on a thread, the engine on its own), so that after the
load the engine itself can be inspected: failed requests (from the `bench serve` client), then,
once idle, the scheduler's and pool's integrity check, the blocks still held (KV usage must be 0:
blocks kept for the prefix cache count as free), requests left in the engine, and the resident
memory (RSS) and the number of Python objects of the process after a warm-up and after each
quarter of the requests. Meanwhile a dashboard page's polls of /debug/kv (with the integrity
check) run twice a second, and every one must pass.
"""

from __future__ import annotations

import argparse
import asyncio
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
    group.add_argument("--num-prompts", type=int, default=1000, help="requests (default: 1000)")
    group.add_argument("--max-concurrency", type=int, default=64,
                       help="most requests in flight (default: 64)")  # fmt: skip
    group.add_argument("--warmup-prompts", type=int, default=64,
                       help="requests before the first RSS reading (default: 64)")  # fmt: skip
    group.add_argument("--scale", type=float, default=0.1,
                       help="ShareGPT length scale (default: 0.1)")  # fmt: skip
    group.add_argument("--workload-seed", type=int, default=0, help="workload seed (default: 0)")
    group.add_argument("--result-json", default=None, help="also write the results here")


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    from pagedllm.bench.serve import format_summary, run_benchmark
    from pagedllm.bench.workload import workload_from_tokenizer
    from pagedllm.engine.async_llm_engine import AsyncLLMEngine
    from pagedllm.engine.llm_engine import LLMEngine

    if ns.num_prompts < 1 or ns.max_concurrency < 1 or ns.warmup_prompts < 0:
        raise ValueError("--num-prompts and --max-concurrency must be >= 1, --warmup-prompts >= 0")
    engine = LLMEngine(engine_args)
    if engine.tokenizer is None:
        raise ValueError("the soak's workload needs a model with a tokenizer")
    async_engine = AsyncLLMEngine(engine)
    name = "soak"
    workload = workload_from_tokenizer(
        ns.num_prompts + ns.warmup_prompts, engine.tokenizer, scale=ns.scale,
        seed=ns.workload_seed, max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
    )  # fmt: skip
    warmup, requests = workload[: ns.warmup_prompts], workload[ns.warmup_prompts :]
    try:
        with serve_in_thread(async_engine, name) as url:
            if warmup:
                asyncio.run(run_benchmark(url, warmup, name, math.inf, ns.max_concurrency))
            wait_idle(engine)
            rss, objects = [rss_bytes()], [_num_objects()]
            print(f"{len(requests)} requests, concurrency {ns.max_concurrency}, at {url}")
            # In four rounds, RSS read after each: a leak grows round after round.
            bounds = [len(requests) * k // 4 for k in range(5)]
            parts = []
            with DashboardPoller(url) as dashboard:
                for lo, hi in zip(bounds, bounds[1:], strict=False):
                    if hi > lo:
                        run = run_benchmark(
                            url, requests[lo:hi], name, math.inf, ns.max_concurrency
                        )
                        parts.append(asyncio.run(run))
                        wait_idle(engine)
                        rss.append(rss_bytes())
                        objects.append(_num_objects())
            leaks = leak_report(async_engine)
    finally:
        async_engine.shutdown()
    mib = 1024 * 1024
    summary = merge_summaries(parts)
    result = {
        **summary, **leaks, "rss_start_mib": rss[0] / mib, "rss_end_mib": rss[-1] / mib,
        "rss_growth_mib": (rss[-1] - rss[0]) / mib, "rss_after_rounds_mib": [r / mib for r in rss],
        "python_objects_after_rounds": objects, "dashboard_polls": dashboard.num_polls,
        "dashboard_bad_polls": len(dashboard.bad), "dashboard_errors": dashboard.bad[:5],
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
    for key in ("rss_start_mib", "rss_end_mib", "rss_growth_mib"):
        print(f"{key + ':':<40}{result[key]:>12.1f}")
    rounds = " ".join(f"{r:.1f}" for r in result["rss_after_rounds_mib"])
    print(f"{'RSS after warm-up, then each round (MiB):':<40} {rounds}")
    counts = " ".join(str(n) for n in objects)
    print(f"{'Python objects after warm-up, then each round:':<40} {counts}")
    if ns.result_json:
        with open(ns.result_json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), **result}, f, indent=2,
                      default=str)  # fmt: skip
    clean = (
        summary["failed"] == 0 and leaks["integrity"] == "ok" and leaks["leaked_blocks"] == 0
        and leaks["unfinished_requests"] == 0 and leaks["open_streams"] == 0
        and result["dashboard_bad_polls"] == 0
    )  # fmt: skip
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
