"""`python -m benchmarks.load`: normalized latency vs request rate per KV allocation policy (the
PagedAttention paper's Figures 12 and 13).

For each workload (ShareGPT- or Alpaca-shaped, see workload.py), each allocation policy and each
request rate, the same requests arrive as a seeded Poisson process and run greedily to exactly
their own output length (ignore_eos). The policies share one engine (the model is loaded once)
and one KV pool of the same size; only the block manager differs:
- "paged": pagedllm's block tables (blocks allocated as tokens arrive);
- "max": a contiguous region of max_model_len slots per request, reserved on admission;
- "pow2": the prompt plus the output length rounded up to a power of two;
- "oracle": exactly prompt + output (an allocator that knows the future);
the contiguous regions placed by a buddy allocator (`--allocator first-fit` for the other).
Prefix caching is off, as in the paper (the contiguous policies do not have it).

The virtual clock. Arrivals are driven on a clock that only the engine's steps advance: every
request whose arrival time is <= the clock is added; if nothing is in flight, the clock jumps to
the next arrival; otherwise one `engine.step()` runs, its wall time is measured and the clock
advances by exactly that much. This gives the same latencies as a real-time run, because the
engine does work only inside steps: between steps, and while it waits idle for a request, nothing
changes its state, so skipping the idle gaps (instead of sleeping through them) changes no
latency, and a run of a 10-minute trace takes only its busy time. (A real-time server also adds
a request between two steps, so a request arriving during a step waits for its end here too.)

Per request, normalized latency = (finish time - arrival time) / output tokens, in seconds per
token; a run reports its mean (the paper's y axis). Mean batched requests = the number of
requests in the running batch, averaged over the engine steps that ran (the paper's Fig. 13).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks import common
from benchmarks.kv_waste import KVSlotBreakdown
from pagedllm.bench.utils import (
    cpu_counters,
    greedy_params,
    others_cpu_share,
    table_lines,
    write_json,
)
from pagedllm.bench.workload import (
    WORKLOAD_SHAPES,
    WorkloadRequest,
    workload_from_tokenizer,
    workload_tokenizer,
)
from pagedllm.config import KV_ALLOCATIONS, KV_ALLOCATORS, EngineArgs

POLICIES = KV_ALLOCATIONS  # paged, max, pow2, oracle
# The runs in docs/benchmarks.md (about 25 minutes on 2 cores for both workloads).
DEFAULT_RATES = {"sharegpt": [0.5, 1.0, 2.0], "alpaca": [1.0, 2.0, 4.0]}
DEFAULT_KV_CACHE_MEMORY = "256MiB"  # SmolLM2-135M in float32: 5825 token slots
DEFAULT_MAX_MODEL_LEN = 1024
DEFAULT_LATENCY_CAP = 1.0  # s/token: the plots' y axis stops here, as the paper's do


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument("--policies", type=common.str_list, default=list(POLICIES),
                       help="KV allocation policies, comma-separated "
                       "(default: paged,max,pow2,oracle)")  # fmt: skip
    for shape in WORKLOAD_SHAPES:
        default = ",".join(f"{r:g}" for r in DEFAULT_RATES[shape])
        group.add_argument(f"--{shape}-rates", type=common.float_list, default=DEFAULT_RATES[shape],
                           help=f"request rates (req/s) of the {shape} workload "
                           f"(default: {default})")  # fmt: skip
    group.add_argument("--allocator", choices=KV_ALLOCATORS, default="buddy",
                       help="placement of the contiguous regions: buddy (the paper's Orca "
                       "baselines) or first-fit (default: buddy)")  # fmt: skip
    group.add_argument("--latency-cap", type=float, default=DEFAULT_LATENCY_CAP,
                       help="top of the plot's latency axis, s/token (default: 1)")  # fmt: skip
    common.add_workload_args(group)


# -- arrivals and the virtual-clock driver ------------------------------------------------------
def poisson_arrivals(num: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (s) of a Poisson process of `rate` requests/s: seeded exponential gaps."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num)
    return np.cumsum(gaps).tolist()


def drive(
    engine,
    requests: Sequence[WorkloadRequest],
    arrivals: Sequence[float],
    *,
    timer: Callable[[], float] = time.perf_counter,
    breakdown=None,
    id_prefix: str = "load",
    keep_trace: bool = False,
) -> dict[str, Any]:
    """Run `requests` arriving at `arrivals` through an idle `engine` on a virtual clock (see
    the module docstring); `timer` measures a step (tests pass a fake one). `breakdown` (a
    KVSlotBreakdown) observes the block manager after every step."""
    if len(requests) != len(arrivals):
        raise ValueError("one arrival time per request")
    if any(b < a for a, b in zip(arrivals, arrivals[1:], strict=False)):
        raise ValueError("arrival times must not decrease")
    if engine.has_unfinished_requests():
        raise ValueError("the engine must be idle")
    scheduler = engine.scheduler
    preemptions_before = scheduler.num_preemptions_total
    ids = [f"{id_prefix}-{i}" for i in range(len(requests))]
    index = {rid: i for i, rid in enumerate(ids)}
    final_lens: dict[str, int] = {}  # in flight: request id -> prompt + output length
    finish = [None] * len(requests)
    num_output = [0] * len(requests)
    failed = 0
    batch_sizes: list[int] = []
    trace: list[tuple[float, int]] = []
    clock = busy = 0.0
    nxt = idle_steps = 0
    while nxt < len(requests) or engine.has_unfinished_requests():
        while nxt < len(requests) and arrivals[nxt] <= clock:
            prompt, output_len = requests[nxt]
            engine.add_request(ids[nxt], prompt, greedy_params(output_len))
            final_lens[ids[nxt]] = len(prompt) + output_len
            nxt += 1
        if not engine.has_unfinished_requests():
            clock = max(clock, arrivals[nxt])  # idle: nothing happens until the next arrival
            continue
        start = timer()
        outputs = engine.step()
        elapsed = timer() - start
        if elapsed < 0:
            raise RuntimeError("the step timer went backwards")
        clock += elapsed
        busy += elapsed
        finished = [o for o in outputs if o.finished]
        batch = scheduler.num_running + len(finished)  # requests in this step's batch
        for out in finished:
            i = index[out.request_id]
            finish[i] = clock
            num_output[i] = len(out.outputs[0].token_ids) if out.outputs else 0
            failed += out.error is not None
        if breakdown is not None:
            breakdown.observe(scheduler, final_lens)
        for out in finished:
            final_lens.pop(out.request_id, None)
        if batch:
            batch_sizes.append(batch)
            idle_steps = 0
        else:
            idle_steps += 1
            if idle_steps > 1000:
                raise RuntimeError("the engine makes no progress: does a request fit the pool?")
        if keep_trace:
            trace.append((clock, batch))

    latencies = [
        (f - a) / n
        for f, a, (_, n) in zip(finish, arrivals, requests, strict=True)
        if f is not None  # (a request the engine dropped without a final output)
    ]
    makespan = clock - (arrivals[0] if arrivals else 0.0)
    useful = sum(min(got, n) for got, (_, n) in zip(num_output, requests, strict=True))
    result: dict[str, Any] = {
        "num_requests": len(requests),
        "num_finished": sum(f is not None for f in finish),
        "num_failed": failed,
        "num_output_tokens": sum(num_output),
        "num_expected_output_tokens": sum(n for _, n in requests),
        "mean_normalized_latency_s": float(np.mean(latencies)) if latencies else 0.0,
        "p50_normalized_latency_s": float(np.percentile(latencies, 50)) if latencies else 0.0,
        "p90_normalized_latency_s": float(np.percentile(latencies, 90)) if latencies else 0.0,
        "makespan_s": makespan,
        "busy_s": busy,
        "requests_per_s": len(requests) / makespan if makespan > 0 else 0.0,
        "output_tokens_per_s": useful / makespan if makespan > 0 else 0.0,
        "num_steps": len(batch_sizes),
        "mean_batched_requests": float(np.mean(batch_sizes)) if batch_sizes else 0.0,
        "max_batched_requests": max(batch_sizes, default=0),
        "num_preemptions": scheduler.num_preemptions_total - preemptions_before,
    }
    if breakdown is not None:
        result["kv_breakdown"] = breakdown.to_dict()
    if keep_trace:
        result["trace"] = trace
        result["finish_times"] = finish
        result["normalized_latencies"] = latencies
    return result


# -- engine set-up ------------------------------------------------------------------------------
def with_policy(engine, policy: str, allocator: str = "buddy"):
    """A fresh engine on an idle engine's executor (its model and KV pool) whose block manager
    follows `policy`: paged with prefix caching off, or a contiguous one placed by
    `allocator`."""
    from pagedllm.core.contiguous_kv_cache_manager import ContiguousKVCacheManager
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.engine.llm_engine import LLMEngine

    if engine.has_unfinished_requests():
        raise ValueError("the engine must be idle to change its allocation policy")
    if policy not in POLICIES:
        raise ValueError(f"unknown KV allocation policy {policy!r}")

    def manager(config, num_blocks: int, num_cpu_blocks: int, windows):
        block_size = config.cache.block_size
        if policy == "paged":
            return KVCacheManager(num_blocks, block_size, False, num_cpu_blocks, windows)
        if windows != [None]:
            raise ValueError(f"policy {policy} is for full-attention models only: use paged")
        return ContiguousKVCacheManager(
            num_blocks, block_size, policy, config.scheduler.max_model_len, allocator
        )

    args = dataclasses.replace(engine.args, kv_allocation=policy, enable_prefix_caching=False)
    return LLMEngine(args, executor=engine.executor, kv_cache_manager=manager)


def make_workloads(engine, ns: argparse.Namespace) -> dict[str, list[WorkloadRequest]]:
    scales = {"sharegpt": ns.sharegpt_scale, "alpaca": ns.alpaca_scale}
    unknown = [w for w in ns.workloads if w not in WORKLOAD_SHAPES]
    if unknown or not ns.workloads:
        raise ValueError(f"--workloads: choose among {', '.join(WORKLOAD_SHAPES)}")
    if ns.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    return {
        shape: workload_from_tokenizer(
            ns.num_prompts,
            workload_tokenizer(engine),
            vocab_size=engine.model_config.vocab_size,
            scale=scales[shape],
            seed=ns.workload_seed,
            max_model_len=engine.max_model_len,
            shape=shape,
        )  # fmt: skip
        for shape in ns.workloads
    }


def bench_engine_args(engine_args: EngineArgs) -> EngineArgs:
    """The benchmark's engine: prefix caching off (the paper's setting); unless told otherwise,
    a small KV pool (so that memory, not compute, limits the batch) and max_model_len 1024."""
    # Built paged: each run then gets its policy's block manager (with_policy).
    args = dataclasses.replace(engine_args, enable_prefix_caching=False, kv_allocation="paged")
    if args.kv_cache_memory is None and args.num_gpu_blocks_override is None:
        args.kv_cache_memory = DEFAULT_KV_CACHE_MEMORY
    if args.max_model_len is None:
        args.max_model_len = DEFAULT_MAX_MODEL_LEN
    return args


def warm_up(engine) -> None:
    """One short request, so first-call overheads are not timed."""
    engine.add_request("warm-up", [1, 2, 3, 4], greedy_params(4))
    while engine.has_unfinished_requests():
        engine.step()


def run_one(
    engine, policy, shape, requests, rate, seed, allocator="buddy", timer=time.perf_counter
) -> dict:
    """One (policy, workload, rate) run on a fresh scheduler."""
    engine = with_policy(engine, policy, allocator)
    breakdown = KVSlotBreakdown()
    arrivals = poisson_arrivals(len(requests), rate, seed)
    result = drive(
        engine, requests, arrivals, timer=timer, breakdown=breakdown,
        id_prefix=f"{shape}-{policy}-{rate:g}",
    )  # fmt: skip
    return {"workload": shape, "policy": policy, "request_rate": rate, **result}


def workload_summary(requests: list[WorkloadRequest]) -> dict[str, Any]:
    inputs = [len(p) for p, _ in requests]
    outputs = [n for _, n in requests]
    return {
        "num_requests": len(requests),
        "mean_input_len": float(np.mean(inputs)),
        "mean_output_len": float(np.mean(outputs)),
        "max_len": max(i + o for i, o in zip(inputs, outputs, strict=True)),
    }


def engine_summary(engine) -> dict[str, Any]:
    spec = engine.kv_cache_spec
    return {
        "model": engine.model_name,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "block_size": engine.block_size,
        "num_blocks": engine.num_blocks,
        "kv_pool_token_slots": engine.num_blocks * engine.block_size,
        "kv_pool_bytes": engine.num_blocks * spec.bytes_per_block,
        "max_model_len": engine.max_model_len,
        "max_num_seqs": engine.scheduler.config.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
    }


def run(engine_args: EngineArgs, ns: argparse.Namespace) -> dict[str, Any]:
    from pagedllm.engine.llm_engine import LLMEngine

    unknown = [p for p in ns.policies if p not in POLICIES]
    if unknown or not ns.policies:
        raise ValueError(f"--policies: choose among {', '.join(POLICIES)}")
    args = bench_engine_args(engine_args)
    t0 = time.perf_counter()
    engine = LLMEngine(args)
    load_s = time.perf_counter() - t0
    workloads = make_workloads(engine, ns)
    warm_up(engine)
    rates = {shape: getattr(ns, f"{shape}_rates") for shape in workloads}
    cpu_before = cpu_counters()
    runs = []
    for shape, requests in workloads.items():
        for policy in ns.policies:
            for rate in rates[shape]:
                r = run_one(engine, policy, shape, requests, rate, ns.arrival_seed, ns.allocator)
                print(format_run(r), flush=True)
                runs.append(r)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(sys.argv),
        "engine": engine_summary(engine),
        "engine_args": dataclasses.asdict(args),
        "load_s": load_s,
        "workloads": {s: workload_summary(r) for s, r in workloads.items()},
        "arrival_seed": ns.arrival_seed,
        "allocator": ns.allocator,
        "runs": runs,
        "others_cpu_share": others_cpu_share(cpu_before, cpu_counters()),
    }


# -- reporting ----------------------------------------------------------------------------------
def format_run(r: dict[str, Any]) -> str:
    return (
        f"[{r['workload']} {r['policy']} {r['request_rate']:g} req/s] "
        f"{r['mean_normalized_latency_s']:.4f} s/token, {r['requests_per_s']:.2f} req/s, "
        f"batch {r['mean_batched_requests']:.1f} (max {r['max_batched_requests']}), "
        f"{r['num_preemptions']} preemptions, {r['num_finished']}/{r['num_requests']} finished"
    )


def table_rows(runs: list[dict[str, Any]], first: str = "policy") -> list[tuple[str, ...]]:
    rows = [(
        "workload", first, "req/s in", "s/token", "p90 s/token", "req/s out", "out tok/s",
        "batch", "max", "preempt", "KV: tokens", "reserved", "int frag", "ext frag",
    )]  # fmt: skip
    for r in runs:
        shares = r.get("kv_breakdown", {}).get("shares", {})
        kv = [shares.get(k) for k in ("token_states", "reserved", "internal_fragmentation",
                                      "external_fragmentation")]  # fmt: skip
        label = r[first] if first == "policy" else str(r[first])
        rows.append((
            r["workload"], label, f"{r['request_rate']:g}",
            f"{r['mean_normalized_latency_s']:.4f}", f"{r['p90_normalized_latency_s']:.4f}",
            f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.1f}",
            f"{r['mean_batched_requests']:.1f}", str(r["max_batched_requests"]),
            str(r["num_preemptions"]), *("-" if x is None else f"{x:.1%}" for x in kv),
        ))  # fmt: skip
    return rows


def format_table(result: dict[str, Any]) -> str:
    e = result["engine"]
    lines = [
        f"{e['model']} on {e['device']} ({e['dtype']}): KV pool of {e['kv_pool_token_slots']} "
        f"token slots ({e['kv_pool_bytes'] / 2**20:.0f} MiB, blocks of {e['block_size']}), "
        f"max_model_len {e['max_model_len']}, prefix caching off, contiguous regions placed by "
        f"{result['allocator']}; virtual clock",
        *table_lines(table_rows(result["runs"])),
    ]
    others = result.get("others_cpu_share")
    if others is not None:
        note = " (busy machine: latencies are skewed)" if others > 0.1 else ""
        lines.append(f"other processes used {others:.1%} of the CPU{note}")
    return "\n".join(lines)


def write_outputs(result: dict[str, Any], ns: argparse.Namespace, plot) -> None:
    if ns.output_json:
        write_json(ns.output_json, result)
    if ns.plot:
        plot(result, ns.plot)
        print(f"wrote {ns.plot}")


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    from benchmarks import plots

    if ns.plot:
        plots.pyplot()  # fail before the runs, not after
    result = run(engine_args, ns)
    print()
    print(format_table(result))
    write_outputs(result, ns, lambda r, path: plots.plot_load(r, path, latency_cap=ns.latency_cap))
    ok = all(r["num_finished"] == r["num_requests"] and not r["num_failed"] for r in result["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
