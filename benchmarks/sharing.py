"""`python -m benchmarks.sharing`: the KV-cache memory that block sharing saves (Fig. 15).

The PagedAttention paper (Kwon et al., SOSP 2023, section 6.3, Fig. 15) reports the memory that
sharing KV blocks saves when one request decodes several sequences from one prompt: parallel
sampling (n samples share the prompt's blocks) and beam search (beams share the prompt and every
common part of their histories). We measure it the same way on our engine:

    saving = 1 - physical blocks in use / blocks the same sequences would hold without sharing

Physical = blocks of the pool in use (`num_blocks - num_free_blocks`); without sharing = the sum of
the sequences' block-table lengths (`KVCacheManager.num_logical_blocks`). Prefix caching is forced
off, so the only sharing is fork / beam sharing (and a freed block really is free). Both are read
once per engine step, right after scheduling, when the step's blocks are allocated and its
copy-on-write copies made: what the KV cache holds while the step's forward pass runs. The headline
figure is the time average over steps (sum of physical / sum of logical over all steps); the mean
of the per-step savings and the saving at the step of peak physical usage are reported too.

One command runs, on each workload (Alpaca-shaped: ~19 prompt / ~58 output tokens; ShareGPT-shaped
at `--scale`), parallel sampling with n = 1 (a sanity check: nothing is shared, the saving must be
0), 2, 4, 6 (random sampling, temperature 1, a seed per request, `ignore_eos`, each request's own
output length as `max_tokens`), then beam search of width 2, 4, 6 (`ignore_eos`, so every search
runs to the request's output length). All of a run's requests are queued at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

from benchmarks import common
from pagedllm.bench.utils import cpu_counters, others_cpu_share, write_json
from pagedllm.bench.workload import (
    WORKLOAD_SHAPES,
    WorkloadRequest,
    workload_from_tokenizer,
    workload_tokenizer,
)
from pagedllm.config import EngineArgs

MODES = ("sampling", "beam")

# The paper's Fig. 15 (OPT-13B): memory saved by sharing, lowest (n / width 2) to highest (6).
PAPER_SAVINGS = {
    ("alpaca", "sampling"): (6.1, 9.8),
    ("sharegpt", "sampling"): (16.2, 30.5),
    ("alpaca", "beam"): (37.6, 55.2),
    ("sharegpt", "beam"): (44.3, 66.3),
}
PAPER_SETUP = (
    "PagedAttention paper (SOSP 2023), Fig. 15: OPT-13B on the Alpaca and ShareGPT traces, "
    "parallel sampling and beam search with n / width 2 to 6"
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument(
        "--num-prompts",
        type=int,
        default=16,
        help="requests per workload, queued at once in every run (default: 16)",
    )
    group.add_argument(
        "--workloads",
        type=common.choice_list(WORKLOAD_SHAPES, "workloads"),
        default=["alpaca", "sharegpt"],
        help="comma-separated: alpaca (~19 prompt / ~58 output tokens), sharegpt "
        "(default: alpaca,sharegpt)",
    )
    group.add_argument(
        "--scale",
        type=float,
        default=0.25,
        help="length scale of the ShareGPT-shaped workload, as in bench throughput (default: "
        "0.25); the Alpaca-shaped one always runs at its own lengths",
    )
    group.add_argument(
        "--parallel-n",
        type=common.int_list,
        default=[2, 4, 6],
        help="parallel sampling: the numbers of samples per request (default: 2,4,6); "
        "n=1 always runs first as a sanity check",
    )
    group.add_argument(
        "--beam-widths",
        type=common.int_list,
        default=[2, 4, 6],
        help="beam search widths (default: 2,4,6; an empty string skips beam search)",
    )
    group.add_argument(
        "--workload-seed",
        type=int,
        default=0,
        help="seed of the synthetic workloads and of the samplers (default: 0)",
    )
    group.add_argument(
        "--output-json", type=str, default=None, help="write every figure to this JSON file"
    )


# -- measurement --------------------------------------------------------------------------------
class SharingTracker:
    """Physical vs logical KV blocks, one sample per engine step."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.sum_physical = 0
        self.sum_logical = 0
        self.sum_step_savings = 0.0
        self.peak_physical = 0
        self.logical_at_peak = 0
        self.max_step_saving = 0.0

    def observe(self, physical: int, logical: int) -> None:
        if logical <= 0:
            return
        self.num_steps += 1
        self.sum_physical += physical
        self.sum_logical += logical
        saving = 1.0 - physical / logical
        self.sum_step_savings += saving
        self.max_step_saving = max(self.max_step_saving, saving)
        if physical > self.peak_physical:
            self.peak_physical, self.logical_at_peak = physical, logical

    def observe_kv(self, kv_cache_manager) -> None:
        kv = kv_cache_manager
        self.observe(kv.num_blocks - kv.num_free_blocks, kv.num_logical_blocks)

    @property
    def saving(self) -> float:
        """The time average: 1 - (sum of physical) / (sum of logical) over all steps."""
        return 1.0 - self.sum_physical / self.sum_logical if self.sum_logical else 0.0

    @property
    def mean_step_saving(self) -> float:
        return self.sum_step_savings / self.num_steps if self.num_steps else 0.0

    @property
    def saving_at_peak(self) -> float:
        return 1.0 - self.peak_physical / self.logical_at_peak if self.logical_at_peak else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "saving": self.saving,
            "mean_step_saving": self.mean_step_saving,
            "saving_at_peak": self.saving_at_peak,
            "max_step_saving": self.max_step_saving,
            "num_steps": self.num_steps,
            "sum_physical_blocks": self.sum_physical,
            "sum_logical_blocks": self.sum_logical,
            "peak_physical_blocks": self.peak_physical,
            "logical_blocks_at_peak": self.logical_at_peak,
        }


def sampling_params_for(mode: str, n: int, output_len: int, seed: int):
    """One request's parameters: `n` seeded samples at temperature 1, or a beam search of width
    `n`; either way exactly `output_len` tokens per sequence (`ignore_eos`)."""
    from pagedllm.sampling_params import BeamSearchParams, SamplingParams

    if mode == "sampling":
        return SamplingParams(
            n=n, temperature=1.0, seed=seed, ignore_eos=True, max_tokens=output_len
        )
    if mode == "beam":
        return BeamSearchParams(
            beam_width=n, max_tokens=output_len, ignore_eos=True
        ).to_sampling_params()
    raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")


def run_sharing(
    engine, requests: list[WorkloadRequest], mode: str, n: int, seed: int = 0
) -> dict[str, Any]:
    """Queue every request with `n` samples (or beams), step the engine until all finish, and
    return the sharing figures (see `SharingTracker`) with a few run statistics."""
    scheduler = engine.scheduler
    kv = scheduler.kv_cache_manager
    if kv.enable_prefix_caching:
        raise ValueError("the sharing benchmark needs an engine with prefix caching off")
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine still has requests in flight")
    tracker = SharingTracker()
    copied0 = kv.num_copied_blocks
    preemptions0 = scheduler.num_preemptions_total
    schedule = scheduler.schedule

    def schedule_and_observe():
        output = schedule()
        if not output.is_empty:
            tracker.observe_kv(kv)
        return output

    ids = []
    cpu_before = cpu_counters()
    start = time.perf_counter()
    scheduler.schedule = schedule_and_observe  # shadows the method on this instance only
    try:
        for i, (prompt, output_len) in enumerate(requests):
            # Sample j of request i draws from seed + j: keep the requests' seeds apart.
            params = sampling_params_for(mode, n, output_len, (seed * 1_000_003 + i) * 1024)
            ids.append(engine.add_request(None, {"prompt_token_ids": prompt}, params))
        num_output_tokens = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
    except BaseException:
        engine.abort_request(ids)
        raise
    finally:
        del scheduler.schedule
    elapsed = time.perf_counter() - start
    others = others_cpu_share(cpu_before, cpu_counters())
    return {
        "mode": mode,
        "n": n,
        **tracker.as_dict(),
        "num_requests": len(requests),
        "num_output_tokens": num_output_tokens,
        "num_copied_blocks": kv.num_copied_blocks - copied0,
        "num_preemptions": scheduler.num_preemptions_total - preemptions0,
        "elapsed_s": elapsed,
        # The savings do not depend on speed; this only says whether elapsed_s is worth quoting.
        "others_cpu_share": others,
    }


# -- reporting ----------------------------------------------------------------------------------
def paper_range(workload: str, mode: str) -> str:
    lo_hi = PAPER_SAVINGS.get((workload, mode))
    return "" if lo_hi is None else f"{lo_hi[0]:.1f}-{lo_hi[1]:.1f}%"


def format_table(runs: list[dict[str, Any]]) -> str:
    rows = [
        (
            "workload", "mode", "n / width", "memory saved", "mean per step", "at peak",
            "paper (OPT-13B, n 2-6)",
        )
    ]  # fmt: skip
    for r in runs:
        mode = "parallel sampling" if r["mode"] == "sampling" else "beam search"
        rows.append(
            (
                r["workload"],
                mode,
                str(r["n"]),
                f"{r['saving']:.1%}",
                f"{r['mean_step_saving']:.1%}",
                f"{r['saving_at_peak']:.1%}",
                paper_range(r["workload"], r["mode"]) if r["n"] > 1 else "(sanity: 0)",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        left = [c.ljust(w) for c, w in zip(row[:2], widths[:2], strict=True)]
        right = [c.rjust(w) for c, w in zip(row[2:-1], widths[2:-1], strict=True)]
        lines.append("  ".join([*left, *right, row[-1].ljust(widths[-1])]).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _describe_workload(shape: str, scale: float, seed: int, requests) -> dict[str, Any]:
    input_lens = [len(p) for p, _ in requests]
    output_lens = [n for _, n in requests]
    return {
        "shape": shape,
        "scale": scale,
        "seed": seed,
        "num_prompts": len(requests),
        "mean_input_len": sum(input_lens) / len(requests),
        "mean_output_len": sum(output_lens) / len(requests),
        "input_lens": input_lens,
        "output_lens": output_lens,
    }


def print_run(r: dict[str, Any]) -> None:
    others = r.get("others_cpu_share")
    busy = f" (other processes: {others:.0%} of the CPU)" if others and others > 0.1 else ""
    print(
        f"[{r['workload']} {r['mode']} n={r['n']}] saved {r['saving']:.1%} of KV blocks "
        f"(time average; {r['mean_step_saving']:.1%} mean per step, {r['saving_at_peak']:.1%} at "
        f"the peak of {r['peak_physical_blocks']} blocks in use vs {r['logical_blocks_at_peak']} "
        f"unshared); {r['num_steps']} steps, {r['num_copied_blocks']} copy-on-write copies, "
        f"{r['num_preemptions']} preemptions, {r['elapsed_s']:.1f} s{busy}",
        flush=True,
    )


# -- the command --------------------------------------------------------------------------------
def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    if ns.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    if ns.scale <= 0:
        raise ValueError(f"--scale must be positive, got {ns.scale}")
    import torch

    from pagedllm.engine.llm_engine import LLMEngine

    # Prefix caching off, always: the only sharing measured is that of forks and beams.
    engine_args = dataclasses.replace(engine_args, enable_prefix_caching=False)
    widest = max([1, *ns.parallel_n, *ns.beam_widths])
    if widest > engine_args.max_num_seqs:
        raise ValueError(
            f"n / beam width {widest} exceeds --max-num-seqs {engine_args.max_num_seqs}"
        )
    t0 = time.perf_counter()
    engine = LLMEngine(engine_args)
    print(
        f"model: {engine.model_name}, loaded in {time.perf_counter() - t0:.1f} s; block size "
        f"{engine.block_size}, {engine.num_blocks} KV blocks; prefix caching off (forced); "
        f"torch threads: {torch.get_num_threads()}"
    )
    vocab_size = engine.model_config.vocab_size
    tokenizer = workload_tokenizer(engine)  # without one, every id of the embedding table

    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(sys.argv),
        "model": engine.model_name,
        "torch_num_threads": torch.get_num_threads(),
        "engine_args": dataclasses.asdict(engine_args),
        "block_size": engine.block_size,
        "num_kv_blocks": engine.num_blocks,
        "workloads": {},
        "runs": [],
        "paper": {
            "setup": PAPER_SETUP,
            "savings_percent": {f"{w}/{m}": list(v) for (w, m), v in PAPER_SAVINGS.items()},
        },
    }
    plan = [("sampling", 1), *(("sampling", n) for n in ns.parallel_n)]
    plan += [("beam", w) for w in ns.beam_widths]
    for shape in ns.workloads:
        scale = ns.scale if shape == "sharegpt" else 1.0
        requests = workload_from_tokenizer(
            ns.num_prompts, tokenizer, vocab_size=vocab_size, scale=scale,
            seed=ns.workload_seed, max_model_len=engine.max_model_len, shape=shape,
        )  # fmt: skip
        described = _describe_workload(shape, scale, ns.workload_seed, requests)
        results["workloads"][shape] = described
        print(
            f"workload {shape} (scale {scale:g}, seed {ns.workload_seed}): {len(requests)} "
            f"requests, prompts mean {described['mean_input_len']:.1f} tokens, outputs mean "
            f"{described['mean_output_len']:.1f} tokens",
            flush=True,
        )
        for mode, n in plan:
            run = {"workload": shape, **run_sharing(engine, requests, mode, n, ns.workload_seed)}
            results["runs"].append(run)
            print_run(run)

    sanity = {r["workload"]: r["saving"] for r in results["runs"] if r["n"] == 1}
    results["sanity_n1_saving"] = sanity
    print()
    print(format_table(results["runs"]))
    print(
        "sanity: n=1 shares nothing, so it must save 0: "
        + ", ".join(f"{w} {s:.2%}" for w, s in sanity.items())
        + ("" if all(s == 0 for s in sanity.values()) else "  <-- NOT ZERO: a bug")
    )
    print(
        f"paper, for context only (another model, block size and trace; not a target): "
        f"{PAPER_SETUP}"
    )
    if ns.output_json:
        write_json(ns.output_json, results)
    return 0 if all(s == 0 for s in sanity.values()) else 1


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
