"""GGUF 4-bit blocks -> group-wise int4 codes (`Int4Weight`), without a float round trip.

Q4_0, Q4_1 and Q4_K are each 4-bit codes with a scale and an offset per group of 32 weights,
which is exactly the int4 kernel's w = (q - 8) * scale + zero with group size 32:
  Q4_0: w = d * (q - 8)          -> scale = d,      zero = 0
  Q4_1: w = d * q + m            -> scale = d,      zero = m + 8 d
  Q4_K: w = d sc_j q - dmin m_j  -> scale = d sc_j, zero = 8 d sc_j - dmin m_j
        (super-blocks of 256 = 8 sub-blocks of 32, each with 6-bit sc_j and m_j)
d, m, dmin are float16 and sc_j, m_j small integers, so scale is exact in float32, and the
kernel's fused multiply-add rounds (q - 8) * scale + zero once, as gguf's dequantize rounds
d * q + m once: the same float32 weights whenever zero is exact too. It always is for Q4_0, and
was for every Q4_1 tensor of the default model (tests check it); Q4_K's 8 d sc_j - dmin m_j can
need more than 24 bits, and then the weights differ by one rounding of zero (about 0.1% of
them in tests). In bfloat16 the scales themselves are rounded (bfloat16 has fewer mantissa bits
than float16).

Other types (Q8_0, K-quants other than Q4_K, ...) return None: they are dequantized to float
and quantized again at load, e.g. Q8_0's per-32 scales do not map onto the int8 kernel's one
scale per output channel, so `--quantization int8` requantizes them from the dequantized floats.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from pagedllm.layers.quantization import Int4Weight

_T = gguf.GGMLQuantizationType
INT4_TYPES = (_T.Q4_0, _T.Q4_1, _T.Q4_K)


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """[blocks, bytes] -> codes [blocks, 2 * bytes]: in every run of `span` bytes the low
    nibbles are elements 0..span-1 and the high nibbles elements span..2 span - 1."""
    b = qs.reshape(qs.shape[0], -1, 1, span)
    return ((b >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(qs.shape[0], -1)


def _f16(raw: np.ndarray) -> np.ndarray:
    """[blocks, 2] bytes -> [blocks] float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32).reshape(-1)


def int4_weight_from_gguf(data: np.ndarray, ggml_type) -> Int4Weight | None:
    """Raw rows of a GGUF tensor ([N, bytes per row], as GGUFReader gives them, q/k rows already
    unpermuted) -> int4 codes, or None when the type is not a 4-bit group format."""
    if ggml_type not in INT4_TYPES:
        return None
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    rows = data.shape[0]
    k = data.shape[1] // type_size * block_size
    blocks = np.ascontiguousarray(data).reshape(-1, type_size)
    if ggml_type == _T.Q4_0:
        scale = _f16(blocks[:, :2])
        zero = np.zeros_like(scale)
        q = _nibbles(blocks[:, 2:], 16)
    elif ggml_type == _T.Q4_1:
        scale, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        zero = m + 8 * scale
        q = _nibbles(blocks[:, 4:], 16)
    else:  # Q4_K: d, dmin, 12 bytes of packed 6-bit (sc, m) pairs, 128 bytes of codes
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        scale = (d[:, None] * sc.astype(np.float32)).reshape(-1)
        zero = (8 * d[:, None] * sc.astype(np.float32) - dmin[:, None] * mn).reshape(-1)
        q = _nibbles(blocks[:, 16:], 32)
    return Int4Weight(
        q=torch.from_numpy(q.reshape(rows, k).astype(np.uint8)),
        scale=torch.from_numpy(scale.astype(np.float32).reshape(rows, k // 32)),
        zero=torch.from_numpy(zero.astype(np.float32).reshape(rows, k // 32)),
        group_size=32,
    )
