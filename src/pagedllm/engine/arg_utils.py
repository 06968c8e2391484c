"""EngineArgs -> EngineConfig: the model's architecture read (metadata only, no weights), the
device detected, "auto" resolved, once, before anything is built."""

from __future__ import annotations

import torch

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.cpu_info import has_native_bf16
from pagedllm.model_loader.loader import load_draft_model_config, load_model_config


def auto_dtype(device: torch.device) -> torch.dtype:
    """What --dtype auto means: bfloat16 on CUDA and on CPUs with bf16 instructions (on this
    project's AVX-512 machine, 1.8x float32's decode throughput at 64 running and 2.6x its
    prefill speed, greedy output agreeing on 99% of positions; docs/performance.md), with or
    without quantized weights (their kernels take either; prefill expands them for a GEMM in
    the activations' dtype). float32 on other CPUs, whose bfloat16 matmuls are emulated and
    slower than float32's."""
    if device.type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if has_native_bf16() else torch.float32


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def create_engine_config(args: EngineArgs) -> EngineConfig:
    args.validate()  # before reading the model: a bad flag fails at once
    arch, name = load_model_config(args.model)
    device = resolve_device(args.device)
    dtype = str(auto_dtype(device)).removeprefix("torch.")
    config = EngineConfig.resolve(args, arch, name, device.type, dtype, has_native_bf16())
    spec = config.speculative
    if spec is not None and spec.method == "draft_model" and spec.model is not None:
        load_draft_model_config(spec.model, arch)  # refused here if it cannot draft
    return config
