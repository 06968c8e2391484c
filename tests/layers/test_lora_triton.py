"""Batched multi-LoRA kernels (lora_triton.py) against a per-adapter torch reference.

Every slot has its own random weights, so a row that reads another slot's adapter, or a row
without one (slot -1) that gets written, fails the comparison. On CPU the kernels run under
Triton's interpreter (tests/conftest.py), one program after another: sizes stay small.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.lora_triton import BLOCK_K, BLOCK_O, add_lora_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(y, x, lora_a, lora_b, slots):
    """float32: y + (x @ A[s].T) @ B[s].T, adapter by adapter over the rows that use it."""
    out = y.float().clone()
    for s in slots.unique().tolist():
        if s >= 0:
            rows = slots == s
            out[rows] += (x[rows].float() @ lora_a[s].float().T) @ lora_b[s].float().T
    return out


def _case(slots, num_slots, rank, d_in, d_out, dtype=torch.float32, seed=0):
    """y, x, A, B at magnitudes where the LoRA delta is about as large as y."""
    g = torch.Generator().manual_seed(seed)
    t = len(slots)
    y = torch.randn(t, d_out, generator=g)
    x = torch.randn(t, d_in, generator=g)
    lora_a = torch.randn(num_slots, rank, d_in, generator=g) / d_in**0.5
    lora_b = torch.randn(num_slots, d_out, rank, generator=g) / rank**0.5
    tensors = [v.to(DEVICE, dtype) for v in (y, x, lora_a, lora_b)]
    return *tensors, torch.tensor(slots, device=DEVICE)


def _run_and_check(slots, num_slots, rank, d_in, d_out, dtype=torch.float32, tol=1e-5, **kw):
    y, x, lora_a, lora_b, row_slots = _case(slots, num_slots, rank, d_in, d_out, dtype)
    row_slots = row_slots.to(kw.get("slot_dtype", torch.int64))
    expected = _reference(y, x, lora_a, lora_b, row_slots)
    before = y.clone()
    add_lora_triton(y, x, lora_a, lora_b, row_slots)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), expected, atol=tol, rtol=tol)
    idle = row_slots < 0
    assert torch.equal(y[idle], before[idle])  # untouched bit for bit


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("rank", [16, 24, 128])
def test_interleaved_slots(rank, slot_dtype):
    """Adapters interleaved with rows that have none; ranks a power of two, not one, and the
    largest supported."""
    _run_and_check([0, -1, 2, 0, 1, -1, 2], 3, rank, 64, 96, slot_dtype=slot_dtype)


def test_all_rows_one_slot():
    """One adapter (not slot 0) for a whole row block and then some."""
    _run_and_check([1] * 11, 3, 16, 64, 64)


def test_all_rows_without_adapter_leave_y_alone():
    _run_and_check([-1] * 5, 2, 16, 64, 64)


@pytest.mark.parametrize(("d_in", "d_out"), [(BLOCK_K + 5, BLOCK_O - 3), (3 * BLOCK_K - 1, 150)])
def test_feature_tails(d_in, d_out):
    """in/out that are not multiples of the block sizes, with rank 24 padded to 32."""
    _run_and_check([1, 0, -1, 1, 2, 0, 2, 1, 0], 3, 24, d_in, d_out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_float32_reference(dtype):
    """float32 accumulation, one rounding of y + delta to the output dtype."""
    _run_and_check([0, -1, 2, 0, 1, -1, 2], 3, 24, 100, 70, dtype=dtype, tol=2e-2)


def test_strided_views():
    """x and y as column slices of wider buffers (a fused projection's output): only y's
    columns change, and only in rows with an adapter."""
    slots = [2, -1, 0, 2]
    _, x, lora_a, lora_b, row_slots = _case(slots, 3, 16, 48, 40, seed=1)
    wide_x = torch.randn(len(slots), 80, device=DEVICE)
    wide_x[:, 16:64] = x
    wide_y = torch.randn(len(slots), 100, device=DEVICE)
    before = wide_y.clone()
    expected = _reference(wide_y[:, 30:70], x, lora_a, lora_b, row_slots)
    add_lora_triton(wide_y[:, 30:70], wide_x[:, 16:64], lora_a, lora_b, row_slots)
    torch.testing.assert_close(wide_y[:, 30:70], expected, atol=1e-5, rtol=1e-5)
    outside = torch.ones_like(wide_y, dtype=torch.bool)
    outside[row_slots >= 0, 30:70] = False
    assert torch.equal(wide_y[outside], before[outside])
