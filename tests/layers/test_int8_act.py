"""The integer kernels (kernels/csrc/int8_act*.cpp): 8-bit activations per row and block of 32
against a GGUF's int4 / int6 / int8 / int8x codes. Every variant this CPU has equals the plain C++
reference bit for bit at every row count; the integer sums are exact (checked where every float
step is exact too); the float result is within rounding of float64 arithmetic on the same
quantized numbers; a row quantizes, and multiplies, the same in a batch of any size."""

from __future__ import annotations

import pytest
import torch

from pagedllm import kernels
from pagedllm.layers.linear import ColumnParallelLinear
from pagedllm.layers.quantization import (
    Int4Weight,
    Int8Weight,
    Int8xWeight,
    QuantizationConfig,
    pack_int4,
)
from pagedllm.layers.quantization.int8_act import KINDS, Int8ActLinearMethod

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")
# int6 with mins (Q5_K's) and without (Q6_K's, which the layer then does not keep)
KINDS_TESTED = ["int4", "int6", "int6-no-mins", "int8", "int8x"]


def random_codes(kind: str, n: int, k: int, generator=None):
    """Codes of `kind` for a random [n, k] weight; int8x and int6 with their own scale per half
    block and a min per block (as Q5_K gives; int6-no-mins: zero mins, as Q6_K), every float16
    number as the layer keeps it."""
    w = torch.randn(n, k, generator=generator)
    if kind in ("int4", "int8"):
        codes = KINDS[kind].from_float(w)
        codes.scale = codes.scale.half().float()
        if kind == "int4":
            codes.min = codes.min.half().float()
        return codes
    low, high = (-127, 128) if kind == "int8x" else (-32, 32)
    q = torch.randint(low, high, (n, k), dtype=torch.int8, generator=generator)
    scale = (torch.rand(n, k // 16, generator=generator) * 0.02).half().float()
    mn = (torch.randn(n, k // 32, generator=generator) * 0.1).half().float()
    return Int8xWeight(q, scale, mn * (kind != "int6-no-mins"))


def kind_of(codes, kind: str = "") -> str:
    """The layer kind for `codes` (int6 for Int8xWeight codes that fit it)."""
    if kind:
        return kind.removesuffix("-no-mins")
    if isinstance(codes, Int8xWeight):
        return "int6" if codes.q.min() >= -32 and codes.q.max() <= 31 else "int8x"
    return {Int4Weight: "int4", Int8Weight: "int8"}[type(codes)]


def ops():
    return kernels.cpu_ops()


def variants() -> list[str]:
    return list(ops().int8_act_variants()) if kernels.available() else []


def layer_of(codes, bias=None, kind: str = ""):
    """A layer holding `codes` as the engine loads them (layers/quantization/int8_act.py)."""
    n, k = codes.shape
    config = QuantizationConfig("int8_act", code_kinds={"w": kind_of(codes, kind)})
    layer = ColumnParallelLinear(k, n, bias is not None, torch.float32, config, prefix="w")
    assert isinstance(layer.quant_method, Int8ActLinearMethod)
    layer.weight_loader(layer.weight, codes)
    if bias is not None:
        layer.weight_loader(layer.bias, bias)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def product(x, codes, variant="", kind=""):
    layer = layer_of(codes, kind=kind)
    return ops().int8_act_linear(x, *layer.quant_method.codes(layer), layer.quant_method.bits,
                                 codes.shape[0], variant)  # fmt: skip


def quantize_like_q8(x: torch.Tensor):
    """The activation rule in torch: d = max|x| / 127 per block, q = round(x * (1 / d))."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d == 0, 0.0, 1 / d)
    q = torch.round(blocks * inv[..., None]).clamp(-127, 127)
    return q.to(torch.int8).reshape(m, k), d, q.sum(-1).to(torch.int32)


def test_the_reference_is_always_there_and_the_cpu_variants_are_built():
    names = variants()
    assert names[-1] == "reference"
    flags = kernels.cpu_flags()
    if {"avx512_vnni", "avx512bw"} <= flags:
        assert "avx512_vnni" in names
    if {"avx2", "f16c", "fma"} <= flags:
        assert "avx2" in names
    if {"avx_vnni", "avx2", "f16c", "fma"} <= flags:
        assert "avx_vnni" in names


def test_activation_quantization_is_q8_0s_rule_and_independent_of_the_batch():
    torch.manual_seed(0)
    x = torch.randn(257, 96) * torch.rand(257, 1) * 10
    x[3, :32] = 0  # a block of zeros: scale 0, codes 0
    q, d, s, s16 = ops().int8_act_quantize(x)
    want_q, want_d, want_s = quantize_like_q8(x)
    assert torch.equal(q, want_q) and torch.equal(d, want_d) and torch.equal(s, want_s)
    assert torch.equal(s16, q.reshape(257, 6, 16).sum(-1, dtype=torch.int32))
    assert d[3, 0] == 0 and not q[3, :32].any()
    row = x[100:101]
    for batch in (1, 2, 7, 64, 257):  # the row among batch - 1 others, in the middle
        others = torch.randn(batch - 1, 96) * 50
        at = batch // 2
        qb, db, sb, hb = ops().int8_act_quantize(torch.cat([others[:at], row, others[at:]]))
        assert torch.equal(qb[at], q[100]) and torch.equal(db[at], d[100])
        assert torch.equal(sb[at], s[100]) and torch.equal(hb[at], s16[100])


@pytest.mark.parametrize("kind", KINDS_TESTED)
def test_integer_sums_are_exact(kind):
    """Integer x with a 127 in every block quantizes to itself (d = 1); unit scales and zero mins
    leave y = the integer product, every partial sum exact in float32."""
    torch.manual_seed(1)
    n, k = 40, 128
    x = torch.randint(-127, 128, (5, k)).float()
    x[:, ::32] = 127
    x[1], x[2] = 127, -127  # the largest sums a block can make, either sign
    if kind == "int4":
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        q[:2] = 15  # with x's rows 1 and 2: 32 * 15 * 127 a block, in 16 bits on AVX2
        codes = Int4Weight(pack_int4(q), torch.ones(n, k // 32), torch.zeros(n, k // 32))
    elif kind.startswith("int6"):  # every code, -32 and 31 included
        q = torch.randint(-32, 32, (n, k), dtype=torch.int8)
        q[0, :64], q[1, :64] = torch.arange(-32, 32), torch.arange(31, -33, -1)
        codes = Int8xWeight(q, torch.ones(n, k // 16), torch.zeros(n, k // 32))
    else:
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        codes = Int8Weight(q, torch.ones(n, k // 32))
        if kind == "int8x":
            codes = Int8xWeight.of(codes)
    want = x.long() @ q.long().T
    for variant in variants():
        assert torch.equal(product(x, codes, variant, kind), want.float()), variant


@pytest.mark.parametrize("kind", KINDS_TESTED)
def test_every_variant_equals_the_reference_at_every_row_count(kind):
    torch.manual_seed(2)
    n, k = 37, 96  # a partial last tile of 16 rows
    codes = random_codes(kind, n, k)
    x = torch.randn(300, k) * 3
    want = product(x, codes, "reference")
    for variant in variants():
        for rows in range(1, 301):
            got = product(x[:rows], codes, variant)
            assert torch.equal(got, want[:rows]), (variant, rows)


@pytest.mark.parametrize("kind", KINDS_TESTED)
def test_many_rows_cross_panels_and_spans_as_the_reference(kind):
    """From 32 rows the kernels block the product (int8_act.h: panels of 32 tiles, spans of 8
    blocks; int6 unpacks each panel's span once): 38 tiles and 10 blocks cross both. AVX2's int4
    takes 4 rows a call up to 512 rows, 2 above."""
    torch.manual_seed(8)
    n, k = 600, 320
    codes = random_codes(kind, n, k)
    x = torch.randn(513, k) * 3
    want = product(x, codes, "reference", kind)
    for variant in variants():
        for rows in (31, 32, 33, 100, 512, 513):
            got = product(x[:rows], codes, variant, kind)
            assert torch.equal(got, want[:rows]), (variant, rows)


@pytest.mark.parametrize("kind", KINDS_TESTED)
@pytest.mark.parametrize("seed", range(4))
def test_random_shapes_against_the_reference_and_float64(kind, seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 300, (1,), generator=g))
    k = 32 * int(torch.randint(1, 40, (1,), generator=g))
    m = int(torch.randint(1, 70, (1,), generator=g))
    codes = random_codes(kind, n, k, g)  # float16 scales (and mins), as the layer keeps them
    x = torch.randn(m, k, generator=g) * 4
    want = product(x, codes, "reference")
    for variant in variants():
        assert torch.equal(product(x, codes, variant), want), variant
    # Within rounding of the same quantized numbers in float64.
    q, d, _ = quantize_like_q8(x)
    xd = (q.double().reshape(m, k // 32, 32) * d.double()[..., None]).reshape(m, k)
    exact = xd @ codes.dequantize().double().T
    torch.testing.assert_close(
        want.double(), exact, rtol=1e-5, atol=1e-4 * exact.abs().max().item()
    )
    # And close to the float product: 8-bit activations' error only.
    err = (want - x @ codes.dequantize().T).abs().max() / exact.abs().max()
    assert err < 0.03


@pytest.mark.parametrize("kind", KINDS_TESTED)
def test_bfloat16_x_is_quantized_from_its_exact_value(kind):
    torch.manual_seed(3)
    codes = random_codes(kind, 64, 64)
    x = torch.randn(9, 64).bfloat16()
    got = product(x, codes)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, product(x.float(), codes).bfloat16())


@pytest.mark.parametrize("kind", KINDS_TESTED)
@pytest.mark.parametrize(
    "slices",
    [((0, 13), (13, 20), (33, 17)), ((0, 4), (4, 4), (8, 30), (38, 3), (41, 9))],
    ids=["across-tiles", "within-a-tile"],
)
def test_the_layer_holds_the_codes_in_the_kernels_layout_and_nothing_else(kind, slices):
    """Slices written as they arrive (q, k, v parts at their rows; a Gated DeltaNet's b and a,
    4 rows each, inside one tile; 50 rows: a partial tile)."""
    torch.manual_seed(4)
    n, k = 50, 64
    codes = random_codes(kind, n, k)
    bias = torch.randn(n)
    whole = layer_of(codes, bias)
    config = QuantizationConfig("int8_act", code_kinds={"w": kind_of(codes, kind)})
    layer = ColumnParallelLinear(k, n, True, torch.float32, config, prefix="w")
    for start, size in slices:
        layer.quant_method.load_weight(layer, codes.narrow(0, start, size), start)
    layer.weight_loader(layer.bias, bias)
    layer.quant_method.process_weights_after_loading(layer)
    assert not hasattr(layer, "weight") and not hasattr(layer, "weight_scale")
    padded, bits = 64, {"int4": 4, "int8": 8, "int8x": 8}.get(kind, 6)  # 50 rows in tiles of 16
    # float16 scales (and mins) per block; Q6_K's zero mins are not kept
    per_block = {"int4": 2, "int6": 3, "int6-no-mins": 2, "int8": 1, "int8x": 3}[kind]
    want = padded * k * bits // 8 + padded * k // 32 * 2 * per_block
    assert layer.quant_method.nbytes(layer) == want
    for a, b in zip(layer.quant_method.codes(layer), whole.quant_method.codes(whole), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    x = torch.randn(7, k)
    q, d, _ = quantize_like_q8(x)
    xd = (q.double().reshape(7, k // 32, 32) * d.double()[..., None]).reshape(7, k)
    want = xd @ codes.dequantize().double().T + bias.double()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(layer(x), whole(x))


@pytest.mark.parametrize("kind", ["int8", "int6", "int6-no-mins"])
def test_a_tied_heads_codes_serve_the_embeddings_lookups(kind):
    """Tied to an integer head with int8 (or int6: a Q6_K embedding) codes, the embedding keeps
    no float copy: its rows are gathered from the head's codes, the float rows bit for bit, and
    the checkpoint tensor it is handed is only checked, never dequantized."""
    from pagedllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    torch.manual_seed(5)
    vocab, hidden = 70, 64
    codes = random_codes(kind, vocab, hidden)
    embedding = VocabParallelEmbedding(vocab, hidden)
    config = QuantizationConfig("int8_act", code_kinds={"lm_head": kind_of(codes, kind)})
    head = ParallelLMHead(vocab, hidden, torch.float32, config, tied=True)
    assert head.codes_hold_the_embedding()
    head.tie_weights(embedding)
    assert embedding.takes_codes and embedding.weight.numel() == 0
    embedding.weight.weight_loader(embedding.weight, codes)  # a shape check only
    with pytest.raises(ValueError):
        embedding.weight.weight_loader(embedding.weight, codes.narrow(0, 0, 32))
    head.weight_loader(head.weight, codes)
    head.quant_method.process_weights_after_loading(head)
    ids = torch.tensor([0, 1, 15, 16, 17, 33, 69, 5, 5])
    assert torch.equal(embedding(ids), codes.dequantize()[ids])


@pytest.mark.parametrize(("k_kind", "want_kind"), [("int4", "int6"), ("int8", "int8x")])
def test_a_layer_whose_parts_mix_kinds_takes_them_all_as_one(k_kind, want_kind):
    """A fused qkv whose q is int4 (Q4_K), k int4 or int8 (Q8_0) and v Q6_K's codes, as Q4_K_M
    files mix them: int6 where every part fits 6 bits, int8x with int8's; every part's weights
    exactly, multiplied in one call."""
    from pagedllm.layers.linear import QKVParallelLinear
    from pagedllm.layers.quantization import code_layer_kinds

    torch.manual_seed(6)
    hidden, head_dim = 64, 16
    parts = {"q": random_codes("int4", 64, hidden), "k": random_codes(k_kind, 32, hidden),
             "v": random_codes("int6-no-mins", 32, hidden)}  # fmt: skip
    names = {f"model.layers.0.self_attn.{p}_proj.weight": type(c) for p, c in parts.items()}
    mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    kinds = code_layer_kinds(names, mapping, tie_word_embeddings=False)
    assert kinds == {"model.layers.0.self_attn.qkv_proj": want_kind}
    config = QuantizationConfig("int8_act", code_kinds={"qkv": want_kind})
    layer = QKVParallelLinear(hidden, head_dim, 4, 2, False, torch.float32, config, prefix="qkv")
    for shard, codes in enumerate(parts.values()):
        layer.weight_loader(layer.weight, codes, shard)
    layer.quant_method.process_weights_after_loading(layer)
    weight = torch.cat([c.dequantize() for c in parts.values()])
    assert torch.equal(Int8xWeight.of(parts["q"]).dequantize(), parts["q"].dequantize())
    x = torch.randn(5, hidden)
    q, d, _ = quantize_like_q8(x)
    xd = (q.double().reshape(5, 2, 32) * d.double()[..., None]).reshape(5, hidden)
    torch.testing.assert_close(layer(x).double(), xd @ weight.double().T, rtol=1e-5, atol=1e-4)


def test_int6s_layout_holds_every_code_and_refuses_wider_ones():
    from pagedllm.layers.quantization.int8_act import int6_codes

    q = torch.randint(-32, 32, (20, 96), dtype=torch.int8)
    q[0, :64] = torch.arange(-32, 32)
    chunks = ops().int8_act_int6_words(q).view(torch.uint8).reshape(20, 3, 6, 4)
    assert chunks.shape == (20, 3, 6, 4) and chunks.dtype == torch.uint8
    assert torch.equal(int6_codes(chunks).reshape(20, 96), q.to(torch.int16))
    # chunk 0 holds codes 0-3 (low nibbles) and 16-19 (high) of each block in int4's layout
    u = (q + 32).to(torch.uint8)
    assert torch.equal(chunks[:, 0, 0], (u[:, :4] & 15) | (u[:, 16:20] & 15) << 4)
    # chunk 4 holds the high bit pairs of codes 0-3, 16-19, 4-7 and 20-23, from bit 0
    hb = u >> 4
    pairs = hb[:, :4] | hb[:, 16:20] << 2 | hb[:, 4:8] << 4 | hb[:, 20:24] << 6
    assert torch.equal(chunks[:, 0, 4], pairs)
    with pytest.raises(ValueError, match="-32..31"):
        ops().int8_act_int6_words(torch.full((1, 32), 32, dtype=torch.int8))


def test_an_int6_layer_takes_float_rows_as_6_bit_codes():
    """Float rows (a tied head's padding, float weights) given to an int6 layer are quantized to
    6-bit codes per half block; the layer then holds those numbers."""
    torch.manual_seed(9)
    w = torch.randn(20, 64)
    codes = Int8xWeight.from_float(w, bits=6)
    assert codes.q.abs().max() == 31 and not codes.min.any()
    assert (codes.dequantize() - w).abs().max() <= codes.scale.max() / 2 + 1e-6
    layer = layer_of(w, kind="int6")
    x = torch.randn(3, 64)
    q, d, _ = quantize_like_q8(x)
    xd = (q.double().reshape(3, 2, 32) * d.double()[..., None]).reshape(3, 64)
    kept = Int8xWeight(codes.q, codes.scale.half().float(), codes.min)
    want = xd @ kept.dequantize().double().T
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)
