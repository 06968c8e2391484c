"""`pagedllm bench throughput`: offline throughput on a ShareGPT-shaped workload.

Every request is queued at once (offline batch inference, as vLLM's benchmark_throughput does),
generates exactly its own `output_len` tokens (greedy, ignore_eos), and we time generation only,
not model loading. Alongside speed we measure how much of the reserved KV cache holds real token
state: pagedllm's block tables (sampled every engine step) against the static cache that a
padded Hugging Face batch implies.

`--baseline hf` runs the *same* requests through transformers' `generate` on the same GGUF
weights: static batches of `--hf-batch-size` in arrival order, left-padded, each batch generating
the longest output in it. Only useful tokens count (each request's own output_len), so padding and
over-generation cost HF time without adding to its throughput, exactly as they would in serving.

After the pagedllm run, the GEMM peak of the engine's dtype is measured on the same machine and
the run's model FLOPs utilisation printed (roofline.py): (prompt + output tokens)/s × FLOPs per
token at the run's mean context ÷ that peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pagedllm.benchmarks import roofline
from pagedllm.benchmarks.workload import (
    KVSlotUsage,
    WorkloadRequest,
    static_batch_kv_usage,
    workload_from_tokenizer,
)
from pagedllm.config import EngineArgs
from pagedllm.distributed.parallel import COMM_BYTES


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument(
        "--num-prompts", type=int, default=64, help="number of requests (default: 64)"
    )
    group.add_argument(
        "--scale",
        type=float,
        default=0.25,
        help="length scale of the ShareGPT-shaped workload: 1.0 = ShareGPT's means "
        "(161 prompt / 338 output tokens), 0.25 = a quarter as long (default: 0.25)",
    )
    group.add_argument(
        "--workload-seed", type=int, default=0, help="seed of the synthetic workload (default: 0)"
    )
    group.add_argument(
        "--baseline",
        choices=("none", "hf"),
        default="none",
        help="also run the same requests through HF transformers generate (default: none)",
    )
    group.add_argument(
        "--hf-batch-size",
        type=int,
        default=32,
        help="static batch size of the HF baseline (default: 32)",
    )
    group.add_argument(
        "--output-json", type=str, default=None, help="write every figure to this JSON file"
    )


# -- KV-cache accounting ------------------------------------------------------------------------
class KVUsageTracker:
    """Samples a KVCacheManager after each engine step: reserved slots vs slots holding tokens.

    Reserved = distinct physical blocks in the block tables × block_size. Held = for each of those
    blocks, how many of its slots carry a computed token (a block shared by several requests
    counts once, with the fullest holder's count).
    """

    def __init__(self) -> None:
        self.num_samples = 0
        self.sum_reserved = 0
        self.sum_held = 0
        self.peak_reserved = 0
        self.held_at_peak = 0
        self.min_share: float | None = None

    def observe(self, kv_cache_manager, requests: dict) -> tuple[int, int]:
        """`requests` maps seq_id → Request (for num_computed_tokens)."""
        block_size = kv_cache_manager.block_size
        filled: dict[int, int] = {}
        for request_id, blocks in kv_cache_manager.req_to_blocks.items():
            request = requests.get(request_id)
            computed = request.num_computed_tokens if request is not None else 0
            for i, block in enumerate(blocks):
                n = min(block_size, max(0, computed - i * block_size))
                key = block.block_id
                if n > filled.get(key, -1):
                    filled[key] = n
        reserved = len(filled) * block_size
        held = sum(filled.values())
        if reserved:
            self.num_samples += 1
            self.sum_reserved += reserved
            self.sum_held += held
            share = held / reserved
            self.min_share = share if self.min_share is None else min(self.min_share, share)
            if reserved > self.peak_reserved:
                self.peak_reserved, self.held_at_peak = reserved, held
        return reserved, held

    @property
    def share_at_peak(self) -> float:
        return self.held_at_peak / self.peak_reserved if self.peak_reserved else 0.0

    @property
    def mean_share(self) -> float:
        """Held / reserved summed over all steps (a time-weighted average)."""
        return self.sum_held / self.sum_reserved if self.sum_reserved else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_samples": self.num_samples,
            "peak_reserved_slots": self.peak_reserved,
            "held_slots_at_peak": self.held_at_peak,
            "used_share_at_peak": self.share_at_peak,
            "used_share_mean_over_steps": self.mean_share,
            "used_share_min_over_steps": self.min_share,
        }


def _children_cpu_seconds() -> float:
    """CPU seconds of this process's live children (tensor-parallel ranks: part of the run)."""
    total, me = 0, str(os.getpid())
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:  # ppid; utime and stime follow at 11 and 12
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def cpu_counters() -> tuple[float, float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its children,
    wall seconds)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    return busy, own.user + own.system + _children_cpu_seconds(), time.perf_counter()


def others_cpu_share(before, after) -> float | None:
    """Share of the machine's CPU time other processes used between two `cpu_counters()`:
    a CPU benchmark is only worth quoting when this stays near zero."""
    if before is None or after is None or after[2] <= before[2]:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others) / ((after[2] - before[2]) * (os.cpu_count() or 1))


def speed_figures(
    requests: list[WorkloadRequest], token_ids: list[list[int]], generated: int, elapsed: float
) -> dict[str, Any]:
    """Throughput counting only useful output tokens (each request's own output_len)."""
    useful = sum(min(len(t), n) for t, (_, n) in zip(token_ids, requests, strict=True))
    num_prompt_tokens = sum(len(p) for p, _ in requests)
    return {
        "elapsed_s": elapsed,
        "num_requests": len(requests),
        "num_prompt_tokens": num_prompt_tokens,
        "num_output_tokens": generated,
        "num_useful_output_tokens": useful,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": useful / elapsed,
        "total_tokens_per_s": (num_prompt_tokens + useful) / elapsed,
    }


# -- pagedllm -----------------------------------------------------------------------------------
def _greedy_params(output_len: int):
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)


def run_pagedllm(llm, requests: list[WorkloadRequest]) -> dict[str, Any]:
    """Queue every request, then step the engine to completion, sampling KV use each step."""
    engine = llm.llm_engine
    # Warm-up (one tiny request) so first-call overheads are not timed.
    llm.generate([requests[0][0][:8]], _greedy_params(4), use_tqdm=False)

    scheduler = engine.scheduler
    kv = scheduler.kv_cache_manager
    tracker = KVUsageTracker()
    outputs: dict[str, list[int]] = {}
    ids = []
    num_steps = 0
    comm_before = dict(COMM_BYTES)
    cpu_before = cpu_counters()
    start = time.perf_counter()
    for i, (prompt, output_len) in enumerate(requests):
        ids.append(engine.add_request(f"bench-{i}", prompt, _greedy_params(output_len)))
    while engine.has_unfinished_requests():
        step_outputs = engine.step()
        num_steps += 1
        tracker.observe(kv, scheduler.running_seqs_by_id())
        for output in step_outputs:
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    others = others_cpu_share(cpu_before, cpu_counters())

    token_ids = [outputs[i] for i in ids]
    return {
        **speed_figures(requests, token_ids, sum(len(t) for t in token_ids), elapsed),
        "num_steps": num_steps,
        "num_preemptions": getattr(scheduler, "num_preemptions_total", None),
        # tensor parallelism: bytes rank 0 passed to collectives, per step, by kind
        "comm_bytes_per_step": {
            k: (v - comm_before.get(k, 0)) / max(num_steps, 1) for k, v in COMM_BYTES.items()
        },
        "others_cpu_share": others,
        "kv_cache": {
            "block_size": kv.block_size,
            "num_blocks": engine.num_blocks,
            "peak_pool_usage": tracker.peak_reserved / (kv.block_size * engine.num_blocks),
            **tracker.as_dict(),
        },
        "token_ids": token_ids,
    }


def mean_context_len(lengths: Iterable[tuple[int, int]]) -> float:
    """Mean context a processed token attends to, over (prompt_len, output_len) requests.

    Each of a request's L = prompt + output tokens is counted once, the t-th (1-based) attending
    to t tokens, itself included: Σ t = L(L+1)/2 per request. This is the prompt tokens seeing
    on average (prompt+1)/2 and output token j seeing prompt + j, give or take one token (the
    last sampled token is never fed back, the first comes from the last prompt position).
    Prefix-cache hits, which skip prompt tokens, are not subtracted.
    """
    total = weighted = 0
    for prompt_len, output_len in lengths:
        n = prompt_len + output_len
        total += n
        weighted += n * (n + 1) // 2
    return weighted / total if total else 0.0


def mfu_figures(
    config, total_tokens_per_s: float, context_len: float, peak: dict[str, Any]
) -> dict[str, Any]:
    """The MFU entry of the JSON results: the figure and every number it is made of."""
    fpt = roofline.flops_per_token(config, context_len)
    peak_flops = peak["best_gflops"] * 1e9
    return {
        "mfu": roofline.mfu(total_tokens_per_s, fpt, peak_flops),
        "model_gflops": total_tokens_per_s * fpt / 1e9,
        "peak_gflops": peak["best_gflops"],
        "flops_per_token": fpt,
        "mean_context_len": context_len,
        "tokens_per_s": total_tokens_per_s,
        "gemm_peak": peak,
    }


def mfu_line(name: str, m: dict[str, Any]) -> str:
    return (
        f"[{name}] model FLOPs utilisation: {m['mfu']:.1%} ({m['model_gflops']:.1f} GFLOP/s of "
        f"{m['peak_gflops']:.1f} GFLOP/s peak {m['gemm_peak']['dtype']} GEMM measured now; "
        f"{m['flops_per_token'] / 1e6:.1f} MFLOP/token at mean context "
        f"{m['mean_context_len']:.1f})"
    )


# -- HF transformers baseline -------------------------------------------------------------------
def resolve_hf_source(model: str | None) -> tuple[Path, str | None]:
    """(directory, GGUF file name or None) for transformers' `from_pretrained`, from the same
    `--model` pagedllm loaded: a Hugging Face directory as it is, anything else via its GGUF."""
    from pagedllm.model_loader import resolve_model

    path = Path(resolve_model(model))
    if path.is_dir() and (path / "config.json").is_file():
        return path, None
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    raise ValueError(
        f"the HF baseline cannot load {model!r} ({path}): pass a .gguf file or a Hugging Face "
        "directory as --model"
    )


def load_hf_model(directory: Path, gguf_file: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kwargs)
    return model.eval()


def _left_pad(prompts: list[list[int]], pad_id: int):
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


def _eos_ids(model) -> list[int]:
    for source in (model.generation_config, model.config):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            return [eos]
        if eos:
            return [int(e) for e in eos]
    return [0]


def run_hf(model, requests: list[WorkloadRequest], batch_size: int) -> dict[str, Any]:
    """Static, left-padded batches in arrival order; each runs to its longest output."""
    import torch

    eos_ids = _eos_ids(model)
    pad_id = eos_ids[0]

    def generate(prompts: list[list[int]], num_new: int):
        input_ids, attention_mask = _left_pad(prompts, pad_id)
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=num_new,
                min_new_tokens=num_new,
                do_sample=False,
                pad_token_id=pad_id,
                eos_token_id=eos_ids,
            )
        return out[:, input_ids.shape[1] :]

    generate([requests[0][0][:8]], 2)  # warm-up

    token_ids: list[list[int]] = []
    generated = 0
    cpu_before = cpu_counters()
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        num_new = max(n for _, n in batch)
        new_tokens = generate([p for p, _ in batch], num_new)
        generated += new_tokens.numel()
        for row, (_, n) in enumerate(batch):
            token_ids.append(new_tokens[row, :n].tolist())
    elapsed = time.perf_counter() - start
    others = others_cpu_share(cpu_before, cpu_counters())

    kv = static_batch_kv_usage([(len(p), n) for p, n in requests], batch_size)
    return {
        **speed_figures(requests, token_ids, generated, elapsed),
        "batch_size": batch_size,
        "num_batches": -(-len(requests) // batch_size),
        "others_cpu_share": others,
        "kv_cache": _static_kv_dict(kv),
        "eos_token_ids": eos_ids,
        "token_ids": token_ids,
    }


def _static_kv_dict(kv: KVSlotUsage) -> dict[str, Any]:
    return {
        "reserved_slots": kv.reserved_slots,
        "used_slots": kv.used_slots,
        "used_share": kv.used_share,
        "waste_share": kv.waste_share,
    }


def greedy_agreement(
    ours: list[list[int]], theirs: list[list[int]], eos_ids: Iterable[int] = ()
) -> float:
    """Share of output tokens before the two systems' greedy outputs first diverge.

    Each request is compared up to the first EOS in `ours`: there the engine (ignore_eos) takes
    EOS, while HF's `min_new_tokens` forbids it, so the two part ways by design, not by error.
    """
    eos = set(eos_ids)
    total = agree = 0
    for x, y in zip(ours, theirs, strict=True):
        cut = next((i for i, t in enumerate(x) if t in eos), len(x))
        total += cut
        for s, t in zip(x[:cut], y, strict=False):
            if s != t:
                break
            agree += 1
    return agree / total if total else 1.0


# -- reporting ----------------------------------------------------------------------------------
def print_run(name: str, r: dict[str, Any]) -> None:
    print(
        f"[{name}] {r['num_requests']} requests in {r['elapsed_s']:.2f} s: "
        f"{r['requests_per_s']:.2f} requests/s, {r['output_tokens_per_s']:.1f} output tokens/s, "
        f"{r['total_tokens_per_s']:.1f} total tokens/s"
    )
    others = r.get("others_cpu_share")
    if others is not None:
        note = " (busy machine: these figures are skewed)" if others > 0.1 else ""
        print(f"[{name}] other processes used {others:.1%} of the machine's CPU meanwhile{note}")


def table_lines(rows: list[tuple[str, ...]]) -> list[str]:
    """A text table: the first row is the header (underlined), the first column left-aligned,
    the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def format_table(results: dict[str, Any]) -> str:
    rows = [("system", "requests/s", "output tok/s", "total tok/s", "time (s)", "KV slots used",
             "MFU")]  # fmt: skip
    p = results["pagedllm"]
    rows.append(
        (
            "pagedllm",
            f"{p['requests_per_s']:.2f}",
            f"{p['output_tokens_per_s']:.1f}",
            f"{p['total_tokens_per_s']:.1f}",
            f"{p['elapsed_s']:.1f}",
            f"{p['kv_cache']['used_share_at_peak']:.1%} at peak",
            f"{p['mfu']['mfu']:.1%}" if "mfu" in p else "-",
        )
    )
    hf = results.get("hf")
    if hf is not None:
        rows.append(
            (
                f"HF generate (batch {hf['batch_size']})",
                f"{hf['requests_per_s']:.2f}",
                f"{hf['output_tokens_per_s']:.1f}",
                f"{hf['total_tokens_per_s']:.1f}",
                f"{hf['elapsed_s']:.1f}",
                f"{hf['kv_cache']['used_share']:.1%} of static",
                "-",
            )
        )
    lines = table_lines(rows)
    if hf is not None:
        lines.append(
            f"pagedllm / HF, useful output tokens/s: {results['speedup_output_tokens_per_s']:.2f}x"
        )
    return "\n".join(lines)


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    if ns.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    if ns.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {ns.hf_batch_size}")
    import torch

    from pagedllm.entrypoints.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(engine_args))
    engine = llm.llm_engine
    load_s = time.perf_counter() - t0
    tokenizer = llm.get_tokenizer()
    vocab_size = engine.model_config.vocab_size
    if tokenizer is None:  # no tokenizer: every id of the embedding table is fair game
        tokenizer = types.SimpleNamespace(vocab_size=vocab_size, all_special_ids=())
    requests = workload_from_tokenizer(
        ns.num_prompts,
        tokenizer,
        vocab_size=vocab_size,
        scale=ns.scale,
        seed=ns.workload_seed,
        max_model_len=engine.max_model_len,
    )
    num_in = sum(len(p) for p, _ in requests)
    num_out = sum(n for _, n in requests)
    print(
        f"workload: {len(requests)} requests, ShareGPT-shaped at scale {ns.scale} "
        f"(seed {ns.workload_seed}): {num_in} prompt tokens (mean {num_in / len(requests):.1f}), "
        f"{num_out} output tokens (mean {num_out / len(requests):.1f}); "
        f"torch threads: {torch.get_num_threads()}"
    )
    print(f"pagedllm: {engine.model_name} loaded in {load_s:.1f} s")

    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(sys.argv),
        "model": engine.model_name,
        "torch_num_threads": torch.get_num_threads(),
        "engine_args": {k: v for k, v in dataclasses.asdict(engine_args).items()},
        "workload": {
            "num_prompts": len(requests),
            "scale": ns.scale,
            "seed": ns.workload_seed,
            "num_prompt_tokens": num_in,
            "num_output_tokens": num_out,
            "input_lens": [len(p) for p, _ in requests],
            "output_lens": [n for _, n in requests],
        },
    }

    paged = run_pagedllm(llm, requests)
    paged_tokens = paged.pop("token_ids")
    results["pagedllm"] = paged
    print_run("pagedllm", paged)
    kv = paged["kv_cache"]
    print(
        f"[pagedllm] KV cache: at peak {kv['peak_reserved_slots']} slots reserved "
        f"({kv['peak_pool_usage']:.1%} of the pool), {kv['held_slots_at_peak']} hold tokens "
        f"= {kv['used_share_at_peak']:.1%} used; over all {paged['num_steps']} steps "
        f"{kv['used_share_mean_over_steps']:.1%} used; preemptions: {paged['num_preemptions']}"
    )
    if paged["num_useful_output_tokens"] != num_out:
        print(
            f"warning: pagedllm generated {paged['num_useful_output_tokens']} useful tokens, "
            f"expected {num_out}",
            file=sys.stderr,
        )
    if engine.args.tensor_parallel_size > 1:
        comm = paged["comm_bytes_per_step"]
        print(
            f"[pagedllm] tensor parallelism: {engine.args.tensor_parallel_size} ranks; per step, "
            "rank 0's tensors in collectives: "
            + ", ".join(f"{kind} {b / 1024:.1f} KiB" for kind, b in sorted(comm.items()))
        )
    # MFU: the peak is measured now, after the run, in the dtype the engine ran in.
    peak = roofline.measure_gemm_peak(engine.dtype, device=engine.device)
    print(f"[pagedllm] {roofline.gemm_peak_line(peak)}")
    context = mean_context_len((len(p), n) for p, n in requests)
    paged["mfu"] = mfu_figures(engine.model_config, paged["total_tokens_per_s"], context, peak)
    print(mfu_line("pagedllm", paged["mfu"]))
    hf_model = engine_args.model
    del llm, engine
    gc.collect()

    if ns.baseline == "hf":
        t0 = time.perf_counter()
        directory, gguf_file = resolve_hf_source(hf_model)
        model = load_hf_model(directory, gguf_file)
        source = directory / gguf_file if gguf_file else directory
        print(f"HF transformers: {source} loaded in {time.perf_counter() - t0:.1f} s")
        hf = run_hf(model, requests, ns.hf_batch_size)
        hf_tokens = hf.pop("token_ids")
        hf["model_source"] = str(source)
        hf["greedy_agreement_with_pagedllm"] = greedy_agreement(
            paged_tokens, hf_tokens, hf["eos_token_ids"]
        )
        results["hf"] = hf
        print_run(f"HF batch {ns.hf_batch_size}", hf)
        hkv = hf["kv_cache"]
        print(
            f"[HF batch {ns.hf_batch_size}] KV cache (static, padded batches): "
            f"{hkv['reserved_slots']} slots reserved, {hkv['used_slots']} hold real tokens "
            f"= {hkv['used_share']:.1%} used, {hkv['waste_share']:.1%} wasted"
        )
        print(
            "greedy agreement with pagedllm (share of output tokens before the first divergence, "
            "up to the first EOS): "
            f"{hf['greedy_agreement_with_pagedllm']:.1%}"
        )
        results["speedup_output_tokens_per_s"] = (
            paged["output_tokens_per_s"] / hf["output_tokens_per_s"]
        )
        del model
        gc.collect()

    print()
    print(format_table(results))
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"wrote {ns.output_json}")
    return 0
