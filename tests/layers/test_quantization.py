"""Weight-only int8 / int4 linear layers: the kernels (both paths: codes times a few rows, and
the expanded weight for more) against dequantize-then-matmul, GGUF blocks taken exactly, and
quantize_model on a tiny Llama."""

from __future__ import annotations

import gc
import weakref

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from pagedllm import kernels
from pagedllm.config import ModelArchConfig
from pagedllm.layers import quantization
from pagedllm.layers.quantization import (
    Int4Linear,
    Int4Weight,
    Int8Linear,
    Int8Weight,
    pack_int4,
    quantize_model,
    unpack_int4,
    weight_bytes,
)
from pagedllm.model_loader.gguf_codes import codes_from_gguf
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


@pytest.fixture(params=["kernels", "torch"])
def backend(request, monkeypatch):
    """Run each layer test with pagedllm's kernels and with the torch fallback."""
    if request.param == "torch":
        monkeypatch.setattr(kernels, "available", lambda: False)
        monkeypatch.setattr(kernels, "fused_cpu_ops_apply", lambda x: False)
    elif not kernels.available():
        pytest.skip("the C++ kernels do not build here")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_matmul_equals_dequantized_reference(kind, bias, shape, dtype, backend):
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    layer = Int8Linear.from_float(w, b) if kind == "int8" else Int4Linear.from_float(w, b)
    w_deq = layer.dequantize()
    # The quantization itself is close to the float weight (it is a weight-only error budget).
    step = w.float().abs().reshape(n, -1, 32).amax(-1).repeat_interleave(32, 1)
    step = step / (127 if kind == "int8" else 7)
    assert ((w_deq - w.float()).abs() <= step).all()
    # One token, 1-3 rows left over after tiles of 4, the most rows multiplied as codes, the
    # first expanded to a GEMM, and leading dimensions.
    rows = quantization.MAX_GEMV_ROWS
    for lead in [(1,), (2,), (3,), (7,), (rows,), (rows + 1,), (2, 5)]:
        x = torch.randn(*lead, k, generator=g).to(dtype)
        _check(layer(x), _reference(x, w_deq, b), dtype)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_expanded_weight_is_the_dequantized_one(kind, dtype, backend):
    """weight_as (the kernels' expansion into the shared scratch buffer) == dequantize(), rounded
    once to dtype; a smaller layer after a bigger one reuses the buffer correctly."""
    for n, k in [(96, 160), (32, 64)]:
        w = torch.randn(n, k)
        layer = Int8Linear.from_float(w) if kind == "int8" else Int4Linear.from_float(w)
        assert torch.equal(layer.weight_as(dtype), layer.dequantize().to(dtype))


@pytest.mark.parametrize("offset", [0.0, 20.0])
def test_int4_one_bfloat16_row(offset, backend):
    """One bfloat16 row (a single stream's decode) takes AVX512-BF16 dot products where the CPU
    has them, with 128 added to every code and taken back through the min term: a large mean in
    x (offset) is the hard case for that cancellation. Within bfloat16's rounding of y."""
    g = torch.Generator().manual_seed(3)
    for k in (64, 576, 1536):  # 2, 18 and 48 blocks: whole pairs
        layer = Int4Linear.from_float(torch.randn(48, k, generator=g))
        x = (torch.randn(1, k, generator=g) + offset).bfloat16()
        _check(layer(x), _reference(x, layer.dequantize(), None), torch.bfloat16)


def test_int4_packing_is_ggmls_order():
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (3, 32)
    assert torch.equal(packed[:, 5] & 15, q[:, 5]) and torch.equal(packed[:, 5] >> 4, q[:, 21])
    assert torch.equal(packed[:, 16 + 2] >> 4, q[:, 32 + 16 + 2])  # second block
    assert torch.equal(unpack_int4(packed), q)


def test_int4_codes_and_fusing():
    w = torch.randn(32, 64)
    codes = Int4Weight.from_float(w, 32)
    assert codes.q.dtype == torch.uint8 and int(codes.q.max()) <= 15
    assert codes.scale.shape == codes.min.shape == (32, 2)
    # Rows quantize independently, so fusing codes = quantizing the fused matrix.
    top, bottom = Int4Weight.from_float(w[:16], 32), Int4Weight.from_float(w[16:], 32)
    assert torch.equal(Int4Weight.cat([top, bottom]).dequantize(), codes.dequantize())
    # A constant group (scale 0) comes back exactly.
    flat = Int4Weight.from_float(torch.full((16, 32), 0.25), 32)
    assert torch.equal(flat.dequantize(), torch.full((16, 32), 0.25))
    # Groups of several blocks.
    wide = Int4Linear(Int4Weight.from_float(w, 64), None, torch.float32)
    assert wide.group_size == 64 and wide.scales.shape == (32, 1)
    x = torch.randn(2, 64)
    _check(wide(x), _reference(x, wide.dequantize(), None), torch.float32)


def test_int8_codes_and_fusing():
    w = torch.randn(32, 64)
    codes = Int8Weight.from_float(w)
    assert codes.q.dtype == torch.int8 and int(codes.q.abs().max()) == 127
    top, bottom = Int8Weight.from_float(w[:16]), Int8Weight.from_float(w[16:])
    assert torch.equal(Int8Weight.cat([top, bottom]).dequantize(), codes.dequantize())


def test_input_size_must_be_whole_blocks():
    with pytest.raises(ValueError, match="in_features % 32"):
        Int4Linear.from_float(torch.randn(16, 48))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_follows_module_to_dtype(dtype, backend):
    """module.to(dtype) casts the bias, never the codes or their float16 scales; the output
    takes the input's dtype."""
    layer = Int8Linear.from_float(torch.randn(32, 64), torch.randn(32)).to(dtype)
    assert layer.qweight.dtype == torch.int8 and layer.scales.dtype == torch.float16
    assert layer.bias.dtype == dtype
    layer4 = Int4Linear.from_float(torch.randn(32, 64)).to(dtype)
    assert layer4.packed.dtype == torch.uint8 and layer4.mins.dtype == torch.float16
    x = torch.randn(3, 64, dtype=dtype)
    assert layer(x).dtype == layer4(x).dtype == dtype
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert layer4(x.to(other)).dtype == other
    assert layer4.nbytes == 32 * 32 + 2 * 32 * 2 * 2  # codes, scales and mins


# -- GGUF blocks --------------------------------------------------------------------------------
def _gguf_reference(raw: np.ndarray, qtype) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype))


_Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [_Q.Q4_0, _Q.Q4_1, _Q.Q8_0])
def test_gguf_blocks_are_taken_exactly(qtype, backend):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 96)) * 0.05 + 0.01).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    ref = _gguf_reference(raw, qtype)
    codes = codes_from_gguf(raw, qtype)
    assert isinstance(codes, Int8Weight if qtype == _Q.Q8_0 else Int4Weight)
    assert codes.group_size == 32 and codes.q.shape == (48, 96)
    assert torch.equal(codes.dequantize(), ref)  # the same float32 weights, bit for bit
    layer = (Int8Linear if qtype == _Q.Q8_0 else Int4Linear)(codes, None, torch.float32)
    assert torch.equal(layer.dequantize(), ref)  # float16 scales and mins lose nothing
    assert torch.equal(layer.weight_as(torch.float32), ref)
    for rows in (1, 5, quantization.MAX_GEMV_ROWS + 1):
        x = torch.randn(rows, 96)
        _check(layer(x), _reference(x, ref, None), torch.float32)


def test_gguf_q4_k_blocks_up_to_float16_scales():
    """The gguf package cannot quantize Q4_K: random super-blocks with sane float16 d / dmin.
    The codes give gguf's weights exactly; the layer keeps d sc and dmin m in float16, which
    may round them (2^-11 relative at most)."""
    rng = np.random.default_rng(1)
    n, k = 32, 512
    block_size, type_size = gguf.GGML_QUANT_SIZES[_Q.Q4_K]
    blocks = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
    blocks[:, 0:2] = (rng.random((len(blocks), 1)) * 0.01).astype(np.float16).view(np.uint8)
    blocks[:, 2:4] = (rng.random((len(blocks), 1)) * 0.01).astype(np.float16).view(np.uint8)
    raw = blocks.reshape(n, -1)
    ref = _gguf_reference(raw, _Q.Q4_K)
    codes = codes_from_gguf(raw, _Q.Q4_K)
    assert torch.equal(codes.dequantize(), ref)
    layer = Int4Linear(codes, None, torch.float32)
    bound = (15 * codes.scale + codes.min.abs()) * 2.0**-11 + 1e-7
    assert ((layer.dequantize() - ref).abs() <= bound.repeat_interleave(32, dim=1)).all()
    x = torch.randn(3, k)
    _check(layer(x), _reference(x, layer.dequantize(), None), torch.float32)


def test_other_gguf_types_are_not_codes():
    raw = np.ones((16, 128), np.uint8)  # 64 float16 per row
    assert codes_from_gguf(raw, _Q.F16) is None


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
    assert linears == kept == []
    kind = Int8Linear if method == "int8" else Int4Linear
    # A tied lm_head gets an int8 copy; the float embedding stays for the lookups.
    assert isinstance(model.lm_head, Int8Linear if tie else kind)
    assert model.model.embed_tokens.weight.dtype == torch.float32
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


def test_tied_lm_head_takes_the_embeddings_int8_codes():
    model = _tiny_llama(True)
    emb = model.model.embed_tokens.weight
    exact = Int8Weight.from_float(torch.flip(emb, [0]))  # recognisably not emb's own codes
    quantize_model(model, "int4", {"model.embed_tokens": exact})
    assert torch.equal(model.lm_head.qweight, exact.q)


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
