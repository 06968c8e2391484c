"""`python -m benchmarks.engine_process`: what running the engine in its own process costs or
gains. `pagedllm serve` as a subprocess, once with the engine in its own process (the default)
and once with `--no-engine-process` (the engine loop on the server's main thread, HTTP on
another), alternating, each driven by `bench serve`'s streaming client at each concurrency;
prints output tokens/s, median TTFT and TPOT, and the ratios process / in-process (median over
the pairs)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.peer_servers import _served_model, counters_with, server_process
from pagedllm.bench.serve import run_benchmark
from pagedllm.bench.utils import free_port, others_cpu_share
from pagedllm.bench.workload import workload_from_tokenizer
from pagedllm.model_loader.loader import load_tokenizer, resolve_model
from pagedllm.procs import child_pids

MODES = {"process": [], "in-process": ["--no-engine-process"]}


def measure(mode: str, ns, requests_by_concurrency, log_dir: Path) -> dict[int, dict]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port),
            "--disable-log-stats", *MODES[mode], *ns.server_args]  # fmt: skip
    results = {}
    with server_process(argv, url, log_dir / f"{mode}.log") as proc:
        model = _served_model(url)
        engine = child_pids(proc.pid)  # the engine process (the server itself is our child)
        for concurrency, requests in requests_by_concurrency.items():
            before = counters_with(engine)
            summary = asyncio.run(run_benchmark(url, requests, model, float("inf"), concurrency))
            # CPU that neither this client nor the server used: another load disturbed the run
            summary["others_cpu_share"] = others_cpu_share(before, counters_with(engine))
            assert summary["failed"] == 0, summary["errors"]
            results[concurrency] = summary
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--server-args", default="--max-model-len 2048 --kv-cache-memory 512MiB")
    ns = parser.parse_args()
    ns.server_args = ns.server_args.split()
    tokenizer = load_tokenizer(resolve_model(None))
    concurrencies = [int(c) for c in ns.concurrency.split(",")]
    requests = {
        c: workload_from_tokenizer(
            ns.num_prompts if c > 1 else 8, tokenizer, scale=0.25, seed=c, max_model_len=2048
        )  # fmt: skip
        for c in concurrencies
    }
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if "model name" in line), "?")
    print(f"CPU: {cpu}; {ns.pairs} pairs, modes alternating; server flags: "
          f"{' '.join(ns.server_args)}")  # fmt: skip
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(ns.pairs):
            order = list(MODES) if pair % 2 == 0 else list(reversed(MODES))
            for mode in order:
                runs[mode].append(measure(mode, ns, requests, Path(tmp)))
    print(f"{'concurrency':>11} {'mode':>10} {'out tok/s':>10} {'TTFT ms':>9} {'TPOT ms':>9}")
    for c in concurrencies:
        medians = {}
        for mode in MODES:
            rows = [r[c] for r in runs[mode]]
            keys = ("output_throughput", "median_ttft_ms", "median_tpot_ms")
            medians[mode] = {k: statistics.median(r[k] for r in rows) for k in keys}
            m = medians[mode]
            print(f"{c:>11} {mode:>10} {m['output_throughput']:>10.1f} "
                  f"{m['median_ttft_ms']:>9.1f} {m['median_tpot_ms']:>9.2f}")  # fmt: skip
        ratio = {k: medians["process"][k] / medians["in-process"][k] for k in medians["process"]}
        others = max(r[c]["others_cpu_share"] or 0 for rs in runs.values() for r in rs)
        print(f"{c:>11} {'ratio':>10} {ratio['output_throughput']:>10.2f} "
              f"{ratio['median_ttft_ms']:>9.2f} {ratio['median_tpot_ms']:>9.2f}   "
              f"(other processes' CPU share, worst run: {others:.0%})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
