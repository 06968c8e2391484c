"""`python -m benchmarks.prefix_caching`: one shared-prefix workload, prefix caching off and on.

This follows the shared-prefix experiment of the PagedAttention paper (Kwon et al., SOSP 2023,
section 6.4): WMT16 English-to-German translation prompts that all start with the same prefix (an
instruction plus one example, 80 tokens, or five examples, 341 tokens) followed by the sentence to
translate. Our workload is synthetic and seeded: one common prefix of `--prefix-len` tokens, then a
short distinct suffix per request (a sentence-sized log-normal length, mean `--suffix-len`), and a
short output (log-normal, mean `--output-len`), token ids drawn uniformly from the tokenizer's
ordinary vocabulary (prefix_workload.py). Requests arrive as a seeded Poisson process at
`--request-rate` (default `inf`: all queued at once, offline throughput).

One command runs the workload twice in one process, on the same engine flags, first with prefix
caching off and then on (two engines, the first freed before the second is built). Both are greedy
with `ignore_eos` and each request's own `max_tokens`, so both do identical work and must produce
identical tokens; the share of requests whose outputs agree is a sanity check of prefix caching.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import statistics
import sys
import time
from collections import deque
from typing import Any

from benchmarks import common
from benchmarks.prefix_workload import SharedPrefixWorkload, workload_for_engine
from pagedllm.bench.utils import (
    cpu_counters,
    greedy_agreement,
    greedy_params,
    median,
    others_cpu_share,
    print_run,
    speed_figures,
    write_json,
)
from pagedllm.config import EngineArgs

# The paper's figures (Fig. 16): vLLM's throughput over Orca (Oracle)'s, by prefix length.
PAPER_FIGURES = (
    {"shots": "1-shot", "prefix_len": 80, "throughput_ratio": 1.67},
    {"shots": "5-shot", "prefix_len": 341, "throughput_ratio": 3.58},
)
PAPER_SETUP = (
    "PagedAttention paper (SOSP 2023), Fig. 16: LLaMA-13B on one A100, WMT16 En-De prompts, "
    "vLLM vs Orca (Oracle), throughput = the request rate each sustains at a latency bound"
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument(
        "--num-prompts", type=int, default=64, help="number of requests (default: 64)"
    )
    group.add_argument(
        "--prefix-len",
        type=int,
        default=341,
        help="tokens of the prefix every prompt shares: 341 = the paper's 5-shot prefix, "
        "80 = its 1-shot prefix, 0 = no sharing (default: 341)",
    )
    group.add_argument(
        "--suffix-len",
        type=float,
        default=25.0,
        help="mean tokens of each request's own suffix (log-normal, clipped to "
        "[mean/4, 4*mean]; default: 25, about a WMT16 sentence)",
    )
    group.add_argument(
        "--output-len",
        type=float,
        default=25.0,
        help="mean output tokens per request (log-normal, clipped to [mean/4, 4*mean]; "
        "default: 25)",
    )
    group.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals; inf queues all at once (default: inf)",
    )
    group.add_argument(
        "--workload-seed", type=int, default=0, help="seed of the synthetic workload (default: 0)"
    )
    group.add_argument(
        "--output-json", type=str, default=None, help="write every figure to this JSON file"
    )


# -- one system ---------------------------------------------------------------------------------
def _warm_up(engine, prompt: list[int]) -> None:
    """One tiny request run to completion, so first-call overheads are not timed."""
    engine.add_request("bench-warm-up", {"prompt_token_ids": prompt[:8]}, greedy_params(4))
    while engine.has_unfinished_requests():
        engine.step()


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def run_engine(engine, workload: SharedPrefixWorkload) -> dict[str, Any]:
    """Warm up, empty the prefix cache, then feed the requests at their arrival times (the real
    clock; each is added with its scheduled arrival as `arrival_time`, so a request added late
    still counts its wait) and step the engine until every request is done."""
    requests, offsets = workload.requests, workload.arrival_offsets
    scheduler = engine.scheduler
    kv = scheduler.kv_cache_manager
    _warm_up(engine, requests[0][0])
    if not engine.reset_prefix_cache():  # the warm-up must not seed the cache
        raise RuntimeError("could not reset the prefix cache after the warm-up")
    queries0, hits0 = kv.prefix_cache_queries, kv.prefix_cache_hits
    preemptions0 = getattr(scheduler, "num_preemptions_total", 0)

    pending = deque(range(len(requests)))
    outputs: dict[str, Any] = {}
    num_steps = 0
    cpu_before = cpu_counters()
    start = time.perf_counter()
    start_wall = time.time()
    while pending or engine.has_unfinished_requests():
        now = time.time()
        while pending and start_wall + offsets[pending[0]] <= now:
            i = pending.popleft()
            prompt, output_len = requests[i]
            engine.add_request(
                f"bench-{i}",
                {"prompt_token_ids": prompt},
                greedy_params(output_len),
                arrival_time=start_wall + offsets[i],
            )
        if engine.has_unfinished_requests():
            num_steps += 1
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output
        elif pending:  # idle until the next arrival
            time.sleep(max(0.0, start_wall + offsets[pending[0]] - time.time()))
    elapsed = time.perf_counter() - start
    others = others_cpu_share(cpu_before, cpu_counters())

    done = [outputs[f"bench-{i}"] for i in range(len(requests))]
    token_ids = [list(o.outputs[0].token_ids) for o in done]
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in done]
    latency = [o.metrics.finished_time - o.metrics.arrival_time for o in done]
    per_token = [t / max(1, len(ids)) for t, ids in zip(latency, token_ids, strict=True)]
    queries = kv.prefix_cache_queries - queries0
    hits = kv.prefix_cache_hits - hits0
    return {
        **speed_figures(requests, token_ids, sum(len(t) for t in token_ids), elapsed),
        "mean_ttft_s": _mean(ttft),
        "median_ttft_s": median(ttft),
        "mean_latency_s": _mean(latency),
        "median_latency_s": median(latency),
        "mean_latency_per_output_token_s": _mean(per_token),
        "prefix_cache": {
            "enabled": kv.enable_prefix_caching,
            "queried_tokens": queries,
            "hit_tokens": hits,
            "hit_rate": hits / queries if queries else 0.0,
        },
        "num_steps": num_steps,
        "num_preemptions": getattr(scheduler, "num_preemptions_total", 0) - preemptions0,
        "others_cpu_share": others,
        "ttft_s": ttft,
        "latency_s": latency,
        "token_ids": token_ids,
    }


def _free_engine() -> None:
    """Release a dropped engine's memory, so that the next one sizes its KV cache the same."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- reporting ----------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    """ON/OFF for throughputs, OFF/ON for times: above 1 means prefix caching helps."""
    return {
        "throughput_on_over_off": _ratio(on["requests_per_s"], off["requests_per_s"]),
        "output_tokens_per_s_on_over_off": _ratio(
            on["output_tokens_per_s"], off["output_tokens_per_s"]
        ),
        "mean_ttft_off_over_on": _ratio(off["mean_ttft_s"], on["mean_ttft_s"]),
        "median_ttft_off_over_on": _ratio(off["median_ttft_s"], on["median_ttft_s"]),
        "mean_latency_off_over_on": _ratio(off["mean_latency_s"], on["mean_latency_s"]),
    }


def outputs_identical_share(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of requests whose output token ids are identical in both runs."""
    if not a:
        return 1.0
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_table(off: dict[str, Any], on: dict[str, Any], ratios: dict[str, Any]) -> str:
    rows = [
        ("", "caching off", "caching on", "on vs off"),
        ("requests/s", _fmt(off["requests_per_s"], ".2f"), _fmt(on["requests_per_s"], ".2f"),
         _fmt(ratios["throughput_on_over_off"], ".2f") + "x"),
        ("output tokens/s", _fmt(off["output_tokens_per_s"], ".1f"),
         _fmt(on["output_tokens_per_s"], ".1f"),
         _fmt(ratios["output_tokens_per_s_on_over_off"], ".2f") + "x"),
        ("total tokens/s", _fmt(off["total_tokens_per_s"], ".1f"),
         _fmt(on["total_tokens_per_s"], ".1f"), ""),
        ("mean TTFT (s)", _fmt(off["mean_ttft_s"], ".3f"), _fmt(on["mean_ttft_s"], ".3f"),
         _fmt(ratios["mean_ttft_off_over_on"], ".2f") + "x lower"),
        ("median TTFT (s)", _fmt(off["median_ttft_s"], ".3f"), _fmt(on["median_ttft_s"], ".3f"),
         _fmt(ratios["median_ttft_off_over_on"], ".2f") + "x lower"),
        ("mean latency (s)", _fmt(off["mean_latency_s"], ".3f"),
         _fmt(on["mean_latency_s"], ".3f"),
         _fmt(ratios["mean_latency_off_over_on"], ".2f") + "x lower"),
        ("prefix-cache hit rate", f"{off['prefix_cache']['hit_rate']:.1%}",
         f"{on['prefix_cache']['hit_rate']:.1%}", ""),
        ("time (s)", _fmt(off["elapsed_s"], ".1f"), _fmt(on["elapsed_s"], ".1f"), ""),
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def paper_note(prefix_len: int, throughput_ratio: float | None) -> str:
    figures = ", ".join(
        f"{f['throughput_ratio']:.2f}x {f['shots']} ({f['prefix_len']}-token prefix)"
        for f in PAPER_FIGURES
    )
    return (
        f"throughput with prefix caching on / off: {_fmt(throughput_ratio, '.2f')}x "
        f"({prefix_len}-token prefix)\n"
        f"paper, for context only (a different model, machine and baseline; not a target): "
        f"{figures}\n  ({PAPER_SETUP})"
    )


def _print_system(name: str, r: dict[str, Any]) -> None:
    print_run(name, r)
    pc = r["prefix_cache"]
    cache = (
        f"{pc['hit_tokens']} of {pc['queried_tokens']} prompt tokens hit ({pc['hit_rate']:.1%})"
        if pc["enabled"]
        else "off"
    )
    print(
        f"[{name}] TTFT mean {_fmt(r['mean_ttft_s'], '.3f')} s, median "
        f"{_fmt(r['median_ttft_s'], '.3f')} s; latency mean {_fmt(r['mean_latency_s'], '.3f')} s; "
        f"prefix cache: {cache}; {r['num_steps']} steps, {r['num_preemptions']} preemptions"
    )


# -- the command --------------------------------------------------------------------------------
def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    if ns.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    if ns.prefix_len < 0:
        raise ValueError(f"--prefix-len must be >= 0, got {ns.prefix_len}")
    if ns.suffix_len < 1 or ns.output_len < 1:
        raise ValueError("--suffix-len and --output-len must be >= 1")
    if not ns.request_rate > 0:
        raise ValueError(f"--request-rate must be positive, got {ns.request_rate}")
    import torch

    from pagedllm.engine.llm_engine import LLMEngine

    if not engine_args.enable_prefix_caching:
        print(
            "note: --no-enable-prefix-caching is ignored; this benchmark runs both ways",
            file=sys.stderr,
        )
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(sys.argv),
        "torch_num_threads": torch.get_num_threads(),
        "engine_args": {
            k: v for k, v in dataclasses.asdict(engine_args).items() if k != "enable_prefix_caching"
        },
    }
    workload: SharedPrefixWorkload | None = None
    tokens: dict[str, list[list[int]]] = {}
    for name, enabled in (("off", False), ("on", True)):
        t0 = time.perf_counter()
        engine = LLMEngine(dataclasses.replace(engine_args, enable_prefix_caching=enabled))
        load_s = time.perf_counter() - t0
        if workload is None:
            workload = workload_for_engine(ns, engine)
            results["model"] = engine.model_name
            results["workload"] = _describe_workload(ns, workload, engine.block_size)
            _print_workload(results["workload"])
            print(f"model: {engine.model_name}; torch threads: {torch.get_num_threads()}")
        print(f"[caching {name}] {engine.model_name} loaded in {load_s:.1f} s")
        run = run_engine(engine, workload)
        tokens[name] = run.pop("token_ids")
        results[name] = run
        _print_system(f"caching {name}", run)
        expected = sum(workload.output_lens)
        if run["num_useful_output_tokens"] != expected:
            print(
                f"warning: caching {name} generated {run['num_useful_output_tokens']} useful "
                f"tokens, expected {expected}",
                file=sys.stderr,
            )
        del engine
        _free_engine()

    off, on = results["off"], results["on"]
    ratios = compare(off, on)
    results["ratios"] = ratios
    results["outputs_identical_share"] = outputs_identical_share(tokens["off"], tokens["on"])
    results["greedy_token_agreement"] = greedy_agreement(tokens["off"], tokens["on"])
    results["paper"] = {"setup": PAPER_SETUP, "figures": list(PAPER_FIGURES)}

    print()
    print(format_table(off, on, ratios))
    print(
        f"greedy outputs identical with caching on and off: "
        f"{results['outputs_identical_share']:.1%} of requests "
        f"({results['greedy_token_agreement']:.1%} of output tokens before a first divergence)"
    )
    print(paper_note(ns.prefix_len, ratios["throughput_on_over_off"]))
    if ns.output_json:
        write_json(ns.output_json, results)
    return 0


def _describe_workload(
    ns: argparse.Namespace, workload: SharedPrefixWorkload, block_size: int
) -> dict[str, Any]:
    expected_hits = workload.expected_hit_tokens(block_size)
    return {
        "num_prompts": len(workload.requests),
        "prefix_len": len(workload.prefix),
        "mean_suffix_len_requested": ns.suffix_len,
        "mean_output_len_requested": ns.output_len,
        "request_rate": ns.request_rate,
        "seed": ns.workload_seed,
        "num_prompt_tokens": workload.num_prompt_tokens,
        "num_output_tokens": sum(workload.output_lens),
        "expected_hit_tokens": expected_hits,
        "expected_hit_rate": expected_hits / workload.num_prompt_tokens,
        "suffix_lens": workload.suffix_lens,
        "output_lens": workload.output_lens,
        "arrival_offsets_s": workload.arrival_offsets,
    }


def _print_workload(w: dict[str, Any]) -> None:
    n = w["num_prompts"]
    rate = "all at once" if math.isinf(w["request_rate"]) else f"{w['request_rate']:g} requests/s"
    print(
        f"workload: {n} requests (seed {w['seed']}, {rate}) sharing a {w['prefix_len']}-token "
        f"prefix; suffixes mean {statistics.fmean(w['suffix_lens']):.1f} tokens, "
        f"{w['num_prompt_tokens']} prompt tokens, {w['num_output_tokens']} output tokens "
        f"(mean {w['num_output_tokens'] / n:.1f}); a prefix cache can serve "
        f"{w['expected_hit_tokens']} prompt tokens ({w['expected_hit_rate']:.1%})"
    )


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
