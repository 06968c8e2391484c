"""Weight-only int8 / int4 linear layers: the kernels against dequantize-then-matmul, GGUF 4-bit
blocks taken exactly, and quantize_model on a tiny Llama."""

from __future__ import annotations

import gc
import weakref

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from pagedllm.config import ModelArchConfig
from pagedllm.layers.quantization import (
    Int4Linear,
    Int4Weight,
    Int8Linear,
    int4_group_size,
    quantize_model,
    weight_bytes,
)
from pagedllm.model_loader.gguf_int4 import int4_weight_from_gguf
from pagedllm.models import LlamaForCausalLM

# Relative to max |reference|: float32 sums in another order; bfloat16 rounds the output (and
# the activations and scales, which the reference then uses as they are).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
SHAPES = [(64, 32), (96, 160), (960, 576)]  # (N, K); K = 160 is 5 groups of 32


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Dequantized weight (float32) times the input as the layer saw it, in float64."""
    y = x.double() @ w.double().t()
    return y if bias is None else y + bias.double()


def _check(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype and y.shape == ref.shape
    err = (y.double() - ref).abs().max().item()
    assert err <= TOL[dtype] * ref.abs().max().item(), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_matmul_equals_dequantized_reference(kind, bias, shape, dtype):
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    layer = Int8Linear.from_float(w, b) if kind == "int8" else Int4Linear.from_float(w, b)
    w_deq = layer.dequantize()
    # The quantization itself is close to the float weight (it is a weight-only error budget).
    step = w.float().abs().amax(1, keepdim=True) / (127 if kind == "int8" else 7)
    assert ((w_deq - w.float()).abs() <= step).all()
    for lead in [(1,), (7,), (2, 5)]:  # one token, a batch, and leading dimensions
        x = torch.randn(*lead, k, generator=g).to(dtype)
        _check(layer(x), _reference(x, w_deq, b), dtype)


def test_int4_dequantize_matches_the_kernel_exactly():
    """dequantize() of the codes (one fused multiply-add) is exactly what the kernel uses."""
    w = Int4Weight.from_float(torch.randn(64, 128), 32)
    layer = Int4Linear(w, None, torch.float32)
    assert torch.equal(layer.dequantize(), w.dequantize())


def test_int4_codes_and_fusing():
    w = torch.randn(32, 64)
    codes = Int4Weight.from_float(w, 32)
    assert codes.q.dtype == torch.uint8 and int(codes.q.max()) <= 15
    assert codes.scale.shape == codes.zero.shape == (32, 2)
    # Rows quantize independently, so fusing codes = quantizing the fused matrix.
    top, bottom = Int4Weight.from_float(w[:16], 32), Int4Weight.from_float(w[16:], 32)
    assert torch.equal(Int4Weight.cat([top, bottom]).dequantize(), codes.dequantize())
    # A constant group (scale 0) comes back exactly.
    flat = Int4Weight.from_float(torch.full((16, 32), 0.25), 32)
    assert torch.equal(flat.dequantize(), torch.full((16, 32), 0.25))


def test_int4_group_size_fallbacks():
    assert int4_group_size(64, 576) == 32
    assert int4_group_size(64, 576, preferred=64) == 64
    assert int4_group_size(64, 48) is None  # K not a multiple of 32
    assert int4_group_size(40, 64) is None  # N not a multiple of 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_follows_module_to_dtype(dtype):
    layer = Int8Linear.from_float(torch.randn(32, 64), torch.randn(32)).to(dtype)
    assert layer.qweight.dtype == torch.int8 and layer.scales.dtype == dtype
    layer4 = Int4Linear.from_float(torch.randn(32, 64)).to(dtype)
    assert layer4.packed.dtype == torch.uint8 and layer4.scale_zero.dtype == dtype
    x = torch.randn(3, 64, dtype=dtype)
    assert layer(x).dtype == layer4(x).dtype == dtype
    # An input of another dtype than the scales still runs (scales cast on the fly).
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert layer4(x.to(other)).dtype == other


# -- GGUF 4-bit blocks --------------------------------------------------------------------------
def _gguf_reference(raw: np.ndarray, qtype) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1])
def test_gguf_q4_blocks_are_taken_exactly(qtype):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 96)) * 0.05 + 0.01).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    ref = _gguf_reference(raw, qtype)
    codes = int4_weight_from_gguf(raw, qtype)
    assert codes.group_size == 32 and codes.q.shape == (48, 96)
    assert torch.equal(codes.dequantize(), ref)  # the same float32 weights, bit for bit
    layer = Int4Linear(codes, None, torch.float32)
    assert torch.equal(layer.dequantize(), ref)
    x = torch.randn(5, 96)
    _check(layer(x), _reference(x, ref, None), torch.float32)


def test_gguf_q4_k_blocks_are_taken_up_to_the_rounding_of_zero():
    """The gguf package cannot quantize Q4_K: random super-blocks with sane float16 d / dmin.
    zero = 8 d sc - dmin m may need more than float32's 24 bits: one rounding of it is the
    only difference from gguf's dequantize."""
    rng = np.random.default_rng(1)
    n, k = 32, 512
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K]
    blocks = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
    blocks[:, 0:2] = (rng.random((len(blocks), 1)) * 0.01).astype(np.float16).view(np.uint8)
    blocks[:, 2:4] = (rng.random((len(blocks), 1)) * 0.01).astype(np.float16).view(np.uint8)
    raw = blocks.reshape(n, -1)
    qtype = gguf.GGMLQuantizationType.Q4_K
    ref = _gguf_reference(raw, qtype)
    codes = int4_weight_from_gguf(raw, qtype)
    diff = (codes.dequantize() - ref).abs()
    zero_ulp = torch.finfo(torch.float32).eps * codes.zero.abs().repeat_interleave(32, dim=1)
    assert (diff <= zero_ulp).all()
    assert (diff > 0).float().mean() < 0.01  # almost all bit for bit
    x = torch.randn(3, k)
    _check(Int4Linear(codes, None, torch.float32)(x), _reference(x, ref, None), torch.float32)


def test_other_gguf_types_are_not_int4():
    raw = gguf.quants.quantize(np.ones((16, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    assert int4_weight_from_gguf(raw, gguf.GGMLQuantizationType.Q8_0) is None


# -- quantize_model -----------------------------------------------------------------------------
def _tiny_llama(tie: bool) -> LlamaForCausalLM:
    config = ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model.eval()


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("tie", [False, True])
def test_quantize_model_swaps_projections_and_drops_floats(method, tie):
    model = _tiny_llama(tie)
    float_bytes = weight_bytes(model)
    old_weight = weakref.ref(model.model.layers[0].mlp.gate_up_proj.weight)
    kept = quantize_model(model, method)
    gc.collect()
    assert old_weight() is None  # the float weight is not kept anywhere
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert linears == kept == (["lm_head"] if tie else [])  # a tied lm_head stays float
    kind = Int8Linear if method == "int8" else Int4Linear
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, kind)
    assert isinstance(model.model.layers[1].mlp.down_proj, kind)
    assert not any(
        p.dtype == torch.float32 and p.dim() == 2 for p in model.model.layers.parameters()
    )
    assert weight_bytes(model) < float_bytes
    assert model.dtype == torch.float32


def test_quantize_model_uses_exact_int4_weights():
    model = _tiny_llama(False)
    w = model.model.layers[0].mlp.down_proj.weight
    exact = Int4Weight.from_float(torch.zeros_like(w), 32)  # different from what w quantizes to
    quantize_model(model, "int4", {"model.layers.0.mlp.down_proj": exact})
    assert torch.equal(model.model.layers[0].mlp.down_proj.dequantize(), exact.dequantize())


def test_group_by_module_fuses_only_complete_shards():
    model = _tiny_llama(False)
    names = {f"model.layers.0.self_attn.{p}_proj.weight": p for p in "qkv"}
    names["model.layers.1.self_attn.q_proj.weight"] = "lonely q"  # no k / v: not fused
    names["model.layers.0.mlp.down_proj.weight"] = "down"
    names["model.layers.0.mlp.down_proj.bias"] = "bias is not a weight"
    assert model.group_by_module(names) == {
        "model.layers.0.self_attn.qkv_proj": ["q", "k", "v"],
        "model.layers.0.mlp.down_proj": ["down"],
    }
