"""`python -m benchmarks.step`: where an engine step's time goes, prefill speed, and schedule()
at 256 running requests, each against the targets of the CPU performance issue.

Three phases on one engine, each alone (the previous phase's requests are aborted first):

1. decode: `--num-running` requests of `--prompt-len` random tokens are stepped until every one
   decodes, then `--num-steps` decode steps are timed and each split into schedule, input
   preparation, the model's forward, logits and sampling, update and outputs, and a remainder.
2. prefill: one `--prefill-len` prompt with max_tokens=1, median of 3 after a warm-up.
3. schedule: `--schedule-running` short requests decoding; scheduler.schedule() timed during
   `--num-steps` real steps (each step advances the state the next schedule() sees).

The split times the public methods of the engine's own parts, wrapped on their instances while
a `StepTimer` is open and restored when it closes (scheduler.schedule, runner.execute_model,
runner.prepare_inputs, runner.execute, model.forward, model.compute_logits, runner.sample): the
engine runs its real code, nothing is mocked or changed for measuring.
Model FLOPs utilisation of phases 1 and 2 uses the GEMM peak measured at the end (roofline.py).
On a CPU the decode step is also set against two floors (step_ceilings.py): reading its bytes once
(the target at --num-running 1) and its own projections run alone at its shapes (at 64).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from typing import Any

from benchmarks import common, step_ceilings
from benchmarks.step_timer import StepTimer, breakdown, breakdown_table
from pagedllm.bench import roofline
from pagedllm.bench.utils import write_json
from pagedllm.config import EngineArgs

# The targets.
TARGET_OUTSIDE_FORWARD_SHARE = 0.10  # of step time, with 64 running requests
TARGET_PREFILL_TOKENS_PER_S = 1000.0  # 512-token prompt, default model
TARGET_SCHEDULE_MS = 5.0  # schedule() with 256 running
TARGET_MFU = 0.50
TARGET_STREAMING_RATIO = 1.5  # one stream's decode step against reading its bytes once
TARGET_GEMM_RATIO = 1.3  # a decode step at 64 running against its own GEMMs alone
GEMM_TARGET_RUNNING = 64
SCHEDULE_PROMPT_LEN = 16  # the schedule phase's prompts: short, as only schedule() is timed
PROFILE_ROWS = 15


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument(
        "--num-running",
        type=int,
        default=64,
        help="requests decoding together in the timed steps (default: 64)",
    )
    group.add_argument(
        "--prompt-len",
        type=int,
        default=128,
        help="prompt tokens of each decoding request (default: 128)",
    )
    group.add_argument(
        "--num-steps",
        type=int,
        default=20,
        help="decode steps timed, and steps timing schedule() (default: 20)",
    )
    group.add_argument(
        "--prefill-len",
        type=int,
        default=512,
        help="prompt tokens of the prefill measurement (default: 512)",
    )
    group.add_argument(
        "--schedule-running",
        type=int,
        default=256,
        help="running requests while schedule() is timed (default: 256)",
    )
    group.add_argument(
        "--profile",
        action="store_true",
        help="also run torch.profiler over one decode and one prefill step and "
        f"print the top {PROFILE_ROWS} ops by self CPU time",
    )
    group.add_argument(
        "--workload-seed", type=int, default=0, help="seed of the random prompts (default: 0)"
    )
    group.add_argument("--output-json", type=str, default=None,
                       help="write every figure to this JSON file")  # fmt: skip


def target_line(name: str, value: str, target: str, met: bool) -> str:
    return f"{name}: {value} (target {target}): {'met' if met else 'NOT met'}"


def mfu_target_line(phase: str, r: dict[str, Any]) -> str:
    value = (
        f"{r['mfu']:.1%} ({r['model_gflops']:.1f} GFLOP/s, "
        f"{r['flops_per_token'] / 1e6:.1f} MFLOP/token)"
    )
    return target_line(f"{phase} model FLOPs utilisation", value, f">= {TARGET_MFU:.0%}",
                       r["mfu"] >= TARGET_MFU)  # fmt: skip


# -- driving the engine -------------------------------------------------------------------------
def _params(max_tokens: int):
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)


def _random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    # Random ids: distinct prompts, so prefix caching never skips the work being measured.
    return [rng.randrange(vocab_size) for _ in range(length)]


def _all_decoding(engine, num_requests: int) -> bool:
    s = engine.scheduler
    seqs = s.running_seqs_by_id().values()
    return (
        s.num_waiting == 0
        and s.num_running == num_requests
        and all(r.num_computed_tokens >= r.num_prompt_tokens for r in seqs)
    )


def _start_decoding(engine, timer: StepTimer, prompts: list[list[int]], tag: str) -> list[str]:
    """Add the requests and step until all of them decode, plus one decode step so that first-
    decode costs are not timed. Their max_tokens leaves room to decode as long as needed."""
    ids = []
    for i, prompt in enumerate(prompts):
        max_tokens = engine.max_model_len - len(prompt)
        ids.append(engine.add_request(f"{tag}-{i}", prompt, _params(max_tokens)))
    while not _all_decoding(engine, len(prompts)):
        timer.step()
    timer.step()
    return ids


def _profile(fn) -> str:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS)


def run_decode(engine, timer, ns, rng, vocab) -> dict[str, Any]:
    prompts = [_random_prompt(rng, ns.prompt_len, vocab) for _ in range(ns.num_running)]
    ids = _start_decoding(engine, timer, prompts, "decode")
    preemptions = engine.scheduler.num_preemptions_total
    records = [timer.step()[1] for _ in range(ns.num_steps)]
    result = breakdown(records)
    tokens = sum(r["num_tokens"] for r in records)
    seconds = sum(r["step_s"] for r in records)
    result.update(
        num_running=ns.num_running,
        prompt_len=ns.prompt_len,
        num_tokens=tokens,
        tokens_per_s=tokens / seconds,
        mean_context_len=sum(r["context_token_sum"] for r in records) / tokens,
        num_prefill_seqs_in_timed_steps=sum(r["num_prefill_seqs"] for r in records),
        num_preemptions_in_timed_steps=engine.scheduler.num_preemptions_total - preemptions,
        steps=records,
    )
    if ns.profile:
        result["profile"] = _profile(timer.step)
    engine.abort_request(ids)
    return result


def run_prefill(engine, timer, ns, rng, vocab) -> dict[str, Any]:
    """One prompt alone, max_tokens=1: from add_request to its output, over every step it takes
    (one, unless --max-num-batched-tokens is below --prefill-len)."""

    def one(tag: str, step=None) -> tuple[float, list[dict[str, float]]]:
        step = step or timer.step
        engine.add_request(tag, _random_prompt(rng, ns.prefill_len, vocab), _params(1))
        records = []
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            records.append(step()[1])
        return time.perf_counter() - t0, records

    one("prefill-warmup")
    runs = [one(f"prefill-{i}") for i in range(3)]
    elapsed = statistics.median(t for t, _ in runs)
    result = {
        "prefill_len": ns.prefill_len,
        "elapsed_s_runs": [t for t, _ in runs],
        "elapsed_s_median": elapsed,
        "prompt_tokens_per_s": ns.prefill_len / elapsed,
        "mean_context_len": (ns.prefill_len + 1) / 2,
        "steps_per_run": len(runs[0][1]),
        **breakdown([r for _, records in runs for r in records]),
    }
    if ns.profile:
        result["profile"] = _profile(lambda: one("prefill-profiled"))
    return result


def run_schedule(engine, timer, ns, rng, vocab) -> dict[str, Any]:
    prompts = [_random_prompt(rng, SCHEDULE_PROMPT_LEN, vocab) for _ in range(ns.schedule_running)]
    ids = _start_decoding(engine, timer, prompts, "schedule")
    records = [timer.step()[1] for _ in range(ns.num_steps)]
    engine.abort_request(ids)
    ms = [1e3 * r["schedule"] for r in records]
    return {
        "num_running": ns.schedule_running,
        "prompt_len": SCHEDULE_PROMPT_LEN,
        "schedule_ms": ms,
        "schedule_ms_median": statistics.median(ms),
        "num_seqs_per_step": [r["num_seqs"] for r in records],
        "step_ms_median": statistics.median(1e3 * r["step_s"] for r in records),
    }


def _kv_blocks_needed(ns, block_size: int) -> int:
    extra = 4 + ns.num_steps + (1 if ns.profile else 0)  # steps beyond the prompt, with margin
    per = -(-(ns.prompt_len + extra) // block_size)
    per_schedule = -(-(SCHEDULE_PROMPT_LEN + extra) // block_size)
    per_prefill = -(-(ns.prefill_len + 1) // block_size)  # each phase runs alone
    return max(ns.num_running * per, ns.schedule_running * per_schedule, per_prefill)


def _validate(ns) -> None:
    for flag in ("num_running", "prompt_len", "num_steps", "prefill_len", "schedule_running"):
        if getattr(ns, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}")


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    _validate(ns)
    import torch

    from pagedllm.engine.llm_engine import LLMEngine

    # Every request of a phase must run in one batch: raise max_num_seqs if it is lower.
    need_seqs = max(ns.num_running, ns.schedule_running)
    if engine_args.max_num_seqs < need_seqs:
        print(f"note: --max-num-seqs raised from {engine_args.max_num_seqs} to {need_seqs}")
        engine_args = dataclasses.replace(engine_args, max_num_seqs=need_seqs)
    t0 = time.perf_counter()
    engine = LLMEngine(engine_args)
    load_s = time.perf_counter() - t0
    longest = max(ns.prompt_len, ns.prefill_len, SCHEDULE_PROMPT_LEN) + ns.num_steps + 8
    if longest > engine.max_model_len:
        raise ValueError(
            f"the prompts and steps need {longest} tokens per request, more than max_model_len "
            f"{engine.max_model_len}: lower --prompt-len / --prefill-len / --num-steps"
        )
    need_blocks = _kv_blocks_needed(ns, engine.block_size)
    if engine.num_blocks < need_blocks:
        raise ValueError(
            f"the KV cache has {engine.num_blocks} blocks, the bench needs about {need_blocks}: "
            "raise --kv-cache-memory or lower --num-running / --schedule-running"
        )
    dtype = str(engine.dtype).removeprefix("torch.")
    print(
        f"pagedllm: {engine.model_name} loaded in {load_s:.1f} s; dtype {dtype}, "
        f"{engine.num_blocks} KV blocks of {engine.block_size}, "
        f"torch threads: {torch.get_num_threads()}"
    )

    rng = random.Random(ns.workload_seed)
    vocab = engine.model_config.vocab_size
    with StepTimer(engine) as timer:
        # Warm-up: first-call costs (kernel selection, allocator) are not part of any phase.
        engine.add_request("warmup", _random_prompt(rng, 8, vocab), _params(4))
        while engine.has_unfinished_requests():
            timer.step()

        decode = run_decode(engine, timer, ns, rng, vocab)
        prefill = run_prefill(engine, timer, ns, rng, vocab)
        schedule = run_schedule(engine, timer, ns, rng, vocab)
    cpu = engine.device.type == "cpu"
    streaming = step_ceilings.weight_streaming(engine, decode) if cpu else None
    gemms = step_ceilings.gemms_alone(engine, decode) if cpu else None
    peak = roofline.measure_gemm_peak(engine.dtype, device=engine.device)
    peak_flops = peak["best_gflops"] * 1e9
    config = engine.model_config
    for phase, tokens_per_s in ((decode, decode["tokens_per_s"]),
                                (prefill, prefill["prompt_tokens_per_s"])):  # fmt: skip
        fpt = roofline.flops_per_token(config, phase["mean_context_len"])
        phase["flops_per_token"] = fpt
        phase["model_gflops"] = tokens_per_s * fpt / 1e9
        phase["mfu"] = roofline.mfu(tokens_per_s, fpt, peak_flops)

    targets = {
        "outside_forward_share": (decode["outside_forward_share"], TARGET_OUTSIDE_FORWARD_SHARE,
                                  decode["outside_forward_share"] <= TARGET_OUTSIDE_FORWARD_SHARE),
        "prefill_tokens_per_s": (prefill["prompt_tokens_per_s"], TARGET_PREFILL_TOKENS_PER_S,
                                 prefill["prompt_tokens_per_s"] >= TARGET_PREFILL_TOKENS_PER_S),
        "schedule_ms": (schedule["schedule_ms_median"], TARGET_SCHEDULE_MS,
                        schedule["schedule_ms_median"] < TARGET_SCHEDULE_MS),
        "decode_mfu": (decode["mfu"], TARGET_MFU, decode["mfu"] >= TARGET_MFU),
        **({"single_stream_vs_streaming": (streaming["ratio"], TARGET_STREAMING_RATIO,
                                          streaming["ratio"] <= TARGET_STREAMING_RATIO)}
           if streaming and ns.num_running == 1 else {}),
        **({"step_vs_gemms_alone": (gemms["ratio"], TARGET_GEMM_RATIO,
                                   gemms["ratio"] <= TARGET_GEMM_RATIO)}
           if gemms and ns.num_running == GEMM_TARGET_RUNNING else {}),
        "prefill_mfu": (prefill["mfu"], TARGET_MFU, prefill["mfu"] >= TARGET_MFU),
    }  # fmt: skip

    print()
    print(
        f"decode: {ns.num_running} running requests, prompts of {ns.prompt_len} tokens, "
        f"{ns.num_steps} steps timed at mean context {decode['mean_context_len']:.1f}: "
        f"{decode['step_ms']:.1f} ms/step, {decode['tokens_per_s']:.1f} tokens/s"
    )
    if decode["num_prefill_seqs_in_timed_steps"] or decode["num_preemptions_in_timed_steps"]:
        print("warning: the timed steps were not all pure decode (prefills or preemptions)")
    print(breakdown_table(decode))
    print(target_line("outside the forward pass", f"{decode['outside_forward_share']:.1%} of "
                      "step time", f"<= {TARGET_OUTSIDE_FORWARD_SHARE:.0%}",
                      targets["outside_forward_share"][2]))  # fmt: skip
    print("  (forward = the decoder's forward + the LM head's logits; the rest is schedule, "
          "input preparation, sampling, update and outputs)")  # fmt: skip
    print(mfu_target_line("decode", decode))
    if streaming:
        read = streaming["read"]
        line = (
            f"{streaming['weight_bytes'] / 1e6:.1f} MB of weights and "
            f"{streaming['kv_bytes'] / 1e6:.1f} MB of K/V a step; reading that much once runs "
            f"at {read['gb_per_s']:.1f} GB/s here ({read['bytes'] / 1e6:.0f} MB buffer): "
            f"{streaming['streaming_ms']:.1f} ms, the step {streaming['ratio']:.2f}x that"
        )
        if ns.num_running == 1:
            print(target_line("single stream against weight streaming", line,
                              f"<= {TARGET_STREAMING_RATIO}x",
                              targets["single_stream_vs_streaming"][2]))  # fmt: skip
        else:
            print(f"weight streaming: {line}")
    if gemms:
        line = step_ceilings.gemms_line(gemms, decode["step_ms"])
        if ns.num_running == GEMM_TARGET_RUNNING:
            print(target_line("step against its GEMMs alone", line, f"<= {TARGET_GEMM_RATIO}x",
                              targets["step_vs_gemms_alone"][2]))  # fmt: skip
        else:
            print(f"GEMMs alone: {line}")
    print()
    print(
        f"prefill: one {ns.prefill_len}-token prompt, max_tokens=1, median of 3 "
        f"({', '.join(f'{t * 1e3:.0f}' for t in prefill['elapsed_s_runs'])} ms; "
        f"{prefill['steps_per_run']} step(s) each)"
    )
    print(breakdown_table(prefill))
    print(target_line("prefill", f"{prefill['prompt_tokens_per_s']:.0f} prompt tokens/s",
                      f">= {TARGET_PREFILL_TOKENS_PER_S:.0f}",
                      targets["prefill_tokens_per_s"][2]))  # fmt: skip
    print(mfu_target_line("prefill", prefill))
    print()
    print(
        f"schedule: {ns.schedule_running} running requests, {ns.num_steps} steps "
        f"(whole step median {schedule['step_ms_median']:.1f} ms)"
    )
    print(target_line(f"schedule() at {ns.schedule_running} running",
                      f"{schedule['schedule_ms_median']:.2f} ms median",
                      f"< {TARGET_SCHEDULE_MS:.0f} ms", targets["schedule_ms"][2]))  # fmt: skip
    print()
    print(roofline.gemm_peak_line(peak))
    if ns.profile:
        print(f"\nprofile of one decode step ({ns.num_running} running), top {PROFILE_ROWS} ops "
              f"by self CPU time:\n{decode['profile']}")  # fmt: skip
        print(f"\nprofile of one {ns.prefill_len}-token prefill, top {PROFILE_ROWS} ops by self "
              f"CPU time:\n{prefill['profile']}")  # fmt: skip

    if ns.output_json:
        results = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": " ".join(sys.argv),
            "model": engine.model_name,
            "dtype": dtype,
            "torch_num_threads": torch.get_num_threads(),
            "engine_args": dataclasses.asdict(engine_args),
            "decode": decode,
            "weight_streaming": streaming,
            "gemms_alone": gemms,
            "prefill": prefill,
            "schedule": schedule,
            "gemm_peak": peak,
            "targets": {k: {"value": v, "target": t, "met": m} for k, (v, t, m) in targets.items()},
        }
        write_json(ns.output_json, results)
    return 0


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
