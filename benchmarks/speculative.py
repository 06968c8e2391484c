"""`python -m benchmarks.speculative`: speculative decoding's speed, each method against none in
the same run (docs/speculative_decoding.md).

For each workload (benchmarks/spec_workloads.py: `code-edit`, `rewrite`, `multi-turn`, whose
answers repeat their prompts, and `random`, where drafts rarely hold) and each concurrency
(`--concurrencies`, requests kept in flight by a closed loop: a new one as one finishes), every
method of `--methods` runs the same greedy requests on its own engine (the same engine flags,
plus its --speculative-config): output tokens/s and its ratio to `none`, the drafts' acceptance
rate (accepted / drafted tokens) and mean acceptance length (tokens a verifying step yields: 1 +
accepted / drafts). Outputs must agree with `none`'s (greedy, or sampled with `--temperature`
from per-request seeds); the share that do is printed. With `--llama-server`, llama.cpp's
server runs the same requests at concurrency 1, without speculation and with its draft-free
`--spec-type`s (benchmarks/spec_llama.py), each against its own run without.

    python -m benchmarks.speculative [--workloads code-edit,rewrite,multi-turn,random]
        [--concurrencies 1,8,32] [--methods none,ngram,suffix,draft_model]
        [--num-speculative-tokens 5] [--disable-by-batch-size N | none]
        [--llama-server PATH [--llama-spec-types none,ngram-simple,...]]
        [--num-prompts 16] [--max-tokens 128] [engine flags]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from benchmarks import common
from benchmarks.spec_llama import SPEC_TYPES, run_llama_server
from benchmarks.spec_workloads import WORKLOADS, requests_for
from pagedllm.bench.utils import table_lines, write_json
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.model_loader.loader import resolve_model
from pagedllm.sampling_params import SamplingParams

METHODS = ("none", "ngram", "suffix", "draft_model")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative")
    group.add_argument("--workloads", type=common.choice_list(WORKLOADS, "workload"),
                       default=list(WORKLOADS), help="comma-separated (default: all)")  # fmt: skip
    group.add_argument("--concurrencies", type=common.nonempty(common.int_list),
                       default=[1, 8, 32], help="requests in flight (default: 1,8,32)")  # fmt: skip
    group.add_argument("--methods", type=common.choice_list(METHODS, "method"),
                       default=list(METHODS),
                       help="none,ngram,suffix,draft_model (default: all; draft_model drafts "
                       "with the target's own weights as int4 codes)")  # fmt: skip
    group.add_argument("--num-speculative-tokens", type=int, default=5)
    group.add_argument("--disable-by-batch-size", type=_batch_size, default="default",
                       help="drafts only in steps of at most this many requests; 'none': at any "
                       "batch size (default: the method's default)")  # fmt: skip
    group.add_argument("--num-prompts", type=int, default=16,
                       help="requests per workload and concurrency (default: 16)")  # fmt: skip
    group.add_argument("--max-tokens", type=int, default=128)
    group.add_argument("--temperature", type=float, default=0.0,
                       help="0: greedy; above, each request seeded by its index, so that "
                       "every method samples the same tokens (default: 0)")  # fmt: skip
    group.add_argument("--workload-seed", type=int, default=0)
    group.add_argument("--llama-server", help="also run this llama-server binary at "
                       "concurrency 1 (benchmarks/build_llama_server.sh builds one)")  # fmt: skip
    group.add_argument("--llama-spec-types", type=common.choice_list(SPEC_TYPES, "spec type"),
                       default=list(SPEC_TYPES),
                       help="its --spec-type values (default: all draft-free ones)")  # fmt: skip
    group.add_argument("--output-json", help="write the results here")


def _batch_size(text: str) -> int | str | None:
    if text in ("none", "default"):
        return None if text == "none" else text
    return int(text)


def spec_config(method: str, ns: argparse.Namespace) -> dict | None:
    if method == "none":
        return None
    config = {"method": method, "num_speculative_tokens": ns.num_speculative_tokens}
    if ns.disable_by_batch_size != "default":
        config["disable_by_batch_size"] = ns.disable_by_batch_size
    return config


def run_closed_loop(
    engine: LLMEngine, requests, concurrency: int, temperature: float = 0.0
) -> dict:
    """The requests with at most `concurrency` in flight; tokens, time and the drafts."""
    before = dataclasses.replace(engine.scheduler.spec_decode_stats)
    pending = list(enumerate(requests))[::-1]
    outputs: dict[int, list[int]] = {}
    in_flight = 0
    start = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, (prompt, max_tokens, ignore_eos) = pending.pop()
            params = SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens,
                                    ignore_eos=ignore_eos)  # fmt: skip
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                outputs[int(out.request_id[1:])] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    after = engine.scheduler.spec_decode_stats
    drafts = after.num_drafts - before.num_drafts
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    tokens = sum(len(t) for t in outputs.values())
    return {
        "outputs": [outputs[i] for i in range(len(requests))],
        "output_tokens": tokens,
        "seconds": seconds,
        "output_tokens_per_s": tokens / seconds,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def main(ns: argparse.Namespace, engine_args) -> int:
    engines = {
        m: LLMEngine(dataclasses.replace(engine_args, speculative_config=spec_config(m, ns)))
        for m in ns.methods
    }
    first = next(iter(engines.values()))
    results, rows = [], [("workload", "conc.", "method", "tok/s", "vs none", "accept",
                          "mean len", "same")]  # fmt: skip
    for workload in ns.workloads:
        for concurrency in ns.concurrencies:
            # Other requests at each concurrency: the suffix cache would know the outputs.
            seed = ns.workload_seed + concurrency
            requests = requests_for(first, workload, ns.num_prompts, seed, ns.max_tokens)
            runs = {
                m: run_closed_loop(e, requests, concurrency, ns.temperature)
                for m, e in engines.items()
            }
            if ns.llama_server and concurrency == 1:
                gguf = resolve_model(engine_args.model)
                for spec_type in ns.llama_spec_types:
                    runs[f"llama.cpp {spec_type}"] = run_llama_server(
                        ns.llama_server, gguf, requests, spec_type, ns.num_speculative_tokens
                    )
            for method, r in runs.items():
                # llama.cpp against its own run without speculation (its numerics differ)
                base = runs.get("llama.cpp none" if method.startswith("llama") else "none")
                ratio = r["output_tokens_per_s"] / base["output_tokens_per_s"] if base else None
                same = (sum(a == b for a, b in zip(r["outputs"], base["outputs"], strict=True))
                        / len(requests)) if base else None  # fmt: skip
                results.append({"workload": workload, "concurrency": concurrency,
                                "method": method, "vs_none": ratio, "same_as_none": same,
                                **{k: v for k, v in r.items() if k != "outputs"}})  # fmt: skip
                rows.append((
                    workload, str(concurrency), method, f"{r['output_tokens_per_s']:.1f}",
                    "" if ratio is None else f"{ratio:.2f}x",
                    "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}",
                    "" if r["mean_acceptance_length"] is None
                    else f"{r['mean_acceptance_length']:.2f}",
                    "" if same is None else f"{same:.0%}",
                ))  # fmt: skip
            print("\n".join(table_lines([rows[0], *rows[-len(runs) :]])), flush=True)
    print()
    print("\n".join(table_lines(rows)))
    if ns.output_json:
        write_json(ns.output_json, {"command": sys.argv, "results": results})
    for engine in engines.values():
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
