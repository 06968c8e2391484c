"""The Triton attention backend: the GPU's (CUDA tensors), or CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1), where CI tests the same kernels (triton_kernels.py).

Per step the host plans query tiles once (shared by every layer); per layer one launch writes
the new K/V through the slot mapping and one attends over the paged context. Decode steps with
long contexts split each context across programs and reduce the partial softmaxes in a second
launch, so a few long requests still fill the GPU.

`deterministic` (batch invariance, docs/determinism.md): tiles of DECODE_ROWS query rows in
every step and no splits, so a row's reduction is over its context's BLOCK_N-position tiles in
order whatever the step: how many rows it has, how the prompt was chunked, the longest context
beside it. The cost is decode's split-K: a few long requests use fewer programs.
"""

from __future__ import annotations

import numpy as np
import torch
import triton

from pagedllm.attention import triton_kernels as kernels
from pagedllm.attention.metadata import AttentionMetadata

BLOCK_N = 64  # context tokens per inner-loop tile
DECODE_ROWS = 16  # query rows (tokens x heads of a KV group) per decode tile: tl.dot's minimum
PREFILL_ROWS = 64  # the same for steps with prompts
PARTITION_SIZE = 512  # a decode step gets one split per this many tokens of its longest context
MAX_SPLITS = 16


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Like torch_ref.write_kv_cache (its oracle): token t's K/V [kv_heads, head_dim] go to slot
    slot_mapping[t]; slot -1 (padding) writes nothing."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    slot_numel = k_cache.shape[-2] * k_cache.shape[-1]
    key, value = _rows(key), _rows(value)
    kernels.reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
        SLOT_NUMEL=slot_numel, BLOCK=min(triton.next_power_of_2(slot_numel), 1024),
    )  # fmt: skip


def copy_blocks_triton(
    src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    """Block src_ids[i] -> dst_ids[i] in every layer's K and V. src/dst: pools laid out
    [groups, 2, num_blocks, block_size, kv_heads, head_dim] (the engine's kv_pool, or a staging
    buffer of gathered blocks for swapping); the same tensor for copy-on-write."""
    if not len(src_ids):
        return
    for pool in (src, dst):
        if not pool.is_contiguous() or pool.device != src.device:
            raise ValueError("copy_blocks: pools must be contiguous and on one device")
    layers = src.shape[0] * src.shape[1]
    block_numel = src[0, 0, 0].numel()
    kernels.copy_blocks_kernel[(len(src_ids), layers)](
        src, dst, src_ids, dst_ids, src.stride(1), dst.stride(1),
        BLOCK_NUMEL=block_numel, CHUNK=min(triton.next_power_of_2(block_numel), 2048),
    )  # fmt: skip


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    partition_size: int = PARTITION_SIZE,
    deterministic: bool = False,
) -> torch.Tensor:
    """query [T, num_heads, head_dim] -> [T, num_heads, head_dim], like the reference; all K/V
    are read from the caches (`key`/`value` are not needed). `partition_size`: context tokens
    per split of a decode step (tests make it small to cross split boundaries).
    `deterministic`: a row's result whatever the step (see the module's docstring)."""
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("paged attention: K and V caches must share one row-major layout")
    query = _rows(query)
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    decode = meta.max_query_len == 1 or deterministic
    block_q = max(1, (DECODE_ROWS if decode else PREFILL_ROWS) // group_pad)
    tile_req, tile_start = _query_tiles(meta, block_q, query.device)

    num_splits = 1
    if decode and not deterministic:  # prompts' tiles are many already; decode has one each
        longest = min(meta.max_seq_len, sliding_window or meta.max_seq_len)
        num_splits = min(MAX_SPLITS, triton.next_power_of_2(-(-longest // partition_size)))
    split_acc = split_ml = out  # unused unless split
    if num_splits > 1:
        split_acc = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim_pad), dtype=torch.float32,
            device=query.device,
        )  # fmt: skip
        split_ml = torch.empty((num_tokens, num_heads, num_splits, 2), dtype=torch.float32,
                               device=query.device)  # fmt: skip

    kernels.paged_attention_kernel[(len(tile_req), num_kv_heads, num_splits)](
        out, split_acc, split_ml, query, k_cache, v_cache,
        meta.block_tables, meta.seq_lens, meta.query_start_loc, tile_req, tile_start,
        scale, logits_soft_cap or 1.0, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        num_heads,
        QUERIES_PER_KV=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_N=BLOCK_N, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=logits_soft_cap is not None,
        UPCAST=kernels.INTERPRET, PRECISION=_dot_precision(query.dtype),
    )  # fmt: skip
    if num_splits > 1:
        kernels.reduce_splits_kernel[(num_tokens, num_heads)](
            out, split_acc, split_ml, out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_splits,
        )  # fmt: skip
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] with each token's heads packed (rows may be strided, as the views
    of a fused QKV projection are); copied only when they are not."""
    if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        return x
    return x.contiguous()


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 caches get float32 products (tf32 would round the inputs to 10 mantissa bits).
    return "ieee" if dtype == torch.float32 else "tf32"


def _query_tiles(meta: AttentionMetadata, block_q: int, device) -> tuple[torch.Tensor, ...]:
    """(request, first query row) of every tile of `block_q` rows: the same for every layer,
    so built once per step and kept on the metadata."""
    tiles = meta.__dict__.setdefault("_triton_tiles", {})
    if block_q not in tiles:
        q_lens = np.diff(np.asarray(meta.query_start_loc_cpu, np.int64))
        per_req = -(-q_lens // block_q)
        first = np.cumsum(per_req) - per_req
        req = np.repeat(np.arange(len(q_lens), dtype=np.int32), per_req)
        start = (np.arange(int(per_req.sum())) - np.repeat(first, per_req)) * block_q
        tiles[block_q] = (
            torch.from_numpy(req).to(device),
            torch.from_numpy(start.astype(np.int32)).to(device),
        )
    return tiles[block_q]
