"""Paged attention on top of torch's scaled_dot_product_attention (the default CPU backend).

Decode rows (q_len == 1) of all requests go through one batched SDPA call over their contexts
padded to the longest one; rows with q_len > 1 (prefill, chunked prefill) run one SDPA call
per request. GQA/MQA use enable_gqa, so repeated K/V heads are never materialised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention import kv_quant
from pagedllm.attention.metadata import AttentionMetadata


def paged_attention_sdpa(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [T, num_heads, head_dim] -> [T, num_heads, head_dim], like the reference.
    `key`/`value` [T, kv_heads, head_dim]: this step's K/V (already in the cache); prompts with
    no cached context attend to them directly instead of gathering them back from the cache.
    The caches may hold another float dtype or codes and scales (kv_quant.py): what is read is
    converted to the query's dtype."""
    out = torch.empty_like(query)
    plan = _decode_plan(meta, query.device, sliding_window)
    if plan is not None:
        _decode(query, k_cache, v_cache, scale, logits_soft_cap, plan, out, sinks)
    if meta.max_query_len > 1:
        prefill_sdpa(
            query, k_cache, v_cache, meta, scale, sliding_window, logits_soft_cap, out,
            key=key, value=value, sinks=sinks,
        )  # fmt: skip
    return out


def _attend(q, k, v, mask, scale, logits_soft_cap, is_causal=False, sinks=None):
    """q [B, H, q_len, d], k/v [B, kv_heads, k_len, d]; SDPA unless the scores are soft-capped
    or there are attention sinks (SDPA has no hook between the scores and the softmax)."""
    if logits_soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    if is_causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return scores.softmax(dim=-1) @ v
    sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1] @ v


def _decode_plan(meta: AttentionMetadata, device: torch.device, sliding_window: int | None):
    """(query rows, context slots [B * max_len], valid mask [B, max_len]) of the decode rows,
    or None. The same for every layer with this window, so it is built once per step and kept
    on the metadata."""
    plans = meta.__dict__.setdefault("_sdpa_decode_plans", {})
    if sliding_window in plans:
        return plans[sliding_window]
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
        max_len = max(meta.seq_lens_cpu[i] for i in decode)
        if sliding_window is None:
            ctx_start = torch.zeros_like(seq_lens)
        else:  # only the last `sliding_window` positions (earlier blocks may be released)
            max_len = min(max_len, sliding_window)
            ctx_start = (seq_lens - sliding_window).clamp(min=0)
        pos = ctx_start[:, None] + torch.arange(max_len, device=device)[None, :]
        valid = pos < seq_lens[:, None]
        # Padding positions re-read the request's last token instead of whatever sits past it in
        # the cache: stale slots may hold NaN/inf, which a mask alone would not neutralise.
        pos = torch.minimum(pos, seq_lens[:, None] - 1)
        blocks = torch.gather(block_tables.long(), 1, pos // bs)
        plan = rows, (blocks * bs + pos % bs).flatten(), valid
    plans[sliding_window] = plan
    return plan


def _decode(query, k_cache, v_cache, scale, logits_soft_cap, plan, out, sinks=None) -> None:
    rows, slots, valid = plan
    num_kv_heads, row = k_cache.shape[-2:]
    shape = (*valid.shape, num_kv_heads, query.shape[-1])  # [B, max_len, kv_heads, d]
    # index_select, not advanced indexing: several times faster on CPU for this gather.
    k = k_cache.view(-1, num_kv_heads, row).index_select(0, slots)
    v = v_cache.view(-1, num_kv_heads, row).index_select(0, slots)
    k = kv_quant.read_rows(k, query.dtype).view(shape)
    v = kv_quant.read_rows(v, query.dtype).view(shape)
    o = _attend(
        query[rows].unsqueeze(2),  # [B, H, 1, d]
        k.transpose(1, 2),
        v.transpose(1, 2),
        valid[:, None, None, :],
        scale,
        logits_soft_cap,
        sinks=sinks,
    )
    out[rows] = o.squeeze(2)


def prefill_sdpa(
    query, k_cache, v_cache, meta, scale, sliding_window, logits_soft_cap, out,
    min_query_len=2, key=None, value=None, sinks=None,
) -> None:  # fmt: skip
    """One SDPA call per request with at least `min_query_len` query rows, into `out`."""
    num_kv_heads, head_dim = k_cache.shape[-2], query.shape[-1]
    bs = meta.block_size
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len < min_query_len:
            continue
        num_cached = seq_len - q_len
        q = query[start:end].transpose(0, 1)[None]  # [1, H, q_len, d]
        if num_cached == 0 and key is not None:  # a fresh prompt: its K/V are this step's
            ctx_start = 0
            k = key[start:end].transpose(0, 1)[None]
            v = value[start:end].transpose(0, 1)[None]
        else:
            # Whole blocks from the first one the first query can see (all of them without a
            # window) are gathered, then cut to the context: [1, kv_heads, ctx_len, d].
            first_block = 0
            if sliding_window is not None:
                first_block = max(0, num_cached - sliding_window + 1) // bs
            ctx_start = first_block * bs
            block_ids = meta.block_tables[i, first_block : -(-seq_len // bs)].long()
            k = kv_quant.read_rows(k_cache.index_select(0, block_ids), query.dtype)
            v = kv_quant.read_rows(v_cache.index_select(0, block_ids), query.dtype)
            k = k.view(-1, num_kv_heads, head_dim)
            v = v.view(-1, num_kv_heads, head_dim)
            k = k[: seq_len - ctx_start].transpose(0, 1)[None]
            v = v[: seq_len - ctx_start].transpose(0, 1)[None]
        if num_cached == 0 and sliding_window is None:
            o = _attend(q, k, v, None, scale, logits_soft_cap, is_causal=True, sinks=sinks)
        else:
            # SDPA's is_causal aligns top-left; queries here are the last q_len positions.
            q_pos = torch.arange(num_cached, seq_len, device=query.device)[:, None]
            k_pos = torch.arange(ctx_start, seq_len, device=query.device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            o = _attend(q, k, v, mask, scale, logits_soft_cap, sinks=sinks)
        out[start:end] = o[0].transpose(0, 1)
