"""Weight-only int8 / int4 layers: the kernels (both paths: codes times a few rows, and the
expanded weight for more) against dequantize-then-matmul, shards quantized as they arrive equal
to the whole matrix quantized, GGUF blocks taken exactly, and a tiny Llama built quantized."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm import kernels
from pagedllm.config import ModelArchConfig
from pagedllm.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear
from pagedllm.layers.quantization import (
    MAX_GEMV_ROWS,
    Int4LinearMethod,
    Int4Weight,
    Int8LinearMethod,
    Int8Weight,
    Int8xWeight,
    QuantizationConfig,
    UnquantizedLinearMethod,
    code_layer_kinds,
    layers_with_codes,
    pack_int4,
    unpack_int4,
)
from pagedllm.layers.weight_utils import weight_bytes
from pagedllm.model_loader.gguf_codes import codes_from_gguf
from pagedllm.models import LlamaForCausalLM

# Relative to max |reference|: float32 sums in another order; bfloat16 rounds the output (and
# the activations and scales, which the reference then uses as they are).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
SHAPES = [(64, 32), (96, 160), (960, 576)]  # (N, K); K = 160 is 5 groups of 32


def quantized(kind: str, weight, bias=None, dtype=None) -> ColumnParallelLinear:
    """A layer of `kind` (int8 / int4) loaded with `weight` (a float tensor or codes)."""
    n, k = weight.shape
    dtype = dtype or (weight.dtype if isinstance(weight, torch.Tensor) else torch.float32)
    layer = ColumnParallelLinear(k, n, bias is not None, dtype, QuantizationConfig(kind))
    layer.weight_loader(layer.weight, weight)
    if bias is not None:
        layer.weight_loader(layer.bias, bias)
    return layer


def dequantized(layer) -> torch.Tensor:
    return layer.quant_method.dequantize(layer)


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
    layer = quantized(kind, w, b)
    w_deq = dequantized(layer)
    # The quantization itself is close to the float weight (it is a weight-only error budget).
    step = w.float().abs().reshape(n, -1, 32).amax(-1).repeat_interleave(32, 1)
    step = step / (127 if kind == "int8" else 7)
    assert ((w_deq - w.float()).abs() <= step).all()
    # One token, 1-3 rows left over after tiles of 4, the most rows multiplied as codes, the
    # first expanded to a GEMM, and leading dimensions.
    for lead in [(1,), (2,), (3,), (7,), (MAX_GEMV_ROWS,), (MAX_GEMV_ROWS + 1,), (2, 5)]:
        x = torch.randn(*lead, k, generator=g).to(dtype)
        _check(layer(x), _reference(x, w_deq, b), dtype)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_expanded_weight_is_the_dequantized_one(kind, dtype, backend):
    """weight_as (the kernels' expansion into the shared scratch buffer) == dequantize(), rounded
    once to dtype; a smaller layer after a bigger one reuses the buffer correctly."""
    for n, k in [(96, 160), (32, 64)]:
        layer = quantized(kind, torch.randn(n, k))
        assert torch.equal(layer.quant_method.weight_as(layer, dtype), dequantized(layer).to(dtype))


@pytest.mark.parametrize("offset", [0.0, 20.0])
def test_int4_one_bfloat16_row(offset, backend):
    """One bfloat16 row (a single stream's decode) takes AVX512-BF16 dot products where the CPU
    has them, with 128 added to every code and taken back through the min term: a large mean in
    x (offset) is the hard case for that cancellation. Within bfloat16's rounding of y."""
    g = torch.Generator().manual_seed(3)
    for k in (64, 576, 1536):  # 2, 18 and 48 blocks: whole pairs
        layer = quantized("int4", torch.randn(48, k, generator=g))
        x = (torch.randn(1, k, generator=g) + offset).bfloat16()
        _check(layer(x), _reference(x, dequantized(layer), None), torch.bfloat16)


def test_int4_packing_is_ggmls_order():
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (3, 32)
    assert torch.equal(packed[:, 5] & 15, q[:, 5]) and torch.equal(packed[:, 5] >> 4, q[:, 21])
    assert torch.equal(packed[:, 16 + 2] >> 4, q[:, 32 + 16 + 2])  # second block
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shards_quantized_as_they_arrive_equal_the_whole_matrix(kind, dtype):
    """Rows and 32-column groups quantize on their own: a packed layer loading its parts one by
    one (rounded to the dtype first) holds the codes of the whole matrix, bit for bit; so do the
    codes' own row and column slices."""
    w = torch.randn(80, 96)
    whole = quantized(kind, w.to(dtype))
    merged = MergedColumnParallelLinear(96, [48, 32], False, dtype, QuantizationConfig(kind))
    merged.weight_loader(merged.weight, w[48:], 1)  # the parts in any order, from float32
    merged.weight_loader(merged.weight, w[:48], 0)
    for name in ("weight", "weight_scale", "weight_min")[: 2 + (kind == "int4")]:
        assert torch.equal(getattr(merged, name), getattr(whole, name)), name
    codes_cls = Int8Weight if kind == "int8" else Int4Weight
    codes = codes_cls.from_float(w)
    assert torch.equal(codes.narrow(0, 16, 32).dequantize(), codes.dequantize()[16:48])
    columns = codes_cls.from_float(w[:, 32:]).dequantize()
    assert torch.equal(codes.narrow(1, 32, 64).dequantize(), columns)
    with pytest.raises(ValueError, match="groups of 32"):
        codes.narrow(1, 16, 32)


def test_int4_codes():
    w = torch.randn(32, 64)
    codes = Int4Weight.from_float(w)
    assert codes.q.dtype == torch.uint8 and int(codes.q.max()) <= 15
    assert codes.scale.shape == codes.min.shape == (32, 2)
    # A constant group (scale 0) comes back exactly.
    flat = Int4Weight.from_float(torch.full((16, 32), 0.25))
    assert torch.equal(flat.dequantize(), torch.full((16, 32), 0.25))


def test_int8_codes():
    codes = Int8Weight.from_float(torch.randn(32, 64))
    assert codes.q.dtype == torch.int8 and int(codes.q.abs().max()) == 127


def test_input_size_must_be_whole_blocks():
    with pytest.raises(ValueError, match="in_features % 32"):
        Int4Weight.from_float(torch.randn(16, 48))
    # Such a layer stays float.
    layer = ColumnParallelLinear(48, 16, quant_config=QuantizationConfig("int4"))
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_follows_the_input_dtype(dtype, backend):
    """The codes and their float16 scales are what they are; the bias is in the model's dtype;
    the output takes the input's dtype."""
    layer = quantized("int8", torch.randn(32, 64), torch.randn(32), dtype)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == torch.float16
    assert layer.bias.dtype == dtype
    layer4 = quantized("int4", torch.randn(32, 64), dtype=dtype)
    assert layer4.weight.dtype == torch.uint8 and layer4.weight_min.dtype == torch.float16
    x = torch.randn(3, 64, dtype=dtype)
    assert layer(x).dtype == layer4(x).dtype == dtype
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert layer4(x.to(other)).dtype == other
    assert layer4.quant_method.nbytes(layer4) == 32 * 32 + 2 * 32 * 2 * 2  # codes, scales, mins
    assert weight_bytes(layer4) == layer4.quant_method.nbytes(layer4)


# -- GGUF blocks --------------------------------------------------------------------------------
def _gguf_reference(raw: np.ndarray, qtype) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype))


_Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [_Q.Q4_0, _Q.Q4_1, _Q.Q8_0, _Q.Q5_0])
def test_gguf_blocks_are_taken_exactly(qtype, backend):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 96)) * 0.05 + 0.01).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    ref = _gguf_reference(raw, qtype)
    codes = codes_from_gguf(raw, qtype)
    int8 = qtype in (_Q.Q8_0, _Q.Q5_0)  # Q5_0: int8 codes q - 16 in -16..15
    assert isinstance(codes, Int8Weight if int8 else Int4Weight)
    assert codes.q.shape == (48, 96)
    assert torch.equal(codes.dequantize(), ref)  # the same float32 weights, bit for bit
    layer = quantized("int8" if int8 else "int4", codes)
    assert torch.equal(dequantized(layer), ref)  # float16 scales and mins lose nothing
    assert torch.equal(layer.quant_method.weight_as(layer, torch.float32), ref)
    for rows in (1, 5, MAX_GEMV_ROWS + 1):
        x = torch.randn(rows, 96)
        _check(layer(x), _reference(x, ref, None), torch.float32)
    with pytest.raises(ValueError, match="codes, not int"):
        quantized("int4" if int8 else "int8", codes)


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
    layer = quantized("int4", codes)
    bound = (15 * codes.scale + codes.min.abs()) * 2.0**-11 + 1e-7
    assert ((dequantized(layer) - ref).abs() <= bound.repeat_interleave(32, dim=1)).all()
    x = torch.randn(3, k)
    _check(layer(x), _reference(x, dequantized(layer), None), torch.float32)


@pytest.mark.parametrize("kind", ["int6", "int8x"])
@pytest.mark.parametrize("qtype", [_Q.Q6_K, _Q.Q5_K, _Q.Q5_1, _Q.MXFP4])
def test_gguf_int8x_blocks_are_taken_exactly(qtype, kind):
    """Random blocks with sane float16 d (and dmin / m; MXFP4: exponents in float16's range):
    the int8x codes give gguf's weights bit for bit; the integer layer (in 6 bits, or 8) keeps
    the scales in float16 (2^-11 relative at most; MXFP4's powers of two exactly) and its product
    is the float64 one of the same numbers, within float32 rounding."""
    rng = np.random.default_rng(2)
    n, k = 48, 512
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
    for byte in {_Q.Q6_K: (208,), _Q.Q5_K: (0, 2), _Q.Q5_1: (0, 2), _Q.MXFP4: ()}[qtype]:
        d = (rng.random((len(blocks), 1)) * 0.01).astype(np.float16)  # d, dmin / m
        blocks[:, byte : byte + 2] = d.view(np.uint8)
    if qtype == _Q.MXFP4:  # E8M0 exponents: scales 2^-24 .. 2^15, float16's whole range
        blocks[:, 0] = rng.integers(104, 144, len(blocks))
    raw = blocks.reshape(n, -1)
    ref = _gguf_reference(raw, qtype)
    codes = codes_from_gguf(raw, qtype)
    assert isinstance(codes, Int8xWeight) and codes.q.shape == (n, k)
    assert torch.equal(codes.dequantize(), ref)
    config = QuantizationConfig("int8_act", code_kinds={"w": kind})
    layer = ColumnParallelLinear(k, n, False, torch.float32, config, prefix="w")
    layer.weight_loader(layer.weight, codes)
    layer.quant_method.process_weights_after_loading(layer)
    assert hasattr(layer, "int8_act_mins") == (qtype not in (_Q.Q6_K, _Q.MXFP4))  # all 0
    kept = Int8xWeight(codes.q, codes.scale.half().float(), codes.min.half().float())
    if qtype == _Q.MXFP4:
        assert torch.equal(kept.dequantize(), ref)  # powers of two: float16 holds them
        assert int(codes.q.abs().max()) == 12  # e2m1 doubled: codes in -12..12
    bound = (32 * codes.scale.abs().repeat_interleave(16, dim=1)
             + codes.min.abs().repeat_interleave(32, dim=1)) * 2.0**-11 + 1e-7  # fmt: skip
    assert ((kept.dequantize() - ref).abs() <= bound).all()
    x = torch.randn(3, k)
    xq, d, _, _ = kernels.cpu_ops().int8_act_quantize(x)
    xd = (xq.double().reshape(3, -1, 32) * d.double()[..., None]).reshape(3, k)
    want = xd @ kept.dequantize().double().T
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)


def test_other_gguf_types_are_not_codes():
    raw = np.ones((16, 128), np.uint8)  # 64 float16 per row
    assert codes_from_gguf(raw, _Q.F16) is None


# -- a model built quantized --------------------------------------------------------------------
CONFIG = dict(
    architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)  # fmt: skip


def random_checkpoint(tie: bool) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """A tiny Llama's config and random float32 weights (packed layers stored whole)."""
    config = ModelArchConfig(**CONFIG, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return config, dict(model.named_parameters())


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("tie", [False, True])
def test_model_built_quantized(method, tie):
    config, state = random_checkpoint(tie)
    float_model = LlamaForCausalLM(config)
    float_model.load_weights(state)
    model = LlamaForCausalLM(config, quant_config=QuantizationConfig(method))
    model.load_weights(state)
    kind = Int8LinearMethod if method == "int8" else Int4LinearMethod
    # A tied lm_head gets int8 codes of its own; the float embedding stays for the lookups.
    assert isinstance(model.lm_head.quant_method, Int8LinearMethod if tie else kind)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    for layer in model.model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                     layer.mlp.down_proj):  # fmt: skip
            assert isinstance(proj.quant_method, kind)
    assert not any(
        p.dtype == torch.float32 and p.dim() == 2 for p in model.model.layers.parameters()
    )
    assert weight_bytes(model) < weight_bytes(float_model)
    assert model.dtype == torch.float32
    head = model.lm_head
    if tie or method == "int8":  # the head's codes: its float weight's (the embedding's)
        name = "model.embed_tokens.weight" if tie else "lm_head.weight"
        expected = Int8Weight.from_float(state[name])
        assert torch.equal(head.weight, expected.q)
        assert torch.equal(head.weight_scale, expected.scale.half())


def test_layers_built_to_take_codes_take_them():
    config, state = random_checkpoint(True)
    exact = Int4Weight.from_float(torch.zeros(64, 96))  # not what down_proj's floats give
    embedding = Int8Weight.from_float(torch.flip(state["model.embed_tokens.weight"], [0]))
    codes = {"model.layers.0.mlp.down_proj.weight": exact, "model.embed_tokens.weight": embedding}
    taking = frozenset({"model.layers.0.mlp.down_proj", "lm_head"})
    model = LlamaForCausalLM(config, quant_config=QuantizationConfig("int4", False, taking))
    state["model.layers.0.mlp.down_proj.weight"] = torch.randn(64, 96)  # not read
    model.load_weights(state, codes)
    down = model.model.layers[0].mlp.down_proj
    assert torch.equal(down.quant_method.dequantize(down), exact.dequantize())
    assert torch.equal(model.lm_head.weight, embedding.q)  # the tied head: the embedding's codes
    # The embedding itself stays the checkpoint's floats.
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])


def test_layers_with_codes_need_every_part_in_the_methods_kind():
    q4, q8 = Int4Weight, Int8Weight
    mapping = LlamaForCausalLM.packed_modules_mapping
    kinds = {f"model.layers.0.self_attn.{p}_proj.weight": q4 for p in "qkv"}
    kinds["model.layers.1.self_attn.q_proj.weight"] = q4  # no k / v: not taken
    kinds |= {"model.layers.1.mlp.gate_proj.weight": q4, "model.layers.1.mlp.up_proj.weight": q8}
    kinds["model.layers.0.mlp.down_proj.weight"] = q4
    kinds["model.layers.0.mlp.down_proj.bias"] = q4  # not a weight
    kinds["model.layers.2.self_attn.qkv_proj.weight"] = q4  # stored fused (Phi-3)
    kinds["model.embed_tokens.weight"] = q8
    assert layers_with_codes(kinds, mapping, "int4", tie_word_embeddings=True) == {
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.2.self_attn.qkv_proj",
        "model.layers.0.mlp.down_proj",
        "lm_head",  # the tied head: the embedding's int8 codes
    }
    assert layers_with_codes(kinds, mapping, "int8", tie_word_embeddings=False) == {
        "model.embed_tokens"  # an embedding takes no codes: harmless
    }
    assert layers_with_codes(kinds, mapping, "none", tie_word_embeddings=True) == set()
    # The integer path takes Q6_K / Q5_K codes as int6, with int4's beside them too, and a layer
    # that mixes int8's with others as int8x; the other methods do not.
    kinds["model.layers.3.mlp.down_proj.weight"] = Int8xWeight
    kinds["model.layers.3.mlp.gate_proj.weight"] = q4
    kinds["model.layers.3.mlp.up_proj.weight"] = Int8xWeight
    found = code_layer_kinds(kinds, mapping, tie_word_embeddings=True)
    assert found["model.layers.1.mlp.gate_up_proj"] == "int8x"
    assert found["model.layers.3.mlp.down_proj"] == "int6"
    assert found["model.layers.3.mlp.gate_up_proj"] == "int6"
    assert found["model.layers.0.mlp.down_proj"] == "int4" and found["lm_head"] == "int8"
    kinds["model.embed_tokens.weight"] = Int8xWeight  # a Q6_K embedding, tied
    assert code_layer_kinds(kinds, mapping, tie_word_embeddings=True)["lm_head"] == "int6"
    assert "lm_head" not in layers_with_codes(kinds, mapping, "int8", tie_word_embeddings=True)
