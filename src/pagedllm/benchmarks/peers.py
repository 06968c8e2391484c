"""`pagedllm bench peers`: pagedllm against its peers, side by side, in one run.

The same ShareGPT-shaped workload (token-id prompts, greedy, ignore_eos, every request generating
exactly its own output length) goes, one system after the other on the same machine, to:

- pagedllm through its real HTTP server: `pagedllm serve` started as a subprocess on a free
  loopback port, with this command's engine flags;
- llama.cpp's `llama-server` (built by benchmarks/build_llama_server.sh), a subprocess with one
  parallel slot per request of the highest concurrency and continuous batching, on the same GGUF
  file, through its OpenAI-compatible /v1/completions;
- Hugging Face transformers' `generate` in static, left-padded batches, on the same GGUF's
  weights dequantized to float32 (`bench throughput --baseline hf`'s runner).

Both servers get the workload from `bench serve`'s streaming client, at most C requests in flight
for each concurrency C; the static batching of HF uses batch size C. Each reports useful output
tokens per second of wall time, and single-stream decode tokens/s: one request alone, (output
tokens - 1) / (time after its first token).

Each system runs what a user would get by default: pagedllm its default dtype on CPU (float32,
or bfloat16 with --quantization; --dtype/--quantization pass through), llama.cpp the GGUF's own
quantized weights with its native kernels, HF float32. An honest side by side of the defaults,
not a same-dtype comparison: the report says which dtype each ran.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.benchmarks.throughput import cpu_counters, others_cpu_share, table_lines
from pagedllm.benchmarks.workload import WorkloadRequest
from pagedllm.config import EngineArgs

PEERS = ("pagedllm", "llama.cpp", "hf")
BUILD_SCRIPT = "benchmarks/build_llama_server.sh"


def peers_dir() -> Path:
    """Where benchmarks/build_llama_server.sh puts llama-server (and its sources)."""
    return Path(os.environ.get("PAGEDLLM_PEERS_DIR") or "~/.cache/pagedllm/peers").expanduser()


def default_llama_server() -> Path:
    return peers_dir() / "llama-server"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,32, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _peer_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in PEERS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown peer(s) {', '.join(unknown) or text!r}; known: {', '.join(PEERS)}"
        )
    return [p for p in PEERS if p in names]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("peers")
    group.add_argument("--peers", type=_peer_list, default=None,
                       help="systems to run, a subset of pagedllm,llama.cpp,hf (default: "
                            "all; llama.cpp skipped with a note when its binary is "
                            "missing)")  # fmt: skip
    group.add_argument("--concurrency", type=_int_list, default=[1, 8, 32],
                       help="requests in flight (HF: static batch size) "
                            "(default: 1,8,32)")  # fmt: skip
    group.add_argument("--num-prompts", type=int, default=64, help="requests (default: 64)")
    group.add_argument("--scale", type=float, default=0.25,
                       help="ShareGPT length scale (default: 0.25)")  # fmt: skip
    group.add_argument("--workload-seed", type=int, default=0, help="workload seed (default: 0)")
    group.add_argument("--decode-prompt-len", type=int, default=16,
                       help="prompt tokens of the single-stream decode request "
                            "(default: 16)")  # fmt: skip
    group.add_argument("--decode-output-len", type=int, default=128,
                       help="output tokens of the single-stream decode request "
                            "(default: 128)")  # fmt: skip
    group.add_argument("--llama-server", default=None,
                       help=f"llama.cpp's llama-server binary (default: the one {BUILD_SCRIPT} "
                            "installs, $PAGEDLLM_PEERS_DIR/llama-server, "
                            "~/.cache/pagedllm/peers/llama-server)")  # fmt: skip
    group.add_argument("--llama-threads", type=int, default=None,
                       help="llama-server's threads (default: every core)")  # fmt: skip
    group.add_argument("--output-json", default=None, help="write every figure to this JSON file")


# -- CPU accounting ---------------------------------------------------------------------------
def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc (Linux); 0 if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def counters_with(pids: list[int]):
    """`cpu_counters()` with these processes' CPU counted as our own: a server we started is
    the system under test, not another process competing with it."""
    counters = cpu_counters()
    if counters is None:
        return None
    busy, own, wall = counters
    return busy, own + sum(process_cpu_seconds(p) for p in pids), wall


# -- servers as subprocesses ------------------------------------------------------------------
def free_port() -> int:
    from pagedllm.benchmarks.soak import free_port as soak_free_port

    return soak_free_port()


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
) -> dict[str, Any]:
    """The workload at each concurrency, then the single-stream decode, against one server."""
    from pagedllm.benchmarks.serve import run_benchmark

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
    return result


def run_pagedllm(ns, engine_args, requests, decode_request, workdir: Path) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--disable-log-stats", "--max-num-queued-reqs", "0",
            *engine_args.to_cli_args()]  # fmt: skip
    log_path = workdir / "pagedllm-serve.log"
    t0 = time.perf_counter()
    with server_process(argv, url, log_path) as proc:
        print(f"[pagedllm] serving at {url} after {time.perf_counter() - t0:.1f} s")
        result = measure_http(url, requests, ns.concurrency, decode_request, [proc.pid], "pagedllm")
    weights = _log_match(log_path, r"weights: ([^\n]*)")
    result.update(
        command=" ".join(argv),
        weights=weights,
        dtype=_pagedllm_dtype(engine_args, weights),
    )
    return result


def _pagedllm_dtype(engine_args: EngineArgs, weights_line: str | None) -> str:
    """From the server's "weights: ... (float32)" log line; else as the engine resolves it."""
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

    dtype = auto_dtype(resolve_device(engine_args.device))
    return str(dtype).removeprefix("torch.")


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

    try:
        field = gguf.GGUFReader(path).fields["general.file_type"]
        return gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")
    except (KeyError, ValueError, IndexError, OSError):
        return None


def _build_note(binary: str) -> str | None:
    """What benchmarks/build_llama_server.sh noted beside the binary: the llama.cpp commit and
    the llama-cpp-python version it came from."""
    note = Path(binary).with_name("llama-server.source")
    return note.read_text().strip() if note.is_file() else None


def run_llama_cpp(ns, binary, gguf, requests, decode_request, workdir: Path) -> dict[str, Any]:
    parallel = max(ns.concurrency)
    longest = max(len(p) + n for p, n in [*requests, decode_request])
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
            url, requests, ns.concurrency, decode_request, [proc.pid], "llama.cpp"
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

    from pagedllm.benchmarks.throughput import _eos_ids

    eos = _eos_ids(model)
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
    from pagedllm.benchmarks.throughput import load_hf_model, resolve_hf_source, run_hf

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


# -- reporting --------------------------------------------------------------------------------
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


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def add_ratios(results: dict[str, Any]) -> None:
    """pagedllm / peer, for every row the two share."""
    systems = results["systems"]
    paged = systems.get("pagedllm")
    ratios: dict[str, dict[str, float | None]] = {}
    if paged is not None:
        for peer in ("llama.cpp", "hf"):
            if peer not in systems:
                continue
            other = systems[peer]
            row = {
                c: _ratio(
                    r["output_tokens_per_s"], other["by_concurrency"][c]["output_tokens_per_s"]
                )
                for c, r in paged["by_concurrency"].items()
                if c in other["by_concurrency"]
            }
            row["decode"] = _ratio(
                paged["decode"]["decode_tokens_per_s"], other["decode"]["decode_tokens_per_s"]
            )
            ratios[peer] = row
    results["pagedllm_over_peer"] = ratios


def format_table(results: dict[str, Any]) -> str:
    systems = results["systems"]
    names = {"pagedllm": "pagedllm", "llama.cpp": "llama.cpp", "hf": "HF static"}
    present = [p for p in PEERS if p in systems]
    ratios = results.get("pagedllm_over_peer", {})
    header = ["output tokens/s", *(names[p] for p in present)]
    header += [f"pagedllm / {names[p]}" for p in ratios]
    rows: list[tuple[str, ...]] = [tuple(header)]
    for c in results["concurrency"]:
        key = str(c)
        row = [f"concurrency {c}"]
        row += [_fmt(systems[p]["by_concurrency"][key]["output_tokens_per_s"]) for p in present]
        row += [_fmt(ratios[p].get(key), ".2f") + "x" for p in ratios]
        rows.append(tuple(row))
    row = ["single-stream decode"]
    row += [_fmt(systems[p]["decode"]["decode_tokens_per_s"]) for p in present]
    row += [_fmt(ratios[p].get("decode"), ".2f") + "x" for p in ratios]
    rows.append(tuple(row))
    lines = table_lines(rows)
    lines.append("(HF: static batches of the concurrency's size; its decode: one request alone)")
    for p in present:
        lines.append(f"{names[p]} ran: {systems[p]['dtype']}")
    mismatched = [
        f"{names[p]} at {what}"
        for p in present
        for what, r in [*systems[p]["by_concurrency"].items(), ("decode", systems[p]["decode"])]
        if not r["tokens_match"]
    ]
    if mismatched:
        lines.append("WARNING: generated tokens != requested for " + ", ".join(mismatched))
    for peer, error in results.get("failed", {}).items():
        lines.append(f"FAILED: {names[peer]}: {error.splitlines()[0]}")
    return "\n".join(lines)


# -- the command ------------------------------------------------------------------------------
def _workload(ns, engine_args: EngineArgs):
    from pagedllm.benchmarks.workload import workload_from_tokenizer
    from pagedllm.model_loader.loader import load_model_config, load_tokenizer

    config, name = load_model_config(engine_args.model)
    tokenizer = load_tokenizer(engine_args.tokenizer or engine_args.model)
    max_model_len = min(
        engine_args.max_model_len or config.max_position_embeddings,
        config.max_position_embeddings,
    )
    requests = workload_from_tokenizer(
        ns.num_prompts, tokenizer, vocab_size=config.vocab_size, scale=ns.scale,
        seed=ns.workload_seed, max_model_len=max_model_len,
    )  # fmt: skip
    size = min(config.vocab_size, tokenizer.vocab_size)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    ordinary = np.array([i for i in range(size) if i not in special])
    rng = np.random.default_rng(ns.workload_seed + 1)
    decode_prompt = rng.choice(ordinary, ns.decode_prompt_len).tolist()
    return name, requests, (decode_prompt, ns.decode_output_len)


def _resolve_peers(ns, engine_args: EngineArgs) -> tuple[list[str], str | None, Path | None]:
    """The peers to run, llama-server's path and the GGUF it loads; llama.cpp dropped with a
    note when defaulted and impossible, an error when asked for."""
    from pagedllm.benchmarks.throughput import resolve_hf_source

    peers = list(ns.peers or PEERS)
    binary, gguf = None, None
    if "llama.cpp" in peers:
        binary = ns.llama_server or str(default_llama_server())
        directory, gguf_file = resolve_hf_source(engine_args.model)
        problem = None
        if gguf_file is None:
            problem = f"llama.cpp needs a GGUF model, and {directory} is a Hugging Face directory"
        elif not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
            problem = (
                f"no llama-server at {binary}: build it with {BUILD_SCRIPT} (or pass "
                "--llama-server PATH)"
            )
        else:
            gguf = directory / gguf_file
        if problem:
            if ns.peers is not None:
                raise ValueError(problem)
            print(f"note: skipping llama.cpp: {problem}")
            peers.remove("llama.cpp")
    return peers, binary, gguf


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    if ns.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    if ns.decode_prompt_len < 1 or ns.decode_output_len < 2:
        raise ValueError("--decode-prompt-len must be >= 1 and --decode-output-len >= 2")
    peers, binary, gguf = _resolve_peers(ns, engine_args)
    model_name, requests, decode_request = _workload(ns, engine_args)
    num_in = sum(len(p) for p, _ in requests)
    num_out = sum(n for _, n in requests)
    print(
        f"workload: {len(requests)} requests, ShareGPT-shaped at scale {ns.scale} "
        f"(seed {ns.workload_seed}): {num_in} prompt tokens, {num_out} output tokens; "
        f"decode: {ns.decode_prompt_len}-token prompt, {ns.decode_output_len} tokens; "
        f"model {model_name}; peers: {', '.join(peers)}; concurrency "
        f"{','.join(map(str, ns.concurrency))}; {os.cpu_count()} cores"
    )
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(sys.argv),
        "model": model_name,
        "num_cores": os.cpu_count(),
        "engine_args": dataclasses.asdict(engine_args),
        "concurrency": ns.concurrency,
        "workload": {
            "num_prompts": len(requests),
            "scale": ns.scale,
            "seed": ns.workload_seed,
            "num_prompt_tokens": num_in,
            "num_output_tokens": num_out,
            "decode_prompt_len": ns.decode_prompt_len,
            "decode_output_len": ns.decode_output_len,
        },  # fmt: skip
        "systems": {},
    }
    systems = results["systems"]
    failed = results["failed"] = {}
    with tempfile.TemporaryDirectory(prefix="pagedllm-peers-") as tmp:
        workdir = Path(tmp)
        runs = {
            "pagedllm": lambda: run_pagedllm(ns, engine_args, requests, decode_request, workdir),
            "llama.cpp": lambda: run_llama_cpp(ns, binary, gguf, requests, decode_request, workdir),
            "hf": lambda: run_hf_peer(ns, engine_args, requests, decode_request),
        }
        for peer in peers:
            try:
                systems[peer] = runs[peer]()
            except RuntimeError as e:  # a server that crashed or never came up: the others run
                failed[peer] = str(e)
                print(f"error: [{peer}] {e}", file=sys.stderr)
    add_ratios(results)
    print()
    print(format_table(results))
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"wrote {ns.output_json}")
    ok = all(
        r["tokens_match"]
        for s in systems.values()
        for r in [*s["by_concurrency"].values(), s["decode"]]
    )
    return 0 if ok and not failed else 1
