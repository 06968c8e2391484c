"""Prepacked bfloat16 linears (oneDNN) against F.linear, alone and swapped into a model."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.packed_linear import PackedLinear, can_pack, pack_linear_weights
from pagedllm.layers.quantization import weight_bytes

pytestmark = pytest.mark.skipif(
    not can_pack(torch.bfloat16, torch.device("cpu")), reason="needs oneDNN (mkldnn)"
)


@pytest.mark.parametrize("rows", [1, 3, 64, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 80, generator=g).bfloat16()
    out = PackedLinear(weight, b)(x)
    assert out.shape == (rows, 96) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x, weight, b).float(), atol=0.05, rtol=0.02)
    # Leading dimensions and a non-contiguous input are handled.
    x3 = torch.randn(2, 80, rows, generator=g).bfloat16().transpose(1, 2)
    torch.testing.assert_close(
        PackedLinear(weight, b)(x3).float(), F.linear(x3, weight, b).float(), atol=0.05, rtol=0.02
    )


def test_pack_model_swaps_linears_and_copies_a_tied_head():
    model = nn.ModuleDict(
        {"embed": nn.Embedding(50, 32), "proj": nn.Linear(32, 48), "head": nn.Linear(32, 50)}
    ).bfloat16()
    model["head"].weight = model["embed"].weight  # tied
    x = torch.randn(5, 32).bfloat16()
    before = {name: model[name](x) for name in ("proj", "head")}
    bytes_before = weight_bytes(model)
    added = pack_linear_weights(model)
    assert isinstance(model["proj"], PackedLinear) and isinstance(model["head"], PackedLinear)
    assert added == 50 * 32 * 2  # only the tied head is a new copy
    assert weight_bytes(model) == bytes_before + added
    for name, want in before.items():
        torch.testing.assert_close(model[name](x).float(), want.float(), atol=0.05, rtol=0.02)


def test_a_tied_head_can_be_left_unpacked():
    model = nn.ModuleDict({"embed": nn.Embedding(50, 32), "head": nn.Linear(32, 50)}).bfloat16()
    model["head"].weight = model["embed"].weight
    assert pack_linear_weights(model, pack_shared=False) == 0
    assert isinstance(model["head"], nn.Linear)


def test_float32_linears_are_left_alone():
    model = nn.Sequential(nn.Linear(8, 8))
    assert pack_linear_weights(model) == 0
    assert isinstance(model[0], nn.Linear)
