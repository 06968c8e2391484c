"""Attention backend selection by name (the --attention-backend flag)."""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.attention.cpu import paged_attention_cpu, write_kv_cache_cpu
from pagedllm.attention.sdpa import paged_attention_sdpa
from pagedllm.attention.torch_ref import paged_attention_ref, write_kv_cache
from pagedllm.config import ATTENTION_BACKENDS


def copy_blocks_torch(
    src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    """Block src_ids[i] of every layer's K and V in src ([groups, 2, num_blocks, ...]) to block
    dst_ids[i] of dst. index_select + index_copy_: about 3x faster on CPU than advanced-index
    assignment, which builds extra full-size temporaries."""
    dst.index_copy_(2, dst_ids, src.index_select(2, src_ids))


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    # (query [T, H, d], k_cache, v_cache, meta, scale, *, sliding_window, logits_soft_cap,
    # key, value) -> [T, H, d]; key/value are this step's K/V, already written to the cache
    forward: Callable[..., torch.Tensor]
    # (key [T, kv_heads, d], value, k_cache, v_cache, slot_mapping) -> None
    write_kv_cache: Callable[..., None] = write_kv_cache
    # (src pool, dst pool, src block ids, dst block ids) -> None: copy-on-write and swapping
    copy_blocks: Callable[..., None] = copy_blocks_torch


_BACKENDS = {
    "torch": AttentionBackend("torch", paged_attention_ref),
    "sdpa": AttentionBackend("sdpa", paged_attention_sdpa),
    "cpu": AttentionBackend("cpu", paged_attention_cpu, write_kv_cache_cpu),
}
# --deterministic: every request through the kernel, prefill chunks too (attention/cpu.py)
_CPU_FIXED_ORDER = AttentionBackend(
    "cpu", functools.partial(paged_attention_cpu, min_sdpa_query_len=0), write_kv_cache_cpu
)
_NAMES = [b for b in ATTENTION_BACKENDS if b != "auto"]  # triton: imported when asked for


def resolve_backend_name(name: str, device: torch.device | str | None = None) -> str:
    """'auto' -> the fastest backend for `device` (CPU when None): on CPU the C++ kernel when it
    builds here (see pagedllm.kernels), on a GPU the Triton kernels when Triton is installed
    (torch's CUDA builds bring it); SDPA otherwise. Other names are checked (against `device`
    when given) and returned."""
    key = name.lower()
    device_type = None if device is None else torch.device(device).type
    if key == "auto":
        if device_type in (None, "cpu"):
            from pagedllm import kernels

            return "cpu" if kernels.available() else "sdpa"
        return "triton" if device_type == "cuda" and _has_triton() else "sdpa"
    if key not in _NAMES:
        options = ", ".join(sorted([*_NAMES, "auto"]))
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {options}")
    if key == "cpu":
        from pagedllm import kernels

        if device_type not in (None, "cpu"):
            raise ValueError(f"the 'cpu' attention backend runs on CPU tensors, not {device}")
        try:
            kernels.cpu_ops()
        except kernels.KernelUnavailable as e:
            raise ValueError(f"the 'cpu' attention backend is unavailable: {e}") from None
    if key == "triton":
        if not _has_triton():
            raise ValueError("the 'triton' attention backend needs Triton: pip install triton")
        if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "the 'triton' attention backend runs on CUDA GPUs; on CPU tensors only under "
                "Triton's interpreter (set TRITON_INTERPRET=1; slow, meant for tests)"
            )
        if device_type not in (None, "cpu", "cuda"):
            raise ValueError(f"the 'triton' attention backend runs on CUDA tensors, not {device}")
    return key


def get_attention_backend(
    name: str, device: torch.device | str | None = None, deterministic: bool = False
) -> AttentionBackend:
    """'torch' (the reference oracle), 'sdpa', 'cpu' (the C++ kernel), 'triton' (GPU) or
    'auto'; checked against `device` when given. `deterministic`: the batch-invariant form of
    the CPU kernel or of Triton's (docs/determinism.md), which only they have."""
    key = resolve_backend_name(name, device)
    if deterministic and key not in ("cpu", "triton"):
        raise ValueError(f"--deterministic needs the cpu or triton attention backend, not {key!r}")
    if key == "triton":
        return _triton_backend(deterministic)
    return _CPU_FIXED_ORDER if deterministic else _BACKENDS[key]


@functools.cache
def _triton_backend(deterministic: bool = False) -> AttentionBackend:
    from pagedllm.attention import triton_attention as t

    forward = t.paged_attention_triton
    if deterministic:
        forward = functools.partial(forward, deterministic=True)
    return AttentionBackend("triton", forward, t.write_kv_cache_triton, t.copy_blocks_triton)


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None
