"""Building the model a worker runs: the architecture's class on this rank's shard, the
checkpoint's weights in it, the weight format the flags ask for, and the fused decoder."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm import kernels
from pagedllm.config import LoadConfig, ModelConfig
from pagedllm.distributed import tp_group
from pagedllm.layers.packed_linear import can_pack, pack_linear_weights
from pagedllm.layers.quantization import quantize_model, weight_bytes
from pagedllm.model_loader.loader import load_model
from pagedllm.models.fused_decoder import NotFusable
from pagedllm.models.registry import get_model_class

logger = logging.getLogger("pagedllm")


@dataclass
class BuiltModel:
    model: nn.Module  # forward(input_ids, positions, kv_caches, meta), compute_logits(hidden)
    weight_bytes: int  # what the weights take in memory, as the model holds them


def build_model(
    model_config: ModelConfig,
    load_config: LoadConfig,
    device: torch.device,
    attention_backend: str,
) -> BuiltModel:
    """This rank's model (tensor parallelism: the group is set before), on `device`, in the
    config's dtype, ready to run; `attention_backend` is a resolved backend name."""
    t0 = time.perf_counter()
    dtype = getattr(torch, model_config.dtype)
    method = model_config.quantization
    loaded = load_model(
        model_config.model,
        model_config.tokenizer,
        keep_codes=method != "none",
        allow_pickle=load_config.allow_pickle_checkpoints,
        lazy=tp_group().size > 1,  # each rank keeps its slices only
    )
    model = get_model_class(loaded.config.architecture)(
        loaded.config, attention_backend=attention_backend
    )
    try:
        model.load_weights(loaded.weights.items())
    except ValueError as e:  # a tensor of the wrong shape, missing or unknown: name the file
        raise ValueError(f"{loaded.source or loaded.name}: {e}") from None
    loaded.weights.clear()  # the model holds copies; free these before quantizing
    model = model.to(device=device, dtype=dtype).eval()
    num_bytes = _quantize(model, method, loaded, dtype, device)
    if can_pack(dtype, device):
        # Quantized weights are chosen to save memory: no packed copy of a tied lm_head then.
        added = pack_linear_weights(model, pack_shared=method == "none")
        num_bytes += added
        logger.info(
            "bfloat16 projections prepacked for oneDNN (+%.1f MiB for tied copies)", added / 2**20
        )
    if not model_config.enforce_eager and device.type == "cpu":
        _fuse_decoder(model)
    logger.info(
        "loaded %s in %.1f s (attention backend: %s)",
        model_config.name, time.perf_counter() - t0, attention_backend,
    )  # fmt: skip
    return BuiltModel(model, num_bytes)


def _quantize(model: nn.Module, method: str, loaded, dtype: torch.dtype, device) -> int:
    """Swap the projections for --quantization's layers; log and return the weight bytes."""
    float_bytes = weight_bytes(model)
    dtype_name = str(dtype).removeprefix("torch.")
    if method == "none":
        logger.info("weights: %.1f MiB (%s)", float_bytes / 2**20, dtype_name)
        return float_bytes
    if device.type != "cpu":
        raise ValueError(
            f"--quantization {method} runs on pagedllm's CPU kernels: run with --device cpu"
        )
    if not kernels.available():
        logger.warning(
            "--quantization %s without pagedllm's C++ kernels: every layer expands its "
            "weight on each call (correct, but slower than the float model)",
            method,
        )
    exact = {  # the checkpoint's own codes, fused like the model's projections
        module: type(parts[0]).cat(parts)
        for module, parts in model.group_by_module(loaded.quant_codes).items()
        if len({type(p) for p in parts}) == 1
    }
    loaded.quant_codes.clear()
    kept = quantize_model(model, method, exact)
    quant_bytes = weight_bytes(model)
    logger.info(
        "weights: %.1f MiB with %s projections (%.1f MiB all in %s); kept in %s: %s",
        quant_bytes / 2**20, method, float_bytes / 2**20, dtype_name, dtype_name,
        ", ".join(kept) or "nothing",
    )  # fmt: skip
    if exact:
        logger.info("%d weights taken from the GGUF's blocks as they are", len(exact))
    return quant_bytes


def _fuse_decoder(model: nn.Module) -> None:
    """Decode steps through the fused C++ decoder where the model allows it (CPU)."""
    try:
        model.fuse_decoder()
    except NotFusable as e:
        logger.info("fused decoder: off (%s)", e)
        return
    logger.info("fused decoder: on for decode steps (--enforce-eager turns it off)")
