"""Paged attention on top of torch's scaled_dot_product_attention (the default CPU backend).

Decode rows (q_len == 1) of all requests go through one batched SDPA call over their contexts
padded to the longest one; rows with q_len > 1 (prefill, chunked prefill) run one SDPA call
per request. GQA/MQA use enable_gqa, so repeated K/V heads are never materialised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata


def paged_attention_sdpa(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query [T, num_heads, head_dim] -> [T, num_heads, head_dim], like the reference."""
    out = torch.empty_like(query)
    plan = _decode_plan(meta, query.device)
    if plan is not None:
        _decode(query, k_cache, v_cache, scale, plan, out)
    if meta.max_query_len > 1:
        _prefill(query, k_cache, v_cache, meta, scale, out)
    return out


def _decode_plan(meta: AttentionMetadata, device: torch.device):
    """(query rows, context slots [B * max_len], valid mask [B, max_len]) of the decode rows,
    or None. The same for every layer, so it is built once per step and kept on the metadata."""
    plan = meta.__dict__.get("_sdpa_decode_plan", False)
    if plan is not False:
        return plan
    qsl, bs = meta.query_start_loc_cpu, meta.block_size
    decode = [i for i in range(meta.num_reqs) if qsl[i + 1] - qsl[i] == 1]
    plan = None
    if decode:
        if len(decode) == meta.num_reqs:  # pure decode step: rows are requests, no index needed
            rows = slice(0, meta.num_reqs)
            block_tables, seq_lens = meta.block_tables, meta.seq_lens
        else:
            rows = torch.tensor([qsl[i] for i in decode], device=device)
            idx = torch.tensor(decode, device=device)
            block_tables, seq_lens = meta.block_tables[idx], meta.seq_lens[idx]
        seq_lens = seq_lens.long()
        pos = torch.arange(max(meta.seq_lens_cpu[i] for i in decode), device=device)
        valid = pos[None, :] < seq_lens[:, None]
        # Padding positions re-read the request's last token instead of whatever sits past it in
        # the cache: stale slots may hold NaN/inf, which a mask alone would not neutralise.
        pos = torch.minimum(pos[None, :], seq_lens[:, None] - 1)
        blocks = torch.gather(block_tables.long(), 1, pos // bs)
        plan = rows, (blocks * bs + pos % bs).flatten(), valid
    meta.__dict__["_sdpa_decode_plan"] = plan
    return plan


def _decode(query, k_cache, v_cache, scale, plan, out) -> None:
    rows, slots, valid = plan
    num_kv_heads, head_dim = k_cache.shape[-2:]
    shape = (*valid.shape, num_kv_heads, head_dim)  # [B, max_len, kv_heads, d]
    # index_select, not advanced indexing: several times faster on CPU for this gather.
    k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).view(shape)
    v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).view(shape)
    o = F.scaled_dot_product_attention(
        query[rows].unsqueeze(2),  # [B, H, 1, d]
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    out[rows] = o.squeeze(2)


def _prefill(query, k_cache, v_cache, meta, scale, out) -> None:
    num_kv_heads, head_dim = k_cache.shape[-2:]
    bs = meta.block_size
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 1:
            continue
        num_blocks = -(-seq_len // bs)
        block_ids = meta.block_tables[i, :num_blocks].long()
        # Whole blocks are gathered, then cut to the context: [1, kv_heads, seq_len, d].
        k = k_cache.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[:seq_len]
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        q = query[start:end].transpose(0, 1)[None]  # [1, H, q_len, d]
        num_cached = seq_len - q_len
        if num_cached == 0:
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            # SDPA's is_causal aligns top-left; queries here are the last q_len positions.
            q_pos = torch.arange(num_cached, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[start:end] = o[0].transpose(0, 1)
