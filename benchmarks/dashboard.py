"""`python -m benchmarks.dashboard`: what the KV dashboard's snapshots cost the step loop.

One engine runs the same batch of greedy requests (`--num-seqs`, a third of them with n = 3 so
blocks are shared; `--output-len` tokens each, EOS ignored) three times: with no snapshot; with
a snapshot (and its JSON, as /debug/kv sends it) every 0.2 s between steps, the most the server
takes however many pages poll; and with one after every step, a worst case no server reaches.
Reported per run: throughput and its ratio to the first run, the snapshots taken, their median
and largest time (snapshot + JSON) and size. Every run must decode the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks import common
from pagedllm.config import EngineArgs
from pagedllm.entrypoints.openai.dashboard import SNAPSHOT_INTERVAL
from pagedllm.sampling_params import SamplingParams


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument("--num-seqs", type=int, default=24, help="requests in the batch")
    group.add_argument("--output-len", type=int, default=96, help="tokens per request")


def run_batch(engine, prompts: list[list[int]], output_len: int, interval: float | None) -> dict:
    """Step the batch dry, taking a snapshot whenever `interval` seconds have passed since the
    last one (0: after every step; None: never)."""
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            n=3 if i % 3 == 0 else 1, temperature=0, max_tokens=output_len, ignore_eos=True
        )
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    tokens: dict[str, list[list[int]]] = {}
    costs, sizes = [], []
    start = last = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = [c.token_ids for c in out.outputs]
        now = time.perf_counter()
        if interval is not None and now - last >= interval:
            body = json.dumps(engine.kv_snapshot(), separators=(",", ":"))
            last = time.perf_counter()
            costs.append(last - now)
            sizes.append(len(body))
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "num_tokens": sum(len(t) for outs in tokens.values() for t in outs),
        "tokens": [tokens[str(i)] for i in range(len(prompts))],
        "costs": costs,
        "sizes": sizes,
    }


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    from pagedllm.engine.llm_engine import LLMEngine

    engine_args.enable_prefix_caching = False  # every run prefills alike
    engine = LLMEngine(engine_args)
    prompts = [
        [(31 * i + 7 * j) % 20000 + 100 for j in range(48 + 8 * (i % 5))]
        for i in range(ns.num_seqs)
    ]
    run_batch(engine, prompts[:2], 4, None)  # warm-up
    print(
        f"dashboard snapshots: {ns.num_seqs} greedy requests (n=3 for a third) x "
        f"{ns.output_len} tokens, {engine.num_blocks} KV blocks, model {engine.model_name}"
    )
    print(
        f"{'snapshots':<22} {'tok/s':>8} {'ratio':>6} {'taken':>6} {'median ms':>10} "
        f"{'max ms':>7} {'KiB':>6}"
    )
    runs = {"none": None, f"every {SNAPSHOT_INTERVAL} s": SNAPSHOT_INTERVAL, "every step": 0.0}
    results = {}
    for name, interval in runs.items():
        r = results[name] = run_batch(engine, prompts, ns.output_len, interval)
        rate = r["num_tokens"] / r["seconds"]
        base = results["none"]["num_tokens"] / results["none"]["seconds"]
        costs = r["costs"] or [0.0]
        size = max(r["sizes"], default=0) / 1024
        print(
            f"{name:<22} {rate:>8.1f} {rate / base:>6.3f} {len(r['costs']):>6} "
            f"{statistics.median(costs) * 1e3:>10.2f} {max(costs) * 1e3:>7.2f} {size:>6.0f}"
        )
    same = all(r["tokens"] == results["none"]["tokens"] for r in results.values())
    print(f"every run decodes the same tokens: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
