"""llama.cpp's llama-server in `benchmarks.speculative` (`--llama-server PATH`): the same
requests (token ids), one at a time, without speculation and with each of its draft-free
`--spec-type`s, greedy, against the same GGUF. Wall time per request, prefill included, as
the closed loop measures pagedllm; the server runs with all the cores, as pagedllm does."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.peer_servers import llama_server_argv, llama_server_version, server_process
from pagedllm.bench.utils import free_port

SPEC_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-mod")


def run_llama_server(binary: str, gguf: str, requests, spec_type: str, draft_max: int) -> dict:
    """The requests (prompt ids, max_tokens, ignore_eos) one after another on a llama-server
    started with `--spec-type spec_type` (and `--spec-draft-n-max draft_max`), or none."""
    longest = max(len(p) + n for p, n, _ in requests)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    threads = os.cpu_count() or 1
    argv = llama_server_argv(binary, Path(gguf), port, 1, longest + 64, threads)
    if spec_type != "none":
        argv += ["--spec-type", spec_type, "--spec-draft-n-max", str(draft_max)]
    outputs, tokens, drafted, accepted = [], 0, 0, 0
    with tempfile.TemporaryDirectory() as workdir:
        log = Path(workdir) / "llama-server.log"
        with server_process(argv, url, log), httpx.Client(timeout=600) as client:
            start = time.perf_counter()
            for prompt, max_tokens, ignore_eos in requests:
                body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0,
                        "ignore_eos": ignore_eos, "return_tokens": True,
                        "cache_prompt": False}  # fmt: skip
                reply = client.post(f"{url}/completion", json=body)
                reply.raise_for_status()
                out = reply.json()
                outputs.append(out.get("tokens", []))
                tokens += out["timings"]["predicted_n"]
                drafted += out["timings"].get("draft_n", 0)
                accepted += out["timings"].get("draft_n_accepted", 0)
            seconds = time.perf_counter() - start
    return {
        "outputs": outputs,
        "output_tokens": tokens,
        "seconds": seconds,
        "output_tokens_per_s": tokens / seconds,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": None,
        "command": " ".join(argv),
        "version": llama_server_version(binary),
    }
