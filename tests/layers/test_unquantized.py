"""Float linear layers: bfloat16 weights prepacked for oneDNN once loaded, against F.linear; a
tied LM head's packed copy; where packing applies."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.linear import ColumnParallelLinear
from pagedllm.layers.quantization import QuantizationConfig, UnquantizedLinearMethod, unquantized
from pagedllm.layers.quantization.unquantized import can_pack
from pagedllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.weight_utils import weight_bytes

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not can_pack(torch.bfloat16, CPU), reason="needs oneDNN's bfloat16 path on this CPU"
)
PACKED = QuantizationConfig(prepack=True)


def _processed(layer):
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 130, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    layer = ColumnParallelLinear(80, 96, bias, torch.bfloat16, PACKED)
    layer.weight_loader(layer.weight, weight)
    if bias:
        layer.weight_loader(layer.bias, b)
    _processed(layer)
    assert not hasattr(layer, "weight") and layer.nbytes == weight.nbytes
    x = torch.randn(rows, 80, generator=g).bfloat16()
    out = layer(x)
    assert out.shape == (rows, 96) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x, weight, b).float(), atol=0.05, rtol=0.02)
    # Leading dimensions and a non-contiguous input are handled.
    x3 = torch.randn(2, 80, rows, generator=g).bfloat16().transpose(1, 2)
    torch.testing.assert_close(
        layer(x3).float(), F.linear(x3, weight, b).float(), atol=0.05, rtol=0.02
    )


def test_packed_gemms_run_at_few_row_counts():
    """The row counts a packed GEMM runs at: exact up to 16, never fewer rows than given, at
    most 1/8 more, and 72 shapes for every step of up to 2048 rows (oneDNN keeps a primitive
    per shape)."""
    padded = [unquantized.padded_rows(r) for r in range(1, 4097)]
    assert padded[:16] == list(range(1, 17))
    assert all(r <= p <= r * 9 / 8 for r, p in zip(range(1, 4097), padded, strict=True))
    assert len(set(padded[:2048])) == 72
    assert padded == sorted(padded)


@needs_onednn
def test_a_tied_head_gets_a_packed_copy():
    embed = VocabParallelEmbedding(50, 32, torch.bfloat16)
    head = ParallelLMHead(50, 32, torch.bfloat16, PACKED, tied=True)
    head.tie_weights(embed)
    weight = torch.randn(50, 32)
    embed.weight_loader(embed.weight, weight)
    x = torch.randn(5, 32).bfloat16()
    before, bytes_before = head(x), weight_bytes(torch.nn.ModuleList([embed, head]))
    _processed(head)
    assert embed.weight.dtype == torch.bfloat16  # the embedding keeps the original
    assert weight_bytes(torch.nn.ModuleList([embed, head])) == bytes_before + 50 * 32 * 2
    torch.testing.assert_close(head(x).float(), before.float(), atol=0.05, rtol=0.02)


def test_which_layers_pack():
    def method(config, input_size=64, tied=False):
        head = ParallelLMHead(128, input_size, quant_config=config, tied=tied)
        assert isinstance(head.quant_method, UnquantizedLinearMethod)
        return head.quant_method.prepack

    assert method(PACKED) and method(PACKED, tied=True)
    assert not method(QuantizationConfig())
    # A quantized model's float layers (inputs not whole groups of 32) pack, but a tied head
    # stays as it is: quantizing is chosen to save memory.
    quantized = QuantizationConfig("int8", prepack=True)
    assert method(quantized, 48) and not method(quantized, 48, tied=True)


def test_packing_needs_bfloat16_on_a_cpu_that_onednn_packs_for(monkeypatch):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    monkeypatch.setattr(
        unquantized, "cpu_flags", lambda: frozenset({"avx2", "avx512bw", "avx512vl", "avx512dq"})
    )
    assert unquantized.can_pack(torch.bfloat16, CPU)
    assert not unquantized.can_pack(torch.float32, CPU)
    assert not unquantized.can_pack(torch.bfloat16, torch.device("cuda"))
    monkeypatch.setattr(unquantized, "cpu_flags", lambda: frozenset({"avx2"}))
    assert not unquantized.can_pack(torch.bfloat16, CPU)  # oneDNN would refuse to reorder
