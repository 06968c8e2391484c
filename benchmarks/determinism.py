"""`python -m benchmarks.determinism`: the same greedy request sent many times to `pagedllm serve`
while other random requests run (the Thinking Machines experiment): how many distinct completions
come back (1 when the engine is batch invariant: docs/determinism.md), and the output tokens/s
of the whole run.

`--num-identical` copies of one prompt (`--max-tokens` greedy tokens each, with log-probabilities)
and `--num-others` random prompts (random lengths, temperature 1) are sent in a shuffled order,
at most `--concurrency` at a time, so the copies land in steps of every size and mix, as prefix
-cache hits (`--enable-prefix-caching`) or not. A completion is its text and its log-probabilities.

`--compare-fast` runs the workload on `--deterministic` and then on `--no-deterministic` (the
fast path: MKL / oneDNN GEMMs and SDPA for prefill chunks), one server after the other in the
same run, and prints the ratio of their output tokens/s.

    python -m benchmarks.determinism [--num-identical 1000] [--num-others 200] [--compare-fast]
        [engine flags]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks import common
from benchmarks.peer_servers import server_process
from pagedllm.bench.utils import free_port, write_json

PROMPT = "Explain, step by step, why the sky is blue and sunsets are red."


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("determinism")
    group.add_argument("--num-identical", type=int, default=1000, help="copies of the prompt")
    group.add_argument("--num-others", type=int, default=200, help="random requests among them")
    group.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per copy")
    group.add_argument("--concurrency", type=int, default=64, help="requests in flight at most")
    group.add_argument("--workload-seed", type=int, default=0)
    group.add_argument(
        "--compare-fast",
        action="store_true",
        help="run the workload twice: --deterministic, then --no-deterministic (the fast "
        "path), and print both and their throughput ratio",
    )
    group.add_argument("--output-json", help="write the result here")


async def _send(ns, url: str) -> tuple[Counter, int, float]:
    import httpx

    rng = random.Random(ns.workload_seed)
    words = PROMPT.split()
    jobs = [("same", PROMPT, 0.0, ns.max_tokens)] * ns.num_identical
    for _ in range(ns.num_others):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 120)))
        jobs.append(("other", text, 1.0, rng.randint(4, 2 * ns.max_tokens)))
    rng.shuffle(jobs)
    gate = asyncio.Semaphore(ns.concurrency)
    completions: Counter = Counter()
    tokens = 0

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(3600)) as client:

        async def one(kind: str, prompt: str, temperature: float, max_tokens: int) -> None:
            nonlocal tokens
            body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": temperature, "ignore_eos": True, "logprobs": 1}  # fmt: skip
            async with gate:
                response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            data = response.json()
            tokens += data["usage"]["completion_tokens"]
            if kind == "same":
                choice = data["choices"][0]
                logprobs = tuple(choice["logprobs"]["token_logprobs"])
                completions[(choice["text"], logprobs)] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(*job) for job in jobs))
        return completions, tokens, time.perf_counter() - t0


def _serve_and_send(ns: argparse.Namespace, engine_args) -> dict:
    """One server with `engine_args`, the whole workload through it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--disable-log-stats", "--served-model-name", "m",
            *engine_args.to_cli_args()]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        with server_process(argv, url, Path(tmp) / "serve.log"):
            completions, tokens, seconds = asyncio.run(_send(ns, url))
    counts = sorted(completions.values(), reverse=True)
    return {"distinct": len(counts), "counts": counts, "command": argv, "tokens": tokens,
            "seconds": seconds, "output_tokens_per_s": tokens / seconds}  # fmt: skip


def _report(name: str, ns: argparse.Namespace, result: dict) -> None:
    counts = result["counts"]
    print(f"{name}: {ns.num_identical} identical greedy requests among {ns.num_others} others "
          f"(concurrency {ns.concurrency}): {len(counts)} distinct completion(s) "
          f"{counts[:10]}{' ...' if len(counts) > 10 else ''}")  # fmt: skip
    print(f"{name}: output {result['tokens']} tokens in {result['seconds']:.1f} s, "
          f"{result['output_tokens_per_s']:.1f} tokens/s")  # fmt: skip
    print(f"{name}: command: {' '.join(result['command'][2:])}")


def main(ns: argparse.Namespace, engine_args) -> int:
    """The engine as given; with --compare-fast, --deterministic and then --no-deterministic
    (the fast path) on the same workload, one after the other."""
    if not ns.compare_fast:
        result = _serve_and_send(ns, engine_args)
        _report("as given", ns, result)
        if ns.output_json:
            write_json(ns.output_json, result)
        return 0
    runs = {
        name: _serve_and_send(ns, dataclasses.replace(engine_args, deterministic=on))
        for name, on in (("invariant", True), ("fast", False))
    }
    for name, result in runs.items():
        _report(name, ns, result)
    ratio = runs["invariant"]["output_tokens_per_s"] / runs["fast"]["output_tokens_per_s"]
    print(f"invariant / fast output tokens/s: {ratio:.2f}x")
    if ns.output_json:
        write_json(ns.output_json, {**runs, "invariant_over_fast": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
