"""Building the model a worker runs: the architecture's class on this rank's shard, in the final
dtype and weight format, the checkpoint's weights in it, then the post-load steps (prepacking).
The worker then makes its fused decoder (models/fused_decoder.py), which its runner takes."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm import kernels
from pagedllm.attention.selector import get_attention_backend
from pagedllm.config import LoadConfig, ModelConfig
from pagedllm.distributed import tp_group
from pagedllm.layers.quantization import (
    DualLinearMethod,
    Int4LinearMethod,
    Int8ActLinearMethod,
    Int8LinearMethod,
    QuantizationConfig,
    UnquantizedLinearMethod,
    can_pack,
    code_layer_kinds,
    layers_with_codes,
)
from pagedllm.layers.weight_utils import weight_bytes
from pagedllm.model_loader.loader import load_model
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
    if method in ("auto", "int8_act") and (device.type != "cpu" or not kernels.available()):
        method = "none"  # the codes kernels are pagedllm's CPU ones
    elif method != "none":
        _check_quantized_device(method, device)
    loaded = load_model(
        model_config.model,
        model_config.tokenizer,
        keep_codes=method != "none",
        allow_pickle=load_config.allow_pickle_checkpoints,
        # One tensor at a time: a rank keeps its slices only, a quantized layer its codes.
        lazy=tp_group().size > 1 or method != "none",
        with_tokenizer=False,  # the engine loads its own
    )
    model_cls = get_model_class(loaded.config.architecture)
    codes, packed = loaded.quant_codes.kinds, model_cls.packed_modules_mapping
    tied = loaded.config.tie_word_embeddings
    deterministic = model_config.deterministic and device.type == "cpu"
    if deterministic and not kernels.available():
        logger.warning("--deterministic without pagedllm's C++ kernels: a request's results "
                       "may depend on the other requests of its steps")  # fmt: skip
        deterministic = False
    quant_config = QuantizationConfig(
        method,
        # oneDNN's packed GEMMs block by the number of rows: not batch invariant
        prepack=can_pack(dtype, device) and not deterministic,
        fixed_order=deterministic,
        layers_with_codes=layers_with_codes(codes, packed, method, tied),
        code_kinds=code_layer_kinds(codes, packed, tied) if method in ("auto", "int8_act") else {},
    )
    with torch.device(device):
        backend = get_attention_backend(attention_backend, device, deterministic)
        model = model_cls(loaded.config, backend, dtype, quant_config).eval()
    try:
        model.load_weights(loaded.weights, loaded.quant_codes)
    except ValueError as e:  # a tensor of the wrong shape, missing or unknown: name the file
        raise ValueError(f"{loaded.source or loaded.name}: {e}") from None
    loaded.weights.clear()
    loaded.quant_codes.clear()
    num_bytes = process_weights_after_loading(model, quant_config)
    _log_weights(model, method, dtype)
    logger.info(
        "loaded %s in %.1f s (attention backend: %s)",
        model_config.name, time.perf_counter() - t0, attention_backend,
    )  # fmt: skip
    return BuiltModel(model, num_bytes)


def process_weights_after_loading(model: nn.Module, quant_config: QuantizationConfig) -> int:
    """Every layer's quant_method's post-load step (prepacking for oneDNN); returns the weight
    bytes after it."""
    before = weight_bytes(model)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    after = weight_bytes(model)
    if quant_config.prepack:
        logger.info(
            "bfloat16 projections prepacked for oneDNN (+%.1f MiB for tied copies)",
            (after - before) / 2**20,
        )
    return after


def _check_quantized_device(method: str, device: torch.device) -> None:
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


def _log_weights(model: nn.Module, method: str, dtype: torch.dtype) -> None:
    """What the loaded weights take; for a quantized model, against the float model's bytes."""
    num_bytes = weight_bytes(model)
    dtype_name = str(dtype).removeprefix("torch.")
    if method == "int8_act":
        _log_int8_act(model, num_bytes)
        return
    dual = [
        (m, m.quant_method)
        for m in model.modules()
        if isinstance(getattr(m, "quant_method", None), DualLinearMethod)
    ]
    if dual:
        code_bytes = sum(method.nbytes(m) for m, method in dual)
        method = dual[0][1]
        when = (
            "at every row count"
            if method.codes_only
            else f"in steps of up to {method.max_code_rows} rows"
        )
        logger.info(
            "weights: %.1f MiB (%s), of which %.1f MiB are the checkpoint's codes of %d layers, "
            "multiplied %s (--quantization none: float only)",
            num_bytes / 2**20, dtype_name, code_bytes / 2**20, len(dual), when,
        )  # fmt: skip
        return
    if method in ("none", "auto"):
        logger.info("weights: %.1f MiB (%s)", num_bytes / 2**20, dtype_name)
        return
    float_bytes, kept, exact = num_bytes, [], 0
    for name, module in model.named_modules():
        m = getattr(module, "quant_method", None)
        if isinstance(m, (Int4LinearMethod, Int8LinearMethod)):
            float_bytes += m.float_bytes(module) - m.nbytes(module)
            exact += m.takes_codes
        elif isinstance(m, UnquantizedLinearMethod):
            kept.append(name)
    logger.info(
        "weights: %.1f MiB with %s projections (%.1f MiB all in %s); kept in %s: %s",
        num_bytes / 2**20, method, float_bytes / 2**20, dtype_name, dtype_name,
        ", ".join(kept) or "nothing",
    )  # fmt: skip
    if exact:
        logger.info("%d weights taken from the GGUF's blocks as they are", exact)


def _log_int8_act(model: nn.Module, num_bytes: int) -> None:
    """The integer path (the default on CPU for a checkpoint's codes: a GGUF's, gpt-oss's MXFP4
    experts): which layers, which kernel, and what stays float."""
    integer, kept = [], []
    for name, module in model.named_modules():
        m = getattr(module, "quant_method", None)
        if isinstance(m, Int8ActLinearMethod):
            integer.append(m.nbytes(module))
        elif isinstance(m, UnquantizedLinearMethod):
            kept.append(name)
    variant = kernels.cpu_ops().int8_act_variants()[0]
    logger.info(
        "weights: %.1f MiB, of which %.1f MiB are the checkpoint's codes of %d layers, "
        "multiplied in integers with 8-bit activations (%s kernel; --dtype float32: exact float "
        "products)",
        num_bytes / 2**20, sum(integer) / 2**20, len(integer), variant,
    )  # fmt: skip
    if kept:
        logger.info(
            "float32 weights (types without an integer kernel): %s",
            ", ".join(kept) if len(kept) <= 8 else f"{len(kept)} layers ({kept[0]}, ...)",
        )
