"""The float32 products of kernels/csrc/linear_tiles.h: a row's result is bit for bit the same
whatever the other rows of the call (batch invariance), for float weights and for int4 / int8
codes, at row counts that take every tile shape and both of the codes kernel's paths."""

from __future__ import annotations

import pytest
import torch

from pagedllm import kernels
from pagedllm.layers.quantization import Int4Weight, Int8Weight
from pagedllm.layers.quantization.codes import pack_int4

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")
ROWS = (1, 2, 15, 16, 17, 64, 257)


def quantized(kind: str, n: int, k: int, seed: int):
    """(the codes kernel as a function of x, the codes dequantized) for a random [n, k] weight."""
    ops = kernels.cpu_ops()
    torch.manual_seed(seed)
    c = (Int4Weight if kind == "int4" else Int8Weight).from_float(torch.randn(n, k))
    if kind == "int4":
        args = (pack_int4(c.q), c.scale.half(), c.min.half())
    else:
        args = (c.q, c.scale.half())
    dense = torch.empty(n, k)
    getattr(ops, f"{kind}_dequantize")(dense, *args)
    return (lambda x: getattr(ops, f"{kind}_linear")(x, *args)), dense


@pytest.mark.parametrize("n, k", [(37, 64), (96, 160), (576, 1536)])
def test_dense_rows_equal_their_row_alone(n, k):
    ops = kernels.cpu_ops()
    torch.manual_seed(n)
    w, bias = torch.randn(n, k), torch.randn(n)
    x = torch.randn(max(ROWS), k)
    alone = torch.cat([ops.dense_linear(x[i : i + 1], w, bias) for i in range(len(x))])
    torch.testing.assert_close(alone, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-4)
    for m in ROWS:
        for start in (0, max(ROWS) - m):  # a row at every place of the batch
            y = ops.dense_linear(x[start : start + m].contiguous(), w, bias)
            assert torch.equal(y, alone[start : start + m]), (m, start)


@pytest.mark.parametrize("k", [13, 70])  # K not a multiple of the vector width: the tail
def test_dense_tail_columns_in_order(k):
    ops = kernels.cpu_ops()
    torch.manual_seed(k)
    w, x = torch.randn(11, k), torch.randn(17, k)
    y = ops.dense_linear(x, w, None)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[5:6], ops.dense_linear(x[5:6].contiguous(), w, None))


@pytest.mark.parametrize("n, k", [(37, 70), (96, 160)])
def test_bfloat16_weights_give_their_float32_copys_products(n, k):
    """bfloat16 weights (--deterministic in bfloat16) are widened exactly in the tiles: the same
    float32 result as the float32 copy, bit for bit, so rows stay independent of the batch."""
    ops = kernels.cpu_ops()
    torch.manual_seed(n)
    w, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    x = torch.randn(max(ROWS), k)
    want = ops.dense_linear(x, w.float(), bias.float())
    assert torch.equal(ops.dense_linear(x, w, bias), want)
    for m in (1, 2, 17):
        assert torch.equal(ops.dense_linear(x[3 : 3 + m].contiguous(), w, bias), want[3 : 3 + m])


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("n, k", [(37, 64), (130, 96), (960, 576)])
def test_codes_rows_equal_their_row_alone(kind, n, k):
    linear, dense = quantized(kind, n, k, seed=n + k)
    x = torch.randn(max(ROWS), k)
    alone = torch.cat([linear(x[i : i + 1].contiguous()) for i in range(len(x))])
    torch.testing.assert_close(alone, x @ dense.T, rtol=1e-5, atol=1e-4)
    for m in ROWS:
        rows = x[max(ROWS) - m :].contiguous()
        y = linear(rows)
        assert torch.equal(y, alone[max(ROWS) - m :]), m


def test_bfloat16_rows_widened_take_the_same_order():
    """bfloat16 rows against int8 codes are widened to float32 and multiplied in the same order
    (int4 codes take AVX512-BF16's dot products where the CPU has them)."""
    linear, _ = quantized("int8", 64, 96, seed=3)
    x = torch.randn(17, 96).bfloat16()
    y = linear(x)
    for i in (0, 8, 16):
        assert torch.equal(y[i : i + 1], linear(x[i : i + 1].contiguous()))


@pytest.mark.skipif(
    not kernels.available() or not kernels.cpu_ops().int4_takes_bf16(64),
    reason="needs AVX512-BF16 (int4 codes take bfloat16 rows as they are only there)",
)
@pytest.mark.parametrize("n, k", [(37, 64), (130, 192), (960, 576), (576, 1536)])
def test_bfloat16_rows_against_int4_codes_equal_their_row_alone(n, k):
    """AVX512-BF16's dot products (--deterministic in bfloat16 on such a CPU): a row's result
    is the same bit for bit through the register path (a few rows) and the unpacked panels
    (16 rows or more), at every place of the batch, and close to the float32 product."""
    linear, dense = quantized("int4", n, k, seed=n + k)
    x = torch.randn(max(ROWS), k).bfloat16()
    alone = torch.cat([linear(x[i : i + 1].contiguous()) for i in range(len(x))])
    exact = x.float() @ dense.T
    scale = exact.abs().max().item()
    torch.testing.assert_close(alone.float(), exact, rtol=2e-2, atol=2e-2 * scale)
    for m in (*ROWS, 3, 4, 5):
        for start in (0, max(ROWS) - m):
            y = linear(x[start : start + m].contiguous())
            assert torch.equal(y, alone[start : start + m]), (m, start)
