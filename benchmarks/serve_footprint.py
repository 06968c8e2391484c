"""`python -m benchmarks.serve_footprint`: what serving a model costs before any speed: the time
from launching the server to its first answer of /health, and the peak resident memory of
its processes (for pagedllm the server and its engine process, each one's VmHWM, summed: an
upper bound of their peak together) after serving a few short requests, against the GGUF
file's size. With --llama-server, the same for llama.cpp's llama-server on the same file.

    python -m benchmarks.serve_footprint                      # the default model
    python -m benchmarks.random_gguf /tmp/1b.gguf --shape llama-1b
    python -m benchmarks.serve_footprint --model /tmp/1b.gguf --llama-server auto

Engine flags pass through to `pagedllm serve` (--dtype float32 for the exact path, ...).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import common
from benchmarks.peer_servers import _log_match, _served_model, llama_server_argv, server_process
from benchmarks.peers import default_llama_server
from pagedllm.bench.utils import free_port
from pagedllm.model_loader import resolve_model
from pagedllm.procs import child_pids


def add_cli_args(parser) -> None:
    group = parser.add_argument_group("footprint")
    group.add_argument("--num-requests", type=int, default=16, help="short requests (default 16)")
    group.add_argument("--max-tokens", type=int, default=16, help="tokens each (default 16)")
    group.add_argument("--llama-server", default=None,
                       help="also measure llama-server: its path, or 'auto' for "
                            "benchmarks/build_llama_server.sh's")  # fmt: skip


def peak_rss(pid: int) -> dict[int, int]:
    """VmHWM (bytes) of `pid` and every descendant."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    out[p] = int(line.split()[1]) * 1024
        except OSError:
            continue
        todo.extend(child_pids(p))
    return out


def serve_requests(url: str, model: str, n: int, max_tokens: int) -> None:
    import httpx

    def one(i: int) -> None:
        body = {"model": model, "prompt": f"Request {i}: tell me about paging.",
                "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        r.raise_for_status()

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))


def measure(label: str, argv: list[str], url: str, ns, log: Path) -> dict:
    t0 = time.perf_counter()
    with server_process(argv, url, log) as proc:
        ready = time.perf_counter() - t0
        serve_requests(url, _served_model(url), ns.num_requests, ns.max_tokens)
        rss = peak_rss(proc.pid)
    total = sum(rss.values())
    each = ", ".join(f"{v / 2**20:,.0f}" for v in rss.values())
    print(f"[{label}] launch to serving {ready:.1f} s; peak RSS {total / 2**20:,.0f} MiB over "
          f"{len(rss)} process(es) ({each})")  # fmt: skip
    return {"ready_s": ready, "peak_rss": total}


def main(ns, engine_args) -> int:
    path = Path(resolve_model(engine_args.model))
    size = path.stat().st_size
    print(f"{path.name}: {size / 2**20:,.0f} MiB; {os.cpu_count()} CPUs; "
          f"{ns.num_requests} requests of {ns.max_tokens} tokens")  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="footprint-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), *engine_args.to_cli_args()]  # fmt: skip
    ours = measure("pagedllm", argv, url, ns, work / "pagedllm.log")
    weights = _log_match(work / "pagedllm.log", r"weights: ([^\n]*)")
    print(f"  weights: {weights}")
    budget = size + 1.5 * 2**30
    print(f"  peak RSS / (file + 1.5 GiB): {ours['peak_rss'] / budget:.2f}")
    if ns.llama_server:
        binary = str(default_llama_server()) if ns.llama_server == "auto" else ns.llama_server
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        threads = os.cpu_count() or 1
        theirs = measure(
            "llama-server", llama_server_argv(binary, path, port, ns.num_requests, 4096, threads),
            url, ns, work / "llama.log",
        )  # fmt: skip
        print(f"  pagedllm / llama-server: start-up {ours['ready_s'] / theirs['ready_s']:.2f}x, "
              f"peak RSS {ours['peak_rss'] / theirs['peak_rss']:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
