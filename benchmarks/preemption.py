"""`python -m benchmarks.preemption`: what preemption costs, swap vs recompute (paper Fig. 19).

When the KV-cache pool runs dry, the scheduler preempts the latest-arrived running group. Mode
"swap" copies its blocks to a CPU swap pool and back when it resumes; mode "recompute" drops them
and later re-prefills its prompt + generated tokens. Two measurements, `--part recovery|throughput`:

**Recovery time vs block size** (the PagedAttention paper, SOSP 2023, section 7.3, Fig. 19a).
The model is loaded once (an engine, for its flags: model, dtype, device, attention backend);
for each block size a `ModelRunner` over it gets its own KV pool and swap pool, and a
`KVCacheManager` (prefix caching off) the block table of one sequence holding `context_len`
tokens (a prompt and generated tokens, half each). Its recovery is timed as the engine's steps
run it, through `ModelRunner.execute_model` with a `SchedulerOutput`:

- swap: the step that swaps the group out (`KVCacheManager.swap_out`'s (device, cpu) pairs, run by
  `ModelRunner.execute_model` as one batched copy) plus the step that swaps it back in (to fresh
  device blocks); median over `--swap-repeats` round trips, each checked to bring back the K/V
  bit for bit. The block-table bookkeeping of both (torch-free) is timed apart.
- recompute: the runner's step that prefills all `context_len` tokens again as one chunk into
  fresh blocks (as the scheduler re-admits a group preempted for recompute), sampling the next
  token as that step does; median over `--repeats`. This is the worst case: with prefix caching
  on, the engine re-admits a group at its longest cached prefix, which may be most of it.

**Throughput as the pool shrinks** (what preemption costs end to end). The ShareGPT-shaped workload
of `bench throughput` (greedy, ignore_eos, each request's own output length, all queued at once)
runs with the KV pool set to fractions of its demand, in each preemption mode. Demand = the blocks
every request fills if all run at once: cdiv(prompt + output - 1, block_size) per request (the
last sampled token is never fed back, so its K/V are never written). `max_model_len` is the
longest request rounded up to a whole block, so that the engine's start-up check (the pool holds
one such request) admits small pools; a fraction below one request is raised to it, and said so.
Swap mode gets a swap space as large as the pool. Greedy outputs must not depend on the pool or
the mode: each run is compared with the 100% run of its mode, and a mismatch is reported as a bug.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from typing import Any

from benchmarks import common
from benchmarks.common import choice_list, int_list
from benchmarks.preemption_pool import print_throughput, run_throughput
from benchmarks.preemption_recovery import print_recovery, run_recovery
from pagedllm.bench.utils import write_json
from pagedllm.bench.workload import workload_tokenizer
from pagedllm.config import EngineArgs
from pagedllm.core.kv_cache_spec import cdiv

PARTS = ("recovery", "throughput")
MODES = ("recompute", "swap")
DEFAULT_BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
DEFAULT_CONTEXT_LENS = [256, 1024]
DEFAULT_POOL_FRACTIONS = [1.0, 0.5, 0.25, 0.1]

# Engine flags this benchmark sets itself (the rest are honoured as given).
_OVERRIDDEN = (
    "max_model_len",
    "num_gpu_blocks_override",
    "kv_cache_memory",
    "preemption_mode",
    "swap_space",
)


# -- command line -------------------------------------------------------------------------------
def _fraction_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"pool fractions must be in (0, 1], got {text!r}")
    return values


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument(
        "--part",
        choices=(*PARTS, "all"),
        default="all",
        help="recovery: swap vs recompute time of one preempted group by block size; "
        "throughput: the workload as the KV pool shrinks; all: both (default: all)",
    )
    group.add_argument(
        "--block-sizes",
        type=int_list,
        default=list(DEFAULT_BLOCK_SIZES),
        help="recovery: block sizes (default: 1,2,4,8,16,32,64,128); the throughput part uses "
        "--block-size",
    )
    group.add_argument(
        "--context-lens",
        "--context-len",
        type=int_list,
        default=list(DEFAULT_CONTEXT_LENS),
        help="recovery: tokens (prompt + generated) of the preempted group (default: 256,1024)",
    )
    group.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="recovery: timed recomputations per point, median reported (default: 5)",
    )
    group.add_argument(
        "--swap-repeats",
        type=int,
        default=20,
        help="recovery: timed swap round trips per point, median reported (default: 20)",
    )
    group.add_argument(
        "--num-prompts",
        type=int,
        default=32,
        help="throughput: number of requests, queued at once (default: 32)",
    )
    group.add_argument(
        "--scale",
        type=float,
        default=0.25,
        help="throughput: length scale of the ShareGPT-shaped workload, as in bench throughput "
        "(default: 0.25)",
    )
    group.add_argument(
        "--workload-seed", type=int, default=0, help="seed of the synthetic workload (default: 0)"
    )
    group.add_argument(
        "--pool-fractions",
        type=_fraction_list,
        default=list(DEFAULT_POOL_FRACTIONS),
        help="throughput: KV pool sizes as fractions of the workload's demand (default: "
        "1,0.5,0.25,0.1; 1 always runs, as the reference)",
    )
    group.add_argument(
        "--modes",
        type=choice_list(MODES, "modes"),
        default=list(MODES),
        help="throughput: preemption modes (default: recompute,swap)",
    )
    group.add_argument(
        "--output-json", type=str, default=None, help="write every figure to this JSON file"
    )


# -- the command --------------------------------------------------------------------------------
def _check_args(ns: argparse.Namespace) -> None:
    if ns.repeats < 1 or ns.swap_repeats < 1:
        raise ValueError("--repeats and --swap-repeats must be >= 1")
    if ns.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    if not ns.scale > 0:
        raise ValueError(f"--scale must be positive, got {ns.scale}")


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    _check_args(ns)
    import torch

    from pagedllm.engine.llm_engine import LLMEngine

    parts = PARTS if ns.part == "all" else (ns.part,)
    defaults = EngineArgs()
    ignored = [f for f in _OVERRIDDEN if getattr(engine_args, f) != getattr(defaults, f)]
    if ignored:
        print(
            f"note: this benchmark sets {', '.join('--' + f.replace('_', '-') for f in ignored)} "
            "itself; the values given are ignored"
            + (" (--max-model-len still caps the workload)" if "max_model_len" in ignored else ""),
            file=sys.stderr,
        )
    # One engine with a token-sized pool, for the model (recovery part) and its tokenizer.
    base_args = dataclasses.replace(
        engine_args, max_model_len=16, num_gpu_blocks_override=cdiv(16, engine_args.block_size),
        kv_cache_memory=None, preemption_mode="recompute", enable_prefix_caching=False,
    )  # fmt: skip
    t0 = time.perf_counter()
    base = LLMEngine(base_args)
    print(
        f"model: {base.model_name}, loaded in {time.perf_counter() - t0:.1f} s; {base.device}, "
        f"{str(base.dtype).removeprefix('torch.')}; torch threads: {torch.get_num_threads()}",
        flush=True,
    )
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(sys.argv),
        "model": base.model_name,
        "torch_num_threads": torch.get_num_threads(),
        "engine_args": dataclasses.asdict(engine_args),
        "parts": list(parts),
    }
    ok = True
    if "recovery" in parts:
        recovery = run_recovery(base, ns)
        results["recovery"] = recovery
        print_recovery(recovery)
        exact = all(p["swap_round_trip_exact"] for p in recovery["points"])
        if not exact:
            print("SWAP ROUND TRIPS CHANGED THE K/V: a bug", file=sys.stderr)
        ok = ok and exact
    model_info = {
        "tokenizer": workload_tokenizer(base),  # without one, every id of the embedding table
        "vocab_size": base.model_config.vocab_size,
        "config": base.model_config,
        "dtype": base.dtype,
        "max_position_embeddings": base.model_config.max_position_embeddings,
    }
    del base
    gc.collect()
    if "throughput" in parts:
        if "recovery" in parts:
            print()
        throughput, identical = run_throughput(engine_args, ns, model_info)
        results["throughput"] = throughput
        print_throughput(throughput)
        ok = ok and identical
    if ns.output_json:
        write_json(ns.output_json, results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
