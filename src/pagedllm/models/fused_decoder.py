"""The Llama decoder stack as one C++ call for decode steps on CPU (kernels/csrc/decoder.cpp).

A single stream's step runs 30 layers of a dozen small kernels each; between them, module calls,
views and allocations in Python cost about as much as the kernels (docs/performance.md). The
fused decoder runs the same kernels in the same order over the same weights (shared, not
copied), so its output is bit for bit the modules' own. The engine turns it on after loading
(`--enforce-eager` keeps the modules); the model runner takes it for a step when `applies`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm import kernels
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import ModelArchConfig
from pagedllm.distributed import tp_group
from pagedllm.layers.quantization import (
    MAX_GEMV_ROWS,
    DualLinearMethod,
    Int4LinearMethod,
    Int8ActLinearMethod,
    Int8LinearMethod,
    UnquantizedLinearMethod,
)

logger = logging.getLogger("pagedllm")

# Steps whose longest request has fewer new rows than this (decode, short chunks) run fused;
# prefill chunks go through the modules. It was attention's hand-off to SDPA when the decoder
# was fused (docs/performance.md, item 8), and stays where it was when that moved.
FUSED_QUERY_LEN_LIMIT = 8


class NotFusable(Exception):
    """Why a model's layers cannot run as the fused decoder (the modules run instead)."""


def _float_linear(layer: nn.Module, weight: torch.Tensor, dtype: torch.dtype, bias):
    """A float weight's kernel view: the layer's oneDNN-packed copy, or `weight` itself (in the
    fixed-order kernel with --deterministic: see _linear)."""
    ops, packed = kernels.cpu_ops(), getattr(layer, "packed_weight", None)
    if packed is not None:
        return ops.Linear.packed(packed, bias)
    if weight.dtype == dtype:
        return ops.Linear.dense(weight.detach(), bias)
    raise NotFusable(f"a {weight.dtype} weight in a {dtype} model")


def _linear(layer: nn.Module, dtype: torch.dtype):
    """The kernel's view of a linear layer (layers/linear.py), by its quant_method; in fixed
    order (--deterministic) as the method computes it then."""
    ops, linear = kernels.cpu_ops(), _by_method(layer, dtype)
    if getattr(layer.quant_method, "fixed_order", False):
        linear = ops.Linear.fixed_order(linear)
    lora = layer.lora
    if lora is not None:  # its slots' tensors, shared (layers/lora.py)
        linear = ops.Linear.with_lora(linear, lora.a, lora.b, lora.columns)
    return linear


def _by_method(layer: nn.Module, dtype: torch.dtype):
    ops, method = kernels.cpu_ops(), layer.quant_method
    bias = None if layer.bias is None else layer.bias.detach()
    if isinstance(method, Int8ActLinearMethod):
        codes = [t for t in method.codes(layer) if t is not None]
        return ops.Linear.int8_act(codes, layer.output_size_per_partition, bias)
    if isinstance(method, (DualLinearMethod, Int4LinearMethod, Int8LinearMethod)):
        bits = method.codes_method.bits if isinstance(method, DualLinearMethod) else method.bits
        codes = getattr(ops.Linear, f"int{bits}")(*method.codes(layer), bias)
        if not isinstance(method, DualLinearMethod) or method.codes_only:
            return codes
        dense = _float_linear(layer, getattr(layer, "dense_weight", None), dtype, bias)
        return ops.Linear.dual(codes, dense, method.max_code_rows)
    if isinstance(method, UnquantizedLinearMethod):
        return _float_linear(layer, getattr(layer, "weight", None), dtype, bias)
    raise NotFusable(f"a {type(method).__name__} projection")


class FusedDecoder:
    def __init__(self, model: nn.Module, config: ModelArchConfig):
        """`model`: a LlamaModel, loaded and processed (prepacked) for good."""
        if not kernels.available():
            raise NotFusable("the C++ kernels are not available")
        if tp_group().size > 1:
            raise NotFusable("tensor parallelism (the all-reduces are the modules')")
        dtype = model.embed_tokens.dtype
        if model.norm.weight.device.type != "cpu":
            raise NotFusable("the model is not on the CPU")
        ops = kernels.cpu_ops()
        first = model.layers[0].self_attn
        rotary, attn = first.rotary_emb, first.attn
        if attn.head_dim % ops.vec_size or attn.head_dim > ops.max_head_dim:
            raise NotFusable(f"head_dim {attn.head_dim}")
        self.decoder = ops.LlamaDecoder(
            attn.num_heads, attn.num_kv_heads, attn.head_dim, rotary.rotary_dim, attn.scale,
            model.norm.eps, rotary.cos_f32, rotary.sin_f32, model.norm.weight.detach(),
            config.residual_multiplier,
        )  # fmt: skip
        expands = False  # a quantized projection that expands its weight above MAX_GEMV_ROWS
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            if a.attn.backend.name != "cpu" or a.attn.logits_soft_cap is not None:
                raise NotFusable(f"attention backend {a.attn.backend.name}")
            linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            expands |= any(
                isinstance(m.quant_method, (Int4LinearMethod, Int8LinearMethod))
                and not m.quant_method.fixed_order
                for m in linears
            )
            qk_norms = (None, None) if a.q_norm is None else (a.q_norm.weight, a.k_norm.weight)
            self.decoder.add_layer(
                layer.input_layernorm.weight.detach(),
                layer.post_attention_layernorm.weight.detach(),
                *(_linear(m, dtype) for m in linears),
                a.attn.sliding_window or 0,
                *(None if w is None else w.detach() for w in qk_norms),
            )
        # Quantized projections multiply codes directly up to MAX_GEMV_ROWS rows; above, the
        # modules expand the weights for a float GEMM (in fixed order, codes at any rows).
        self.max_tokens = MAX_GEMV_ROWS if expands else None

    def applies(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Every request through the attention kernel (decode, short chunks), one KV group."""
        return (
            meta.groups is None
            and meta.max_query_len < FUSED_QUERY_LEN_LIMIT
            and (self.max_tokens is None or num_tokens <= self.max_tokens)
            and not torch.is_grad_enabled()
        )

    def __call__(self, hidden_states, positions, kv_caches, meta: AttentionMetadata,
                 lora_slots: torch.Tensor | None = None):  # fmt: skip
        """The embeddings [T, hidden] -> the final norm's output, as LlamaModel's layers;
        lora_slots: each row's adapter slot (layers/lora.py), None without adapter rows."""
        return self.decoder.forward(
            hidden_states, positions, kv_caches, meta.slot_mapping, meta.block_tables,
            meta.seq_lens, meta.query_start_loc, lora_slots,
        )  # fmt: skip


def fuse(model: nn.Module) -> FusedDecoder | None:
    """The model's fused decoder where it has one (CPU), else None; logs which."""
    try:
        fused = model.fused_decoder()
    except NotFusable as e:
        logger.info("fused decoder: off (%s)", e)
        return None
    logger.info("fused decoder: on for decode steps (--enforce-eager turns it off)")
    return fused
