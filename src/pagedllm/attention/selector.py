"""Attention backend selection by name (the --attention-backend flag)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.attention.cpu import paged_attention_cpu, write_kv_cache_cpu
from pagedllm.attention.sdpa import paged_attention_sdpa
from pagedllm.attention.torch_ref import paged_attention_ref, write_kv_cache


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    # (query [T, H, d], k_cache, v_cache, meta, scale, *, sliding_window, logits_soft_cap,
    # key, value) -> [T, H, d]; key/value are this step's K/V, already written to the cache
    forward: Callable[..., torch.Tensor]
    # (key [T, kv_heads, d], value, k_cache, v_cache, slot_mapping) -> None
    write_kv_cache: Callable[..., None] = write_kv_cache


_BACKENDS = {
    "torch": AttentionBackend("torch", paged_attention_ref),
    "sdpa": AttentionBackend("sdpa", paged_attention_sdpa),
    "cpu": AttentionBackend("cpu", paged_attention_cpu, write_kv_cache_cpu),
}


def resolve_backend_name(name: str, device: torch.device | str = "cpu") -> str:
    """'auto' -> the fastest backend for `device`: the C++ kernel on CPU when it builds here
    (see pagedllm.kernels), SDPA otherwise. Other names are checked and returned."""
    key = name.lower()
    if key == "auto":
        from pagedllm import kernels

        return "cpu" if torch.device(device).type == "cpu" and kernels.available() else "sdpa"
    if key not in _BACKENDS:
        options = ", ".join(sorted([*_BACKENDS, "auto"]))
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {options}")
    if key == "cpu":
        from pagedllm import kernels

        if torch.device(device).type != "cpu":
            raise ValueError(f"the 'cpu' attention backend runs on CPU tensors, not {device}")
        try:
            kernels.cpu_ops()
        except kernels.KernelUnavailable as e:
            raise ValueError(f"the 'cpu' attention backend is unavailable: {e}") from None
    return key


def get_attention_backend(name: str, device: torch.device | str = "cpu") -> AttentionBackend:
    """'torch' (the reference oracle), 'sdpa', 'cpu' (the C++ kernel) or 'auto'."""
    return _BACKENDS[resolve_backend_name(name, device)]
