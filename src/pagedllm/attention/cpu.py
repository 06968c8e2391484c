"""Paged attention through pagedllm's C++ CPU kernel (pagedllm/kernels/csrc/paged_attention.cpp).

The kernel reads K/V through the block tables in place (no gathered copy of the context) for
decode, chunked prefill and prefill with cached context alike; the torch reference is its oracle.
"""

from __future__ import annotations

import torch

from pagedllm.attention import kv_quant
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.sdpa import paged_attention_sdpa, prefill_sdpa
from pagedllm.kernels import cpu_ops

# --deterministic (the default for quantized models and in float32) sends every row through the
# kernel (min_sdpa_query_len 0), whose order of sums is fixed by a row's own positions (SDPA's
# depends on the prompt's length and chunking): docs/determinism.md. Without it, requests with
# this many query rows or more go to SDPA: measured in bfloat16 on the 2-core AVX-512 machine,
# the kernel is ahead on every chunk of up to 512 rows (1.2-5.5x, with 0 to 2048 cached tokens)
# and on whole prompts up to about this length (1.10x at 1024 rows, 0.98x at 2048, 0.82x at
# 4096: docs/performance.md).
MIN_SDPA_QUERY_LEN = 2048
_NO_SINKS = torch.empty(0)


def paged_attention_cpu(
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
    min_sdpa_query_len: int = MIN_SDPA_QUERY_LEN,
) -> torch.Tensor:
    """query [T, num_heads, head_dim] -> [T, num_heads, head_dim], like the reference.
    `key`/`value`: this step's K/V, read directly by fresh prompts (see prefill_sdpa).
    `min_sdpa_query_len`: 0 sends every request through the kernel."""
    ops = cpu_ops()
    head_dim = query.shape[-1]
    if head_dim % ops.vec_size or head_dim > ops.max_head_dim:  # rows must fill whole vectors
        return paged_attention_sdpa(
            query, k_cache, v_cache, meta, scale, sliding_window, logits_soft_cap, key, value,
            sinks,
        )  # fmt: skip
    out = torch.empty_like(query)
    ops.paged_attention(
        out,
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale,
        sliding_window or 0,
        logits_soft_cap or 0.0,
        min_sdpa_query_len,
        _NO_SINKS if sinks is None else sinks.float().contiguous(),
    )
    if min_sdpa_query_len and meta.max_query_len >= min_sdpa_query_len:
        prefill_sdpa(
            query, k_cache, v_cache, meta, scale, sliding_window, logits_soft_cap, out,
            min_query_len=min_sdpa_query_len, key=key, value=value, sinks=sinks,
        )  # fmt: skip
    return out


def write_kv_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Like torch_ref.write_kv_cache (its oracle), as one C++ row copy per token (quantized
    into codes and a scale there for an int8 / fp8 cache)."""
    if not kv_quant.is_quantized(k_cache):
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    cpu_ops().reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
