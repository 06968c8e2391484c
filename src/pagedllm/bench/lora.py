"""`pagedllm bench lora`: multi-LoRA throughput against the base model, in one process.

The same ShareGPT-shaped requests (greedy, exactly their output lengths) run at a fixed
concurrency (--concurrency, the engine's max_num_seqs) through one engine with --enable-lora:
first for the base model alone, then spread round-robin over 1, 4, 16 ... adapters (random
PEFT adapters of --lora-rank on every projection, written to a temporary directory), so with
--max-loras below the adapter count the scheduler admits what fits the slots and the slots
churn. Each run prints its output tokens/s and the ratio to the base run.

Where the time goes: a step with adapter rows runs the model's modules, not the fused C++
decoder (docs/lora.md), so a last run times the base model on an engine with --enforce-eager:
base -> eager is what leaving the fused decoder costs, eager -> adapters what the LoRA products
and slot loads cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import tempfile
import time

from pagedllm.bench.utils import (
    cpu_counters,
    greedy_params,
    others_cpu_share,
    print_run,
    speed_figures,
    table_lines,
    write_json,
)
from pagedllm.bench.workload import workload_from_tokenizer, workload_tokenizer
from pagedllm.config import EngineArgs
from pagedllm.lora_request import LoRARequest
from pagedllm.model_loader.lora_adapter import projection_shapes

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument("--num-prompts", type=int, default=128, help="requests per run")
    group.add_argument(
        "--concurrency",
        type=int,
        default=32,
        help="requests running at once (sets --max-num-seqs; default: 32)",
    )
    group.add_argument(
        "--num-adapters",
        default="1,4,16",
        help="adapter counts to spread the requests over (default: 1,4,16)",
    )
    group.add_argument("--lora-rank", type=int, default=16, help="the adapters' rank")
    group.add_argument(
        "--scale",
        type=float,
        default=0.25,
        help="length scale of the ShareGPT-shaped workload (default: 0.25)",
    )
    group.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of the runs, interleaved; each figure is its median round (default: 1)",
    )
    group.add_argument(
        "--no-eager-run",
        dest="eager_run",
        action="store_false",
        help="skip the base run with --enforce-eager",
    )
    group.add_argument("--output-json", default=None, help="write every figure here")


def write_random_adapter(path: str, arch, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter for `arch` on every projection: A ~ N(0, 1/in), B small, so the
    model's output changes but stays finite; lora_alpha = rank (scaling 1)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(arch)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for name in TARGETS:
            out, inp = shapes[name]
            part = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": TARGETS}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def run(engine, requests, adapters: list[LoRARequest]) -> dict:
    """Every request queued at once (round-robin over `adapters`, none: the base model), the
    engine stepped to the end; the warm-up runs one request per adapter first."""
    for i, lora in enumerate(adapters or [None]):
        engine.add_request(f"warm-{i}", requests[0][0][:8], greedy_params(2), lora_request=lora)
    while engine.has_unfinished_requests():
        engine.step()
    outputs, ids, num_steps = {}, [], 0
    cpu_before = cpu_counters()
    start = time.perf_counter()
    for i, (prompt, output_len) in enumerate(requests):
        lora = adapters[i % len(adapters)] if adapters else None
        ids.append(engine.add_request(f"r-{i}", prompt, greedy_params(output_len),
                                      lora_request=lora))  # fmt: skip
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)
        num_steps += 1
    elapsed = time.perf_counter() - start
    token_ids = [outputs[i] for i in ids]
    figures = speed_figures(requests, token_ids, sum(len(t) for t in token_ids), elapsed)
    return {**figures, "num_steps": num_steps, "step_ms": 1000 * elapsed / num_steps,
            "others_cpu_share": others_cpu_share(cpu_before, cpu_counters())}  # fmt: skip


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    import torch

    from pagedllm.engine.llm_engine import LLMEngine

    counts = [int(x) for x in ns.num_adapters.split(",") if x]
    if not counts or min(ns.num_prompts, ns.concurrency, ns.repeat, *counts) < 1:
        raise ValueError("--num-prompts, --concurrency, --repeat, --num-adapters must be >= 1")
    args = dataclasses.replace(
        engine_args, enable_lora=True, max_num_seqs=ns.concurrency,
        max_lora_rank=max(engine_args.max_lora_rank, ns.lora_rank),
        max_cpu_loras=max(engine_args.max_cpu_loras or 0, engine_args.max_loras, max(counts)),
    )  # fmt: skip
    engine = LLMEngine(args)
    requests = workload_from_tokenizer(
        ns.num_prompts, workload_tokenizer(engine), vocab_size=engine.model_config.vocab_size,
        scale=ns.scale, max_model_len=engine.max_model_len,
    )  # fmt: skip
    print(f"{engine.model_name} ({args.dtype} -> {engine.dtype}, quantization "
          f"{args.quantization}), torch threads {torch.get_num_threads()}; {len(requests)} "
          f"requests, concurrency {ns.concurrency}, --max-loras {args.max_loras}, adapters of "
          f"rank {ns.lora_rank} on every projection")  # fmt: skip
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i in range(max(counts)):
            paths.append(os.path.join(tmp, f"adapter{i}"))
            write_random_adapter(paths[-1], engine.model_config, ns.lora_rank, seed=i)
        runs = {"base": []} | {f"{k} adapters": [] for k in counts}
        loras = [LoRARequest(f"a{i}", i + 1, paths[i]) for i in range(max(counts))]
        for _ in range(ns.repeat):  # rounds of every run, so drifts in speed hit all alike
            for name in runs:
                k = 0 if name == "base" else int(name.split()[0])
                runs[name].append(run(engine, requests, loras[:k]))
                print_run(name, runs[name][-1])
        for name, rounds in runs.items():  # the round of median speed
            results[name] = sorted(rounds, key=lambda r: r["output_tokens_per_s"])[len(rounds) // 2]
    del engine
    gc.collect()
    if ns.eager_run:
        eager = LLMEngine(dataclasses.replace(args, enforce_eager=True, enable_lora=False))
        results["base, --enforce-eager"] = run(eager, requests, [])
        print_run("base, --enforce-eager", results["base, --enforce-eager"])
        del eager
    base = results["base"]["output_tokens_per_s"]
    rows = [("run", "output tok/s", "x base", "steps", "ms/step")]
    for name, r in results.items():
        rows.append((name, f"{r['output_tokens_per_s']:.1f}",
                     f"{r['output_tokens_per_s'] / base:.2f}", str(r["num_steps"]),
                     f"{r['step_ms']:.1f}"))  # fmt: skip
    print("\n".join(table_lines(rows)))
    if ns.output_json:
        write_json(ns.output_json, results)
    return 0
