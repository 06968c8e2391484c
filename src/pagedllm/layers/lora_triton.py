"""Batched multi-LoRA on the GPU (punica's BGMV): every row of a batch through its own adapter.

Two launches: shrink (v = x @ A[slot].T into a float32 [T, R] buffer) and expand
(y += v @ B[slot].T). Each row gathers its slot's weights, so a batch mixing adapters (and rows
without one, slot -1) is one launch each, with no sorting or grouping by adapter. The products
are broadcast multiplies reduced in float32 rather than tl.dot: rows of one tile may read
different adapters, and the rank is too small for tensor cores to pay. Runs on CPU tensors
under Triton's interpreter (TRITON_INTERPRET=1) the way the attention kernels do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 8  # shrink: rows per program
BLOCK_R = 16  # shrink: ranks per program
BLOCK_K = 32  # shrink: input features per inner-loop step
BLOCK_O = 64  # expand: output features per program


@triton.jit
def lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    v_ptr,  # [T, R] float32
    num_rows,
    x_stride,
    a_stride_slot,
    a_stride_rank,
    IN: tl.constexpr,
    R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (row block, rank block): v[t, r] = sum_k x[t, k] * A[slot_t, r, k]."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + rows, mask=rows < num_rows, other=-1).to(tl.int64)
    row_ok = slot >= 0  # rows past the end and rows without an adapter read nothing
    a_rows = a_ptr + slot[:, None] * a_stride_slot + ranks[None, :] * a_stride_rank  # [T, R]
    a_ok = row_ok[:, None] & (ranks[None, :] < R)
    x_rows = x_ptr + rows.to(tl.int64) * x_stride
    acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
    for start in tl.range(0, IN, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_ok = k < IN
        x = tl.load(x_rows[:, None] + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_rows[:, :, None] + k[None, None, :], mask=a_ok[:, :, None] & k_ok, other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * a.to(tl.float32), 2)
    v = v_ptr + rows.to(tl.int64)[:, None] * R + ranks[None, :]
    tl.store(v, acc, mask=(rows < num_rows)[:, None] & (ranks[None, :] < R))


@triton.jit
def lora_expand_kernel(
    y_ptr,
    v_ptr,
    b_ptr,
    slots_ptr,
    y_stride,
    b_stride_slot,
    b_stride_out,
    OUT: tl.constexpr,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    """Program (row, output block): y[t, o] += sum_r v[t, r] * B[slot_t, o, r], in float32.
    A row without an adapter (slot -1) loads and stores nothing: y stays bit for bit."""
    row = tl.program_id(0).to(tl.int64)
    outs = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    ranks = tl.arange(0, R_PAD)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    out_ok = outs < tl.where(slot >= 0, OUT, 0)  # (the interpreter can't `&` a scalar bool)
    rank_ok = ranks < R
    v = tl.load(v_ptr + row * R + ranks, mask=rank_ok, other=0.0)
    b = b_ptr + slot * b_stride_slot + outs[:, None] * b_stride_out + ranks[None, :]
    b = tl.load(b, mask=out_ok[:, None] & rank_ok[None, :], other=0.0)
    delta = tl.sum(b.to(tl.float32) * v[None, :], 1)
    y = y_ptr + row * y_stride + outs
    old = tl.load(y, mask=out_ok, other=0.0)
    tl.store(y, (old.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=out_ok)


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
) -> None:
    """In place: y[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T for every row t whose slot
    s = row_slots[t] is >= 0 (rows with -1 are left alone).

    y [T, out], x [T, in], lora_a [S, R, in], lora_b [S, out, R], one dtype; row_slots [T]
    int32/int64. Rows of x and y may be strided (views of fused projections); y is written
    through its own storage, so it must have unit stride along features."""
    num_rows, rank = x.shape[0], lora_a.shape[1]
    if num_rows == 0 or rank == 0:
        return
    if y.stride(-1) != 1:
        raise ValueError("add_lora_triton: y's features must be contiguous (it is written)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
    row_slots = row_slots.contiguous()
    v = torch.empty(num_rows, rank, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_rows, BLOCK_T), triton.cdiv(rank, BLOCK_R))
    lora_shrink_kernel[grid](
        x, lora_a, row_slots, v, num_rows, x.stride(0), lora_a.stride(0), lora_a.stride(1),
        IN=x.shape[1], R=rank, BLOCK_T=BLOCK_T, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    out = y.shape[1]
    lora_expand_kernel[(num_rows, triton.cdiv(out, BLOCK_O))](
        y, v, lora_b, row_slots, y.stride(0), lora_b.stride(0), lora_b.stride(1),
        OUT=out, R=rank, R_PAD=triton.next_power_of_2(rank), BLOCK_O=BLOCK_O,
    )  # fmt: skip
