"""Attention backend selection by name (the --attention-backend flag)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.attention.sdpa import paged_attention_sdpa
from pagedllm.attention.torch_ref import paged_attention_ref, write_kv_cache


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    # (query [T, H, d], k_cache, v_cache, meta, scale, *, sliding_window, logits_soft_cap)
    # -> [T, H, d]
    forward: Callable[..., torch.Tensor]
    # (key [T, kv_heads, d], value, k_cache, v_cache, slot_mapping) -> None
    write_kv_cache: Callable[..., None] = write_kv_cache


_BACKENDS = {
    "torch": AttentionBackend("torch", paged_attention_ref),
    "sdpa": AttentionBackend("sdpa", paged_attention_sdpa),
}
_ALIASES = {"auto": "sdpa"}


def get_attention_backend(name: str) -> AttentionBackend:
    """'torch' (the reference oracle), 'sdpa', or 'auto' (the fastest available: sdpa for now)."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in _BACKENDS:
        options = ", ".join(sorted([*_BACKENDS, *_ALIASES]))
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {options}")
    return _BACKENDS[key]
