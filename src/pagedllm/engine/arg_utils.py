"""EngineArgs -> EngineConfig: the model's architecture read (metadata only, no weights), the
device detected, "auto" resolved, once, before anything is built."""

from __future__ import annotations

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.cpu_info import has_native_bf16
from pagedllm.model_loader.loader import load_draft_model_config, load_model_config


def auto_dtype(device: str) -> str:
    """What --dtype auto means: bfloat16 on CUDA and on CPUs with bf16 instructions (on this
    project's AVX-512 machine, 1.8x float32's decode throughput at 64 running and 2.6x its
    prefill speed, greedy output agreeing on 99% of positions; docs/performance.md), with or
    without quantized weights (their kernels take either; prefill expands them for a GEMM in
    the activations' dtype). float32 on other CPUs, whose bfloat16 matmuls are emulated and
    slower than float32's."""
    if device != "cpu":
        return "bfloat16"
    return "bfloat16" if has_native_bf16() else "float32"


def resolve_device(name: str) -> str:
    """The device kind, cpu or cuda; only --device auto imports torch (to ask for CUDA)."""
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = name.partition(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: cpu, cuda or auto")
    return kind


def create_engine_config(args: EngineArgs, device: str | None = None) -> EngineConfig:
    """`device`: the one an engine resolved already ("cpu" or "cuda"), else args.device's."""
    args.validate()  # before reading the model: a bad flag fails at once
    arch, name = load_model_config(args.model)
    device = device or resolve_device(args.device)
    config = EngineConfig.resolve(args, arch, name, device, auto_dtype(device), has_native_bf16())
    spec = config.speculative
    if spec is not None and spec.method == "draft_model" and spec.model is not None:
        load_draft_model_config(spec.model, arch)  # refused here if it cannot draft
    return config
