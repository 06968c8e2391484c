"""`python -m benchmarks.peers`: pagedllm against its peers, side by side, in one run.

The same ShareGPT-shaped workload (token-id prompts, greedy, ignore_eos, every request generating
exactly its own output length) goes, one system after the other on the same machine, to:

- pagedllm through its real HTTP server: `pagedllm serve` started as a subprocess on a free
  loopback port, with this command's engine flags;
- llama.cpp's `llama-server` (built by benchmarks/build_llama_server.sh), a subprocess with one
  parallel slot per request of the highest concurrency and continuous batching, on the same GGUF
  file, through its OpenAI-compatible /v1/completions;
- Hugging Face transformers' `generate` in static, left-padded batches, on the same GGUF's
  weights dequantized to float32 (the runner of `pagedllm bench throughput --baseline hf`).

How each system is started and measured is peer_servers.py. After the sweep, both servers also
run the scenarios of peer_workloads.py (long prompts, a shared prefix, prefill tokens/s at 512
and 2,048 tokens); HF's static batches do not.

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
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common, peer_workloads
from benchmarks.peer_servers import run_hf_peer, run_llama_cpp, run_pagedllm
from pagedllm.bench.hf_baseline import resolve_hf_source
from pagedllm.bench.utils import table_lines, write_json
from pagedllm.config import EngineArgs

PEERS = ("pagedllm", "llama.cpp", "hf")
BUILD_SCRIPT = "benchmarks/build_llama_server.sh"


def peers_dir() -> Path:
    """Where benchmarks/build_llama_server.sh puts llama-server (and its sources)."""
    return Path(os.environ.get("PAGEDLLM_PEERS_DIR") or "~/.cache/pagedllm/peers").expanduser()


def default_llama_server() -> Path:
    return peers_dir() / "llama-server"


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
    group.add_argument("--concurrency", type=common.nonempty(common.int_list), default=[1, 8, 32],
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
    peer_workloads.add_cli_args(group)


# -- reporting -------------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


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
            for name, r in paged.get("scenarios", {}).items():
                if name in other.get("scenarios", {}):
                    row[name] = _ratio(r["tokens_per_s"], other["scenarios"][name]["tokens_per_s"])
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
        row += [_times(ratios[p].get(key)) for p in ratios]
        rows.append(tuple(row))
    row = ["single-stream decode"]
    row += [_fmt(systems[p]["decode"]["decode_tokens_per_s"]) for p in present]
    row += [_times(ratios[p].get("decode")) for p in ratios]
    rows.append(tuple(row))
    for name, label in results.get("scenario_labels", {}).items():
        row = [label]
        row += [_fmt(systems[p].get("scenarios", {}).get(name, {}).get("tokens_per_s"))
                for p in present]  # fmt: skip
        row += [_times(ratios[p].get(name)) for p in ratios]
        rows.append(tuple(row))
    lines = table_lines(rows)
    if "hf" in present:
        lines.append("(HF: static batches of the concurrency's size; its decode: one request "
                     "alone; no scenarios)")  # fmt: skip
    for p in present:
        lines.append(f"{names[p]} ran: {systems[p]['dtype']}")
    mismatched = [
        f"{names[p]} at {what}"
        for p in present
        for what, r in _checked(systems[p])
        if not r["tokens_match"]
    ]
    if mismatched:
        lines.append("WARNING: generated tokens != requested for " + ", ".join(mismatched))
    for peer, error in results.get("failed", {}).items():
        lines.append(f"FAILED: {names[peer]}: {error.splitlines()[0]}")
    return "\n".join(lines)


def _checked(system: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every measurement of a system whose generated token count is checked."""
    return [*system["by_concurrency"].items(), ("decode", system["decode"]),
            *system.get("scenarios", {}).items()]  # fmt: skip


# -- the command ------------------------------------------------------------------------------
def _workload(ns, engine_args: EngineArgs):
    from pagedllm.bench.workload import workload_from_tokenizer
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
    scenarios, notes = peer_workloads.build(
        ns, ordinary, special, size, max_model_len, ns.workload_seed
    )
    for note in notes:
        print(f"note: skipping scenario {note} (max_model_len)")
    return name, requests, (decode_prompt, ns.decode_output_len), scenarios


def _resolve_peers(ns, engine_args: EngineArgs) -> tuple[list[str], str | None, Path | None]:
    """The peers to run, llama-server's path and the GGUF it loads; llama.cpp dropped with a
    note when defaulted and impossible, an error when asked for."""
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
    model_name, requests, decode_request, scenarios = _workload(ns, engine_args)
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
            "scenarios": {
                s.name: {
                    "num_requests": len(s.requests),
                    "concurrency": s.concurrency,
                    "prompt_lens": [len(p) for p, _ in s.requests],
                    "output_lens": [n for _, n in s.requests],
                }
                for s in scenarios
            },
        },  # fmt: skip
        "scenario_labels": {s.name: s.label for s in scenarios},
        "systems": {},
    }
    systems = results["systems"]
    failed = results["failed"] = {}
    with tempfile.TemporaryDirectory(prefix="pagedllm-peers-") as tmp:
        workdir = Path(tmp)
        runs = {
            "pagedllm": lambda: run_pagedllm(
                ns, engine_args, requests, decode_request, workdir, scenarios
            ),
            "llama.cpp": lambda: run_llama_cpp(
                ns, binary, gguf, requests, decode_request, workdir, scenarios
            ),
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
        write_json(ns.output_json, results)
    ok = all(r["tokens_match"] for s in systems.values() for _, r in _checked(s))
    return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
