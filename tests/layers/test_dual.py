"""--quantization auto's layers (layers/quantization/dual.py): in bfloat16 the checkpoint's codes
for steps of up to max_code_rows rows, the same weights in the model's dtype above, both copies
holding the codes' numbers and each path exactly its kernel; in float32 the codes alone at every
row count. The config gives dual layers only where the checkpoint has codes for every part of a
layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import kernels
from pagedllm.layers.linear import ColumnParallelLinear
from pagedllm.layers.quantization import (
    DualLinearMethod,
    Int4Weight,
    Int8Weight,
    QuantizationConfig,
    UnquantizedLinearMethod,
    can_pack,
    code_layer_kinds,
)
from pagedllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.weight_utils import weight_bytes
from pagedllm.models import LlamaForCausalLM

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")
CODES = {"int4": Int4Weight, "int8": Int8Weight}


def dual_layer(kind: str, codes, dtype, bias=None, prepack=False, fixed_order=False):
    n, k = codes.shape
    config = QuantizationConfig("auto", prepack, code_kinds={"w": kind}, fixed_order=fixed_order)
    layer = ColumnParallelLinear(k, n, bias is not None, dtype, config, prefix="w")
    assert isinstance(layer.quant_method, DualLinearMethod)
    layer.weight_loader(layer.weight, codes)
    if bias is not None:
        layer.weight_loader(layer.bias, bias)
    return layer


@pytest.mark.parametrize("kind", sorted(CODES))
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_order_multiplies_the_codes_at_every_row_count(kind, with_bias, dtype):
    """--deterministic keeps no float copy: every step, whatever its rows, is the codes
    kernel in float32 (bfloat16 activations widened, the result with its bias rounded once)."""
    torch.manual_seed(0)
    codes = CODES[kind].from_float(torch.randn(96, 160))
    bias = torch.randn(96).to(dtype) if with_bias else None
    layer = dual_layer(kind, codes, dtype, bias, fixed_order=True)
    method = layer.quant_method
    assert method.codes_only and not hasattr(layer, "dense_weight")
    w = method.codes_method.dequantize(layer)
    torch.testing.assert_close(w, codes.dequantize(), rtol=0, atol=1e-2)
    ops = kernels.cpu_ops()
    for rows in (1, 3, 49, 64):
        x = torch.randn(rows, 160).to(dtype)
        want = getattr(ops, f"{kind}_linear")(x.float(), *method.codes(layer))
        want = (want if bias is None else want + bias.float()).to(dtype)
        assert torch.equal(layer(x), want), rows
        exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(layer(x), exact.to(dtype), rtol=tol, atol=tol)
    assert layer(torch.randn(2, 5, 160).to(dtype)).shape == (2, 5, 96)  # leading dims: 10 rows
    assert method.bytes_read(layer, 256) == method.nbytes(layer) < 96 * 160 * dtype.itemsize
    bias_bytes = 0 if bias is None else 96 * dtype.itemsize
    assert weight_bytes(layer) == method.nbytes(layer) + bias_bytes


def test_float32_without_fixed_order_takes_the_float_copy_above_max_code_rows():
    """--no-deterministic: the codes up to max_code_rows rows, MKL on the float copy above."""
    torch.manual_seed(0)
    codes = Int4Weight.from_float(torch.randn(96, 160))
    layer = dual_layer("int4", codes, torch.float32)
    method = layer.quant_method
    assert not method.codes_only and method.max_code_rows == 48
    for rows in (1, 48, 49):
        x = torch.randn(rows, 160)
        want = (
            kernels.cpu_ops().int4_linear(x, *method.codes(layer))
            if rows <= 48
            else F.linear(x, layer.dense_weight)
        )
        assert torch.equal(layer(x), want), rows


@pytest.mark.parametrize("kind", sorted(CODES))
def test_bfloat16_each_path_is_its_kernel_over_the_same_weights(kind):
    torch.manual_seed(0)
    codes = CODES[kind].from_float(torch.randn(96, 160))
    layer = dual_layer(kind, codes, torch.bfloat16)
    method = layer.quant_method
    # The float copy is the layer's codes (float16 scales) dequantized, then rounded.
    w = method.codes_method.dequantize(layer)
    assert torch.equal(layer.dense_weight, w.bfloat16())
    ops = kernels.cpu_ops()
    for rows in (1, method.max_code_rows, method.max_code_rows + 1, 40):
        x = torch.randn(rows, 160).bfloat16()
        y = layer(x)
        if rows <= method.max_code_rows:
            assert torch.equal(y, getattr(ops, f"{kind}_linear")(x, *method.codes(layer))), rows
        else:
            assert torch.equal(y, F.linear(x, layer.dense_weight)), rows
    # What bench step's roofline counts: the codes up to max_code_rows rows, the copy above.
    assert method.bytes_read(layer, method.max_code_rows) == method.nbytes(layer) < 96 * 160 * 2
    assert method.bytes_read(layer, method.max_code_rows + 1) == 96 * 160 * 2


def test_float_weights_are_quantized_once_for_both_copies():
    """A layer given floats (a vocabulary shard's zero padding, a tiny test model) quantizes
    them; the copy is those codes dequantized, not the floats."""
    torch.manual_seed(1)
    w = torch.randn(64, 64)
    layer = dual_layer("int4", w, torch.bfloat16)
    want = layer.quant_method.codes_method.dequantize(layer)
    assert torch.equal(layer.dense_weight, want.bfloat16())
    torch.testing.assert_close(want, Int4Weight.from_float(w.bfloat16()).dequantize(),
                               rtol=0, atol=1e-2)  # fmt: skip
    assert not torch.equal(want, w)


@pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")), reason="oneDNN bf16")
def test_bfloat16_copy_prepacked():
    torch.manual_seed(2)
    codes = Int4Weight.from_float(torch.randn(128, 64))
    layer = dual_layer("int4", codes, torch.bfloat16, prepack=True)
    layer.quant_method.process_weights_after_loading(layer)
    assert not hasattr(layer, "dense_weight") and layer.nbytes == 128 * 64 * 2
    x = torch.randn(32, 64).bfloat16()
    w = layer.quant_method.codes_method.dequantize(layer).bfloat16()
    torch.testing.assert_close(layer(x), F.linear(x, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tied_head_shares_the_embedding_and_holds_its_own_codes(dtype):
    torch.manual_seed(3)
    emb_codes = Int8Weight.from_float(torch.randn(100, 64))
    embedding = VocabParallelEmbedding(100, 64, dtype=dtype)
    embedding.weight_loader(embedding.weight, emb_codes.dequantize())
    fixed_order = dtype == torch.float32  # the float32 default
    config = QuantizationConfig("auto", code_kinds={"lm_head": "int8"}, fixed_order=fixed_order)
    head = ParallelLMHead(100, 64, quant_config=config, tied=True, dtype=dtype)
    head.tie_weights(embedding)
    head.weight_loader(head.weight, emb_codes)
    assert torch.equal(head.weight, emb_codes.q)
    both = torch.nn.ModuleList([embedding, head])
    codes_bytes = 100 * 64 + 100 * 2 * 2  # int8, float16 scales
    if fixed_order:  # the codes alone, at every row count
        assert not hasattr(head, "dense_weight")
        x = torch.randn(64, 64)
        assert torch.equal(
            head(x), kernels.cpu_ops().int8_linear(x, *head.quant_method.codes(head))
        )
    else:
        assert head.dense_weight.data_ptr() == embedding.weight.data_ptr()
        x = torch.randn(head.quant_method.max_code_rows + 1, 64, dtype=dtype)
        assert torch.equal(head(x), F.linear(x, embedding.weight))  # the copy: the embedding
    # Counted once: the embedding's floats and the head's codes.
    assert weight_bytes(both) == 100 * 64 * dtype.itemsize + codes_bytes


def test_auto_gives_dual_layers_where_every_part_has_codes_of_one_kind():
    q4, q8 = Int4Weight, Int8Weight
    mapping = LlamaForCausalLM.packed_modules_mapping
    kinds = {f"model.layers.0.self_attn.{p}_proj.weight": q4 for p in "qkv"}
    kinds["model.layers.0.self_attn.o_proj.weight"] = q8
    kinds |= {"model.layers.0.mlp.gate_proj.weight": q4, "model.layers.0.mlp.up_proj.weight": q8}
    kinds["model.layers.1.self_attn.q_proj.weight"] = q4  # no k / v
    kinds["model.embed_tokens.weight"] = q8
    found = code_layer_kinds(kinds, mapping, tie_word_embeddings=True)
    assert found == {
        "model.layers.0.self_attn.qkv_proj": "int4",
        "model.layers.0.self_attn.o_proj": "int8",
        "model.layers.0.mlp.gate_up_proj": "int8x",  # mixed kinds: only the integer path's
        "model.embed_tokens": "int8",  # never asked for: the embedding is not a linear layer
        "lm_head": "int8",
    }
    assert "lm_head" not in code_layer_kinds(kinds, mapping, tie_word_embeddings=False)
    config = QuantizationConfig("auto", code_kinds=found)
    merged = ColumnParallelLinear(
        64, 64, quant_config=config, prefix="model.layers.0.mlp.gate_up_proj"
    )
    assert isinstance(merged.quant_method, UnquantizedLinearMethod)  # int8x: float only here
    odd = ColumnParallelLinear(
        48, 64, quant_config=config, prefix="model.layers.0.self_attn.o_proj"
    )
    assert isinstance(odd.quant_method, UnquantizedLinearMethod)  # 48 columns: not whole groups


@pytest.mark.parametrize("kind", sorted(CODES))
def test_a_rows_product_does_not_depend_on_the_other_rows(kind):
    """The codes kernel sums each output in one order whatever the row count (one row, a tile
    of four, the 1-3 left over): a request's result does not depend on its batch."""
    torch.manual_seed(4)
    layer = dual_layer(kind, CODES[kind].from_float(torch.randn(40, 96)), torch.float32)
    ops, codes = kernels.cpu_ops(), layer.quant_method.codes(layer)
    x = torch.randn(9, 96)
    alone = torch.cat([getattr(ops, f"{kind}_linear")(x[i : i + 1], *codes) for i in range(9)])
    for rows in range(2, 10):
        assert torch.equal(getattr(ops, f"{kind}_linear")(x[:rows], *codes), alone[:rows]), rows
