"""Triton kernels of the GPU attention backend: the KV cache write, paged attention, block copy.

The same source compiles for CUDA and runs on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1, read when this module is imported), which is how CI tests it. Layouts are
the engine's: a layer's cache is [num_blocks, block_size, num_kv_heads, head_dim] (one token's
K of all heads is one contiguous slot), a request's block table maps logical to physical
blocks, and query rows are flattened over requests (metadata.py).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# The interpreter's tl.dot multiplies bfloat16 operands as their raw 16-bit patterns (it stores
# them as uint16), so under it the kernels widen dot operands to float32 first. A product of
# two bfloat16 (or float16) values is exact in float32, so this is the GPU's arithmetic.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    key_stride,
    value_stride,
    SLOT_NUMEL: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,
):
    """One program per token: its K and V rows (all KV heads) into their cache slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    numel = tl.where(slot >= 0, SLOT_NUMEL, 0)  # a padding token (slot -1) writes nothing
    for start in tl.range(0, SLOT_NUMEL, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < numel
        k = tl.load(key_ptr + token * key_stride + offs, mask=mask)
        v = tl.load(value_ptr + token * value_stride + offs, mask=mask)
        tl.store(k_cache_ptr + slot * SLOT_NUMEL + offs, k.to(k_cache_ptr.dtype.element_ty), mask)
        tl.store(v_cache_ptr + slot * SLOT_NUMEL + offs, v.to(v_cache_ptr.dtype.element_ty), mask)


@triton.jit
def copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    src_layer_stride,
    dst_layer_stride,
    BLOCK_NUMEL: tl.constexpr,  # block_size * num_kv_heads * head_dim
    CHUNK: tl.constexpr,
):
    """Program (pair, layer): block src_ids[pair] of src's layer -> block dst_ids[pair] of dst's.
    A layer here is one K or V cache; src and dst may be the same pool (copy-on-write) or a
    pool and a staging buffer of gathered blocks (swap)."""
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    src_block = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + pair).to(tl.int64)
    src = src_ptr + layer * src_layer_stride + src_block * BLOCK_NUMEL
    dst = dst_ptr + layer * dst_layer_stride + dst_block * BLOCK_NUMEL
    for start in tl.range(0, BLOCK_NUMEL, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < BLOCK_NUMEL
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def paged_attention_kernel(
    out_ptr,
    split_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_PAD] float32, when split
    split_ml_ptr,  # [num_tokens, num_heads, NUM_SPLITS, 2] float32: running max and sum
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tile_req_ptr,  # per query tile: its request,
    tile_start_ptr,  # and its first query row within the request
    scale,
    soft_cap,
    sliding_window,
    q_stride_token,
    q_stride_head,
    o_stride_token,
    o_stride_head,
    cache_stride_block,
    cache_stride_token,
    cache_stride_head,
    block_table_stride,
    num_heads,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (tile, kv_head, split): BLOCK_Q query rows of one request times the
    QUERIES_PER_KV query heads that read `kv_head` (GQA: each K/V tile is loaded once for all
    of them), over the request's context read through its block table in BLOCK_N-token tiles.

    Decode, chunked prefill and prefill with cached context are one path: a request's q_len
    query rows are the last q_len positions of its seq_len-token context. With NUM_SPLITS > 1
    each split covers a slice of the context and leaves a partial (max, sum, unnormalised
    output) for reduce_splits_kernel.
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(tile_req_ptr + tile)
    tile_start = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + req)
    num_cached = seq_len - q_len

    # Rows are (query row, head of the group) pairs, the group padded to a power of two.
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    q_row = tile_start + rows // GROUP_PAD
    head = kv_head * QUERIES_PER_KV + rows % GROUP_PAD
    row_valid = (q_row < q_len) & (rows % GROUP_PAD < QUERIES_PER_KV)
    q_pos = num_cached + q_row  # absolute position of each row's token
    token = (q_begin + q_row).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q = tl.load(
        query_ptr + token[:, None] * q_stride_token + head[:, None] * q_stride_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )

    # The context this tile reads: up to its last row's position, from the first position its
    # first row's window sees (earlier blocks of a sliding layer may be released: not loaded).
    # Tiles of BLOCK_N start at multiples of BLOCK_N, so without splits a row's sums go in one
    # order whatever tile or batch it is in (positions it cannot see add exact zeros).
    ctx_end = tl.minimum(num_cached + tile_start + BLOCK_Q, seq_len)
    first_loaded = 0
    if USE_WINDOW:
        first_loaded = tl.maximum(num_cached + tile_start - sliding_window + 1, 0)
    ctx_begin = first_loaded // BLOCK_N * BLOCK_N
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(ctx_end - ctx_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
        ctx_begin = ctx_begin + split * per_split
        ctx_end = tl.minimum(ctx_end, ctx_begin + per_split)

    # Online softmax in base 2. The running max starts finite so that a row with nothing
    # visible yet keeps exp2(-inf - m) == 0 instead of exp2(-inf + inf) == NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634
    table = block_tables_ptr + req.to(tl.int64) * block_table_stride
    for start in tl.range(ctx_begin, ctx_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_valid = (pos >= first_loaded) & (pos < ctx_end)
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
        slot = (
            block * cache_stride_block
            + (pos % BLOCK_SIZE) * cache_stride_token
            + kv_head * cache_stride_head
        )
        kv_mask = pos_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST, PRECISION)
        if USE_SOFT_CAP:  # cap * tanh(s * scale / cap), tanh through exp2 (no tl.tanh)
            x = s * (scale / soft_cap)
            e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = tl.where(x < 0, -t, t) * (soft_cap * 1.4426950408889634)
        else:
            s = s * qk_scale
        visible = pos_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o = out_ptr + token[:, None] * o_stride_token + head[:, None] * o_stride_head
        tl.store(o + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & dim_valid[None, :])  # fmt: skip
    else:
        part = (token * num_heads + head) * NUM_SPLITS + split
        acc_ptr = split_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :]
        tl.store(acc_ptr, acc, mask=row_valid[:, None])
        tl.store(split_ml_ptr + part * 2, m_i, mask=row_valid)
        tl.store(split_ml_ptr + part * 2 + 1, l_i, mask=row_valid)


@triton.jit
def reduce_splits_kernel(
    out_ptr,
    split_acc_ptr,
    split_ml_ptr,
    o_stride_token,
    o_stride_head,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Program (token, head): the splits' partial softmaxes rescaled to their common max and
    summed. An empty split (max -1e30, sum 0) weighs exp2(-1e30 - max) == 0."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (token * num_heads + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(split_ml_ptr + part * 2)
    l_sum = tl.load(split_ml_ptr + part * 2 + 1)
    weight = tl.exp2(m - tl.max(m, 0))
    dims = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(split_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :])
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l_sum * weight, 0)
    o = out_ptr + token * o_stride_token + head * o_stride_head + dims
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
