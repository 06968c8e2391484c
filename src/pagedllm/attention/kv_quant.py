"""The KV cache's storage formats (--kv-cache-dtype): a float dtype, or one-byte codes with a
scale per token and KV head.

A quantized row (one token, one KV head) is `head_dim` codes followed by its float32 scale's 4
bytes: amax / the format's largest code, so the row's largest element lands on the largest
code. The scale travels inside the row, so the pool keeps one tensor, and block copies
(copy-on-write, swap) move codes and scales together without knowing about either. The layers'
cache views are typed with the code dtype (int8, float8_e4m3fn, float8_e5m2) over a uint8
pool, and their last dimension is head_dim + SCALE_BYTES: a cache says what it holds.

Why per token and head: a decode step writes one token at a time, so a scale over a block
would have to be revised (and the block requantized) as the block fills; a row's scale is
final when it is written. It costs 4 bytes per 64-byte row at head_dim 64 (6%).

Quantizing is the same arithmetic here and in the C++ kernel (reshape_and_cache), so the two
write the same bytes: scale = amax / max_code, inv = 1 / scale (0 for an all-zero row), code =
round-half-even(x * inv) clamped (int8) or x * inv clamped to the range, then converted (fp8).
"""

from __future__ import annotations

import torch

from pagedllm.core.kv_cache_spec import SCALE_BYTES  # one float32 per (token, KV head) row

# --kv-cache-dtype name -> the codes' dtype; "fp8" is e4m3, as in vLLM.
CODE_DTYPES = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MAX_CODE = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: float(torch.finfo(torch.float8_e4m3fn).max),  # 448
    torch.float8_e5m2: float(torch.finfo(torch.float8_e5m2).max),  # 57344
}


def is_quantized(cache: torch.Tensor | torch.dtype) -> bool:
    """Whether a cache (or a cache dtype) holds codes with scales rather than floats."""
    dtype = cache if isinstance(cache, torch.dtype) else cache.dtype
    return dtype in _MAX_CODE


def storage_dtype(name: str) -> torch.dtype:
    """The dtype of a cache's elements for a resolved --kv-cache-dtype ('auto' resolved)."""
    if name in CODE_DTYPES:
        return CODE_DTYPES[name]
    if name in FLOAT_DTYPES:
        return FLOAT_DTYPES[name]
    raise ValueError(f"unknown KV cache dtype {name!r}")


def row_elements(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row of a cache of `dtype`."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def quantize(x: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> uint8 rows [..., head_dim + SCALE_BYTES]."""
    x = x.float()
    max_code = _MAX_CODE[code_dtype]
    scale = x.abs().amax(dim=-1, keepdim=True) / max_code
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    y = (x * inv).clamp(-max_code, max_code)
    codes = y.round().to(torch.int8) if code_dtype == torch.int8 else y.to(code_dtype)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows [..., head_dim + SCALE_BYTES] of a quantized cache -> float32 [..., head_dim]."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    raw = rows.view(torch.uint8)
    codes = raw[..., :head_dim].view(rows.dtype).float()
    # The scale's bytes are not 4-aligned in the row unless head_dim is; copy them out to read.
    scale = raw[..., head_dim:].contiguous().view(torch.float32)
    return codes * scale


def read_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as `dtype` values of head_dim elements, whatever the cache's format."""
    return dequantize(rows).to(dtype) if is_quantized(rows) else rows.to(dtype)


def write_rows(flat_cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x [T, kv_heads, head_dim] into flat_cache [num_slots, kv_heads, row] at `slots`."""
    if is_quantized(flat_cache):
        flat_cache.view(torch.uint8).index_copy_(0, slots, quantize(x, flat_cache.dtype))
    else:
        flat_cache.index_copy_(0, slots, x.to(flat_cache.dtype))
