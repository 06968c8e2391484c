"""GGUF blocks -> group-wise int4 / int8 codes (`Int4Weight`, `Int8Weight`), without a float
round trip, for `--quantization` to use exactly as the file stores them.

Q4_0, Q4_1 and Q4_K are 4-bit codes with a scale and an offset per group of 32 weights, which is
the int4 layer's w = q * scale + min with group size 32; Q8_0 is the int8 layer's w = q * scale:
  Q4_0: w = d * (q - 8)          -> scale = d,      min = -8 d
  Q4_1: w = d * q + m            -> scale = d,      min = m
  Q4_K: w = d sc_j q - dmin m_j  -> scale = d sc_j, min = -dmin m_j
        (super-blocks of 256 = 8 sub-blocks of 32, each with 6-bit sc_j and m_j)
  Q8_0: w = d * q                -> scale = d
  Q5_0: w = d * (q - 16)         -> int8 codes q - 16 (in -16..15), scale = d
d, m, dmin are float16, which the layers keep: Q4_0, Q4_1 and Q8_0 are exact, and q * scale is
exact in float32, so one rounding of q * scale + min gives gguf's own dequantized weights bit
for bit (Q5_0 too, as int8 codes). Q4_K's d sc_j and dmin m_j can need more than float16's 11
bits: the layer rounds them to float16 (a relative error under 2^-11 of a scale; tests bound it).

Other types (K-quants other than Q4_K, ...) return None: they are dequantized to float and
quantized again at load.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from pagedllm.layers.quantization import Int4Weight, Int8Weight, QuantWeight, pack_int4

_T = gguf.GGMLQuantizationType
CODE_TYPES = (_T.Q4_0, _T.Q4_1, _T.Q4_K, _T.Q8_0, _T.Q5_0)
_INT8_TYPES = (_T.Q8_0, _T.Q5_0)


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """[blocks, bytes] -> codes [blocks, 2 * bytes]: in every run of `span` bytes the low
    nibbles are elements 0..span-1 and the high nibbles elements span..2 span - 1."""
    b = qs.reshape(qs.shape[0], -1, 1, span)
    return ((b >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(qs.shape[0], -1)


def _f16(blocks: np.ndarray, byte: int) -> np.ndarray:
    """The float16 at `byte` of every block ([blocks, type_size] bytes, contiguous, an even
    type_size) -> [blocks] float32: a column of 16-bit words, one strided copy."""
    return blocks.view(np.uint16)[:, byte // 2].view(np.float16).astype(np.float32)


def code_kind(ggml_type) -> type | None:
    """What codes_from_gguf makes of a tensor of this type (without decoding it), or None."""
    if ggml_type not in CODE_TYPES:
        return None
    return Int8Weight if ggml_type in _INT8_TYPES else Int4Weight


def codes_from_gguf(data: np.ndarray, ggml_type) -> QuantWeight | None:
    """Raw rows of a GGUF tensor ([N, bytes per row], as gguf_file.py gives them, q/k rows already
    unpermuted) -> codes, or None when the type is not one of CODE_TYPES."""
    if ggml_type not in CODE_TYPES:
        return None
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    rows = data.shape[0]
    k = data.shape[1] // type_size * block_size
    blocks = np.ascontiguousarray(data).reshape(-1, type_size)

    def tensor(a: np.ndarray, dtype=np.float32, cols: int = k // 32) -> torch.Tensor:
        return torch.from_numpy(a.astype(dtype, copy=False).reshape(rows, cols))

    if ggml_type == _T.Q8_0:
        q = blocks[:, 2:].view(np.int8)
        return Int8Weight(q=tensor(q, np.int8, k), scale=tensor(_f16(blocks, 0)))
    if ggml_type == _T.Q5_0:  # d, 4 bytes of fifth bits (bit j: element j), 16 bytes of nibbles
        qh = blocks[:, 2:6].copy().view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
        q = (_nibbles(blocks[:, 6:], 16) | ((qh & 1).astype(np.uint8) << 4)).astype(np.int8) - 16
        return Int8Weight(q=tensor(q, np.int8, k), scale=tensor(_f16(blocks, 0)))
    if ggml_type == _T.Q4_0:  # the 16 bytes of codes are pack_int4's order already
        scale = _f16(blocks, 0)
        mn = -8 * scale
        packed = torch.from_numpy(np.ascontiguousarray(blocks[:, 2:]).reshape(rows, k // 2))
    elif ggml_type == _T.Q4_1:
        scale, mn = _f16(blocks, 0), _f16(blocks, 2)
        packed = torch.from_numpy(np.ascontiguousarray(blocks[:, 4:]).reshape(rows, k // 2))
    else:  # Q4_K: d, dmin, 12 bytes of packed 6-bit (sc, m) pairs, 128 bytes of codes
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        scale = (d[:, None] * sc.astype(np.float32)).reshape(-1)
        mn = (-dmin[:, None] * m.astype(np.float32)).reshape(-1)
        packed = pack_int4(tensor(_nibbles(blocks[:, 16:], 32), np.uint8, k))
    return Int4Weight(packed=packed, scale=tensor(scale), min=tensor(mn))
