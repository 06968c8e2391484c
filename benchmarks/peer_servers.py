"""The systems of `benchmarks.peers`, each measured the same way: pagedllm's and llama.cpp's
HTTP servers as subprocesses on free loopback ports, driven by `bench serve`'s streaming client
(the workload at each concurrency, then one request alone for single-stream decode), and HF
transformers' static batches in this process."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.peer_workloads import Scenario
from pagedllm.bench.hf_baseline import eos_ids, load_hf_model, resolve_hf_source, run_hf
from pagedllm.bench.utils import cpu_counters, free_port, others_cpu_share
from pagedllm.bench.workload import WorkloadRequest
from pagedllm.config import EngineArgs


# -- CPU accounting ---------------------------------------------------------------------------
def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc (Linux); 0 if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live process (Linux's /proc)."""
    parents = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    parents[int(entry.name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return parents


def counters_with(pids: list[int]):
    """`cpu_counters()` with these processes' CPU, and their descendants' (pagedllm's engine
    process is the server's child), counted as our own: a server we started is the system
    under test, not another process competing with it. (cpu_counters() already counts this
    process's own children.)"""
    counters = cpu_counters()
    if counters is None:
        return None
    busy, own, wall = counters
    parents, me = _parents(), os.getpid()
    tree, frontier = set(), set(pids)
    while frontier:
        tree |= frontier
        frontier = {p for p, parent in parents.items() if parent in frontier} - tree
    counted = {p for p in tree if parents.get(p) != me}
    return busy, own + sum(process_cpu_seconds(p) for p in counted), wall


# -- servers as subprocesses ------------------------------------------------------------------
@contextlib.contextmanager
def server_process(argv: list[str], url: str, log_path: Path, timeout: float = 600.0):
    """Start a server subprocess (output to `log_path`), wait until GET /health answers 200,
    yield the process; leaving the block stops it (SIGTERM, then SIGKILL)."""
    import httpx

    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            deadline = time.time() + timeout
            while True:
                if proc.poll() is not None:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise RuntimeError(
                        f"{argv[0]} exited with {proc.returncode} before serving:\n{tail}"
                    )
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.time() > deadline:
                    raise RuntimeError(f"{argv[0]} did not come up in {timeout:.0f} s")
                time.sleep(0.2)
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _served_model(url: str) -> str:
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def _log_match(log_path: Path, pattern: str) -> str | None:
    match = re.search(pattern, log_path.read_text(errors="replace"))
    return match.group(1).strip() if match else None


# -- measurements -----------------------------------------------------------------------------
def _rate(summary: dict[str, Any], expected_tokens: int) -> dict[str, Any]:
    """A `bench serve` summary's throughput, checked: every request done, and the servers' own
    count of generated tokens (usage.completion_tokens) equal to the requested lengths (a server
    never goes past max_tokens, so equal totals mean equal lengths, request by request)."""
    generated = summary["total_output_tokens"]
    duration = summary["duration_s"]
    return {
        "elapsed_s": duration,
        "num_requests": summary["completed"] + summary["failed"],
        "failed": summary["failed"],
        "errors": summary["errors"],
        "num_output_tokens": generated,
        "expected_output_tokens": expected_tokens,
        "tokens_match": generated == expected_tokens and summary["failed"] == 0,
        "output_tokens_per_s": generated / duration if duration else 0.0,
        "requests_per_s": summary["request_throughput"],
        "mean_ttft_ms": summary["mean_ttft_ms"],
        "mean_tpot_ms": summary["mean_tpot_ms"],
    }


def measure_http(
    url: str,
    requests: list[WorkloadRequest],
    concurrency: list[int],
    decode_request: WorkloadRequest,
    pids: list[int],
    label: str,
    scenarios: list[Scenario] = (),
) -> dict[str, Any]:
    """The workload at each concurrency, the single-stream decode, then the scenarios, against
    one server."""
    from pagedllm.bench.serve import run_benchmark

    model = _served_model(url)
    warmup = [(requests[i % len(requests)][0][:8], 4) for i in range(max(2, min(concurrency)))]
    asyncio.run(run_benchmark(url, warmup, model, math.inf, len(warmup)))
    expected = sum(n for _, n in requests)
    result: dict[str, Any] = {"by_concurrency": {}}
    for c in concurrency:
        before = counters_with(pids)
        summary = asyncio.run(run_benchmark(url, requests, model, math.inf, c))
        rate = _rate(summary, expected)
        rate["others_cpu_share"] = others_cpu_share(before, counters_with(pids))
        result["by_concurrency"][str(c)] = rate
        _print_rate(label, f"concurrency {c}", rate)
    before = counters_with(pids)
    summary = asyncio.run(run_benchmark(url, [decode_request], model, math.inf, 1))
    decode = _rate(summary, decode_request[1])
    tpot = summary["mean_tpot_ms"]
    decode["decode_tokens_per_s"] = 1000.0 / tpot if tpot > 0 else None
    decode["others_cpu_share"] = others_cpu_share(before, counters_with(pids))
    result["decode"] = decode
    _print_decode(label, decode)
    result["scenarios"] = {s.name: measure_scenario(url, model, s, pids, label) for s in scenarios}
    return result


def measure_scenario(url: str, model: str, sc: Scenario, pids: list[int], label: str):
    """Output tokens/s of the scenario's requests at its concurrency; or, for a prefill
    scenario, prompt tokens/s of each request alone (median over them), from its time to first
    token."""
    from pagedllm.bench.serve import run_benchmark

    before = counters_with(pids)
    expected = sum(n for _, n in sc.requests)
    if sc.prefill:
        summaries = [asyncio.run(run_benchmark(url, [r], model, math.inf, 1)) for r in sc.requests]
        ttft_ms = [s["mean_ttft_ms"] for s in summaries]
        generated = sum(s["total_output_tokens"] for s in summaries)
        prompt_len = len(sc.requests[0][0])
        median = float(np.median(ttft_ms))
        result = {
            "ttft_ms": ttft_ms,
            "tokens_per_s": prompt_len / (median / 1e3) if median > 0 else 0.0,
            "num_output_tokens": generated,
            "expected_output_tokens": expected,
            "tokens_match": generated == expected and not any(s["failed"] for s in summaries),
        }
        what = f"{result['tokens_per_s']:.1f} prompt tokens/s (TTFT {median:.0f} ms, median)"
    else:
        summary = asyncio.run(run_benchmark(url, sc.requests, model, math.inf, sc.concurrency))
        result = _rate(summary, expected)
        result["tokens_per_s"] = result["output_tokens_per_s"]
        what = f"{result['tokens_per_s']:.1f} output tokens/s"
    result["others_cpu_share"] = others_cpu_share(before, counters_with(pids))
    print(f"[{label}] {sc.label}: {what}{_busy_note(result['others_cpu_share'])}")
    if not result["tokens_match"]:
        print(f"warning: [{label}] {sc.label}: {result['num_output_tokens']} output tokens, "
              f"{expected} requested", file=sys.stderr)  # fmt: skip
    return result


def run_pagedllm(
    ns, engine_args, requests, decode_request, workdir: Path, scenarios=()
) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--disable-log-stats", "--max-num-queued-reqs", "0",
            *engine_args.to_cli_args()]  # fmt: skip
    log_path = workdir / "pagedllm-serve.log"
    t0 = time.perf_counter()
    with server_process(argv, url, log_path) as proc:
        print(f"[pagedllm] serving at {url} after {time.perf_counter() - t0:.1f} s")
        result = measure_http(
            url, requests, ns.concurrency, decode_request, [proc.pid], "pagedllm", scenarios
        )
    weights = _log_match(log_path, r"weights: ([^\n]*)")
    result.update(
        command=" ".join(argv),
        weights=weights,
        dtype=_pagedllm_dtype(engine_args, weights),
    )
    return result


def _pagedllm_dtype(engine_args: EngineArgs, weights_line: str | None) -> str:
    """From the server's "weights: ... (float32)" log line; else as the engine resolves it."""
    if weights_line and "integers with 8-bit activations" in weights_line:
        return "8-bit activations x the GGUF's codes in integers (float32 between)"
    if weights_line:
        found = re.findall(r"\((?:[^()]*? )?(float32|bfloat16|float16)\)", weights_line)
        kept = re.search(r"kept in (float32|bfloat16|float16)", weights_line)
        if kept:
            return f"{kept.group(1)} (+ {engine_args.quantization} projections)"
        if found:
            return found[-1]
    if engine_args.dtype != "auto":
        return engine_args.dtype
    from pagedllm.engine.arg_utils import auto_dtype, resolve_device

    return auto_dtype(resolve_device(engine_args.device))


def llama_server_argv(
    binary: str, gguf: Path, port: int, parallel: int, slot_ctx: int, threads: int
) -> list[str]:
    return [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(parallel), "--ctx-size", str(parallel * slot_ctx),
            "--cont-batching", "--threads", str(threads),
            "--threads-batch", str(threads)]  # fmt: skip


def llama_server_version(binary: str) -> str | None:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "version" in ln.lower()]
    return lines[0].strip() if lines else None


def gguf_file_type(path: Path) -> str | None:
    """A GGUF's general.file_type by name (e.g. Q4_1): the weights llama.cpp computes with."""
    import gguf

    from pagedllm.model_loader.gguf_file import GGUFFile

    try:
        return gguf.LlamaFileType(GGUFFile(path).metadata["general.file_type"]).name.removeprefix(
            "MOSTLY_"
        )
    except (KeyError, ValueError, OSError):
        return None


def _build_note(binary: str) -> str | None:
    """What benchmarks/build_llama_server.sh noted beside the binary: the llama.cpp commit and
    the llama-cpp-python version it came from."""
    note = Path(binary).with_name("llama-server.source")
    return note.read_text().strip() if note.is_file() else None


def run_llama_cpp(
    ns, binary, gguf, requests, decode_request, workdir: Path, scenarios=()
) -> dict[str, Any]:
    parallel = max([*ns.concurrency, *(sc.concurrency for sc in scenarios)])
    every = [*requests, decode_request, *(r for sc in scenarios for r in sc.requests)]
    longest = max(len(p) + n for p, n in every)
    slot_ctx = -(-(longest + 16) // 256) * 256
    threads = ns.llama_threads or os.cpu_count() or 1
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = llama_server_argv(binary, gguf, port, parallel, slot_ctx, threads)
    log_path = workdir / "llama-server.log"
    t0 = time.perf_counter()
    with server_process(argv, url, log_path) as proc:
        print(f"[llama.cpp] serving at {url} after {time.perf_counter() - t0:.1f} s")
        result = measure_http(
            url, requests, ns.concurrency, decode_request, [proc.pid], "llama.cpp", scenarios
        )
    file_type = gguf_file_type(gguf)
    result.update(
        command=" ".join(argv),
        version=llama_server_version(binary),
        build=_build_note(binary),
        slot_ctx=slot_ctx,
        threads=threads,
        dtype=f"the GGUF's {file_type or 'weights'} as stored (ggml's kernels)",
    )
    return result


def hf_decode_speed(model, prompt: list[int], output_len: int) -> dict[str, Any]:
    """One request through `generate`: tokens/s after the first generated token (a streamer
    stamps each token as it comes)."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:  # first call: the prompt; then one per new token
            self.times.append(time.perf_counter())

        def end(self) -> None:
            self.times.append(time.perf_counter())

    eos = eos_ids(model)
    stamps = Stamps()
    before = cpu_counters()
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
            pad_token_id=eos[0], eos_token_id=eos, streamer=stamps,
        )  # fmt: skip
    generated = out.shape[1] - len(prompt)
    first, last = stamps.times[1], stamps.times[-1]
    return {
        "num_output_tokens": generated,
        "expected_output_tokens": output_len,
        "tokens_match": generated == output_len,
        "elapsed_s": last - stamps.times[0],
        "decode_tokens_per_s": (generated - 1) / (last - first) if last > first else None,
        "others_cpu_share": others_cpu_share(before, cpu_counters()),
    }


def run_hf_peer(ns, engine_args, requests, decode_request) -> dict[str, Any]:
    t0 = time.perf_counter()
    directory, gguf_file = resolve_hf_source(engine_args.model)
    model = load_hf_model(directory, gguf_file)
    source = directory / gguf_file if gguf_file else directory
    print(f"[HF] {source} loaded in {time.perf_counter() - t0:.1f} s (float32)")
    expected = sum(n for _, n in requests)
    result: dict[str, Any] = {"by_concurrency": {}, "model_source": str(source)}
    for c in ns.concurrency:
        r = run_hf(model, requests, c)
        r.pop("token_ids")
        r["expected_output_tokens"] = expected
        r["tokens_match"] = r["num_useful_output_tokens"] == expected
        result["by_concurrency"][str(c)] = r
        _print_rate("HF", f"static batch {c}", r)
    result["decode"] = hf_decode_speed(model, *decode_request)
    _print_decode("HF", result["decode"])
    result["dtype"] = "float32 (the GGUF dequantized by transformers)"
    del model
    gc.collect()
    return result


# -- progress lines --------------------------------------------------------------------------------
def _busy_note(others: float | None) -> str:
    if others is None:
        return ""
    return f", others used {others:.0%} of the CPU" + (" (busy: skewed)" if others > 0.1 else "")


def _print_rate(label: str, what: str, r: dict[str, Any]) -> None:
    print(
        f"[{label}] {what}: {r['num_requests']} requests in {r['elapsed_s']:.2f} s, "
        f"{r['output_tokens_per_s']:.1f} output tokens/s{_busy_note(r.get('others_cpu_share'))}"
    )
    if not r["tokens_match"]:
        got = r.get("num_useful_output_tokens", r["num_output_tokens"])
        print(
            f"warning: [{label}] {what}: {got} output tokens generated, "
            f"{r['expected_output_tokens']} requested; failed requests: {r.get('failed', 0)} "
            f"{r.get('errors') or ''}",
            file=sys.stderr,
        )


def _print_decode(label: str, d: dict[str, Any]) -> None:
    rate = d["decode_tokens_per_s"]
    shown = f"{rate:.1f}" if rate is not None else "n/a"
    print(
        f"[{label}] single-stream decode: {shown} tokens/s{_busy_note(d.get('others_cpu_share'))}"
    )
    if not d["tokens_match"]:
        print(
            f"warning: [{label}] decode: {d['num_output_tokens']} tokens generated, "
            f"{d['expected_output_tokens']} requested",
            file=sys.stderr,
        )
