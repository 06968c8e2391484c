"""Reference paged attention: a plain per-request loop, written to be obviously correct.

This is the oracle every faster backend is tested against. Each request's K/V are gathered
token by token through its block table; its q_len queries are the last q_len positions of a
context of seq_len tokens, so prefill, chunked prefill and decode share this one path.
"""

from __future__ import annotations

import torch

from pagedllm.attention import kv_quant
from pagedllm.attention.metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value [T, kv_heads, head_dim] into the caches [num_blocks, block_size, kv_heads,
    row] at the flat slots slot_mapping[T] (block_id * block_size + offset); a row is head_dim
    elements, or codes and a scale in a quantized cache (kv_quant.py)."""
    num_kv_heads, row = k_cache.shape[-2:]
    kv_quant.write_rows(k_cache.view(-1, num_kv_heads, row), slot_mapping, key)
    kv_quant.write_rows(v_cache.view(-1, num_kv_heads, row), slot_mapping, value)


def context_slots(block_table: list[int], seq_len: int, block_size: int) -> list[int]:
    """Cache slot of every position 0..seq_len-1 of one request."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(seq_len)]


def paged_attention_ref(
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
    """query [T, num_heads, head_dim] -> [T, num_heads, head_dim], computed in float32.
    Everything is read from the caches; `key`/`value` (this step's K/V) are ignored.

    `sliding_window`: a query at position p sees keys at positions > p - sliding_window only;
    positions before the first query's window are never read (a sliding layer may have released
    their blocks). `logits_soft_cap`: scores become cap * tanh(scores / cap) before the softmax.
    `sinks` [num_heads]: each head's attention sink (gpt-oss), a logit in the softmax's sum that
    no value goes with: it takes its share of the weight away from every key.
    """
    num_heads = query.shape[1]
    num_kv_heads, row = k_cache.shape[-2:]
    group = num_heads // num_kv_heads
    k_flat = k_cache.view(-1, num_kv_heads, row)
    v_flat = v_cache.view(-1, num_kv_heads, row)
    block_tables = meta.block_tables.tolist()
    out = torch.empty_like(query)
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        q_len = end - start
        first_q = seq_len - q_len
        ctx_start = 0 if sliding_window is None else max(0, first_q - sliding_window + 1)
        slots = context_slots(block_tables[i], seq_len, meta.block_size)[ctx_start:]
        slots = torch.tensor(slots, device=k_flat.device)
        # Query head h reads KV head h // group (the GQA/MQA convention of HF's repeat_kv).
        k = kv_quant.read_rows(k_flat[slots], torch.float32)  # [ctx_len, kv_heads, d]
        v = kv_quant.read_rows(v_flat[slots], torch.float32)
        k = k.repeat_interleave(group, dim=1)  # [ctx_len, H, d]
        v = v.repeat_interleave(group, dim=1)
        q = query[start:end].float()  # [q_len, H, d]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logits_soft_cap is not None:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        # Query i sits at absolute position (first_q + i) and sees keys up to it.
        q_pos = torch.arange(first_q, seq_len, device=q.device)
        k_pos = torch.arange(ctx_start, seq_len, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # one more column per head, dropped after the softmax
            sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
