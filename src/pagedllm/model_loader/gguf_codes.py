"""GGUF blocks -> group-wise int4 / int8 / int8x codes (`Int4Weight`, `Int8Weight`,
`Int8xWeight`), without a float round trip, for the layers to use exactly as the file stores them.

Q4_0, Q4_1 and Q4_K are 4-bit codes with a scale and an offset per group of 32 weights, which is
the int4 layer's w = q * scale + min with group size 32; Q8_0 is the int8 layer's w = q * scale:
  Q4_0: w = d * (q - 8)          -> scale = d,      min = -8 d
  Q4_1: w = d * q + m            -> scale = d,      min = m
  Q4_K: w = d sc_j q - dmin m_j  -> scale = d sc_j, min = -dmin m_j
        (super-blocks of 256 = 8 sub-blocks of 32, each with 6-bit sc_j and m_j)
  Q8_0: w = d * q                -> scale = d
  Q5_0: w = d * (q - 16)         -> int8 codes q - 16 (in -16..15), scale = d
and as int8x codes (q, a scale per 16 columns, a min per 32), which only the integer kernels take:
  Q6_K: w = d sc_j (q - 32)      -> int8x codes q - 32 (in -32..31), scale = d sc_j, min = 0
        (super-blocks of 256 = 16 sub-blocks of 16, each with an int8 sc_j)
  Q5_K: w = d sc_j q - dmin m_j  -> int8x codes q (in 0..31), scale = d sc_j, min = -dmin m_j
  Q5_1: w = d * q + m            -> int8x codes q (in 0..31), scale = d, min = m
  MXFP4: w = d * e2m1(q)         -> int8x codes 2 e2m1(q) (0, +-1, +-2, +-3, +-4, +-6, +-8,
        +-12), scale = d / 2 = 2^(e - 128) (gpt-oss's experts: a power of two per 32, float16
        holds it exactly from 2^-24 to 2^15, which takes any weight above 4e-7), min = 0
d, m, dmin are float16, which the layers keep: Q4_0, Q4_1 and Q8_0 are exact, and q * scale is
exact in float32, so one rounding of q * scale + min gives gguf's own dequantized weights bit
for bit (Q5_0 and Q5_1 too). The K-quants' d sc_j and dmin m_j can need more than float16's 11
bits: the codes hold them exactly (so they too give gguf's weights bit for bit), the layers round
them to float16 (a relative error under 2^-11 of a scale; tests bound it).

Other types (Q2_K, Q3_K, the IQ types, ...) return None: they are dequantized to float.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from pagedllm.layers.quantization import Int4Weight, Int8Weight, Int8xWeight, QuantWeight
from pagedllm.model_loader.gguf_config import CODE_TYPES

_T = gguf.GGMLQuantizationType
_KINDS = {
    **dict.fromkeys((_T.Q4_0, _T.Q4_1, _T.Q4_K), Int4Weight),
    **dict.fromkeys((_T.Q8_0, _T.Q5_0), Int8Weight),
    **dict.fromkeys((_T.Q6_K, _T.Q5_K, _T.Q5_1, _T.MXFP4), Int8xWeight),
}
assert set(_KINDS) == set(CODE_TYPES), "a code type without its kind, or the other way"


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """[blocks, bytes] -> codes [blocks, 2 * bytes]: in every run of `span` bytes the low
    nibbles are elements 0..span-1 and the high nibbles elements span..2 span - 1."""
    b = qs.reshape(qs.shape[0], -1, span)
    out = np.empty((qs.shape[0], b.shape[1], 2, span), np.uint8)
    np.bitwise_and(b, 0x0F, out=out[:, :, 0])
    np.right_shift(b, 4, out=out[:, :, 1])
    return out.reshape(qs.shape[0], -1)


def _five_bit(blocks: np.ndarray, at: int) -> np.ndarray:
    """Q5_0 / Q5_1 codes, uint8 in 0..31 [blocks, 32]: 4 bytes of fifth bits at `at` (bit j:
    element j), then 16 bytes of nibbles."""
    qh = blocks[:, at : at + 4].copy().view(np.uint32).reshape(-1, 1)
    fifth = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    return _nibbles(blocks[:, at + 4 :], 16) | fifth


def _q4_k_packed(qs: np.ndarray) -> np.ndarray:
    """Q4_K's 128 bytes of codes a super-block -> pack_int4's order, byte for byte: each 32-byte
    run holds a 32-code block in its low nibbles and the next in its high nibbles, and a packed
    block's byte i holds its codes i and i + 16."""
    run = qs.reshape(qs.shape[0], -1, 2, 16)  # [blocks, runs, bytes 0..15 / 16..31, 16]
    first, second = run[:, :, 0], run[:, :, 1]
    out = np.empty((qs.shape[0], run.shape[1], 2, 16), np.uint8)
    np.bitwise_or(first & 0x0F, second << 4, out=out[:, :, 0])  # the low nibbles' block
    np.bitwise_or(first >> 4, second & 0xF0, out=out[:, :, 1])  # the high nibbles' block
    return out.reshape(qs.shape[0], -1)


def _f16(blocks: np.ndarray, byte: int) -> np.ndarray:
    """The float16 at `byte` of every block ([blocks, type_size] bytes, contiguous, an even
    type_size) -> [blocks] float32: a column of 16-bit words, one strided copy."""
    return blocks.view(np.uint16)[:, byte // 2].view(np.float16).astype(np.float32)


def code_kind(ggml_type) -> type | None:
    """What codes_from_gguf makes of a tensor of this type (without decoding it), or None."""
    return _KINDS.get(ggml_type)


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
    if ggml_type == _T.Q5_0:  # d, then the 5-bit codes
        q = _five_bit(blocks, 2).astype(np.int8) - 16
        return Int8Weight(q=tensor(q, np.int8, k), scale=tensor(_f16(blocks, 0)))
    if _KINDS[ggml_type] is Int8xWeight:
        q, scale, mn = _int8x(blocks, ggml_type)
        return Int8xWeight(tensor(q, np.int8, k), tensor(scale, cols=k // 16), tensor(mn))
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
        packed = torch.from_numpy(_q4_k_packed(blocks[:, 16:]).reshape(rows, k // 2))
    return Int4Weight(packed=packed, scale=tensor(scale), min=tensor(mn))


def _int8x(blocks: np.ndarray, ggml_type) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K / Q5_K / Q5_1 / MXFP4 blocks -> codes [blocks, block size], scales (one per 16
    codes) and mins (one per 32), float32, each in the codes' order (gguf.quants'
    dequantize_blocks read alike)."""
    n = blocks.shape[0]
    if ggml_type == _T.MXFP4:  # e (E8M0), then 16 bytes of e2m1 nibbles
        values = np.array(gguf.quants.MXFP4.kvalues, np.int8)  # e2m1, doubled
        scale = gguf.quants.MXFP4.e8m0_to_fp32_half(blocks[:, 0].astype(np.uint32))
        return values[_nibbles(blocks[:, 1:], 16)], np.repeat(scale, 2), np.zeros(n, np.float32)
    if ggml_type == _T.Q5_1:  # d, m, then the 5-bit codes
        return _five_bit(blocks, 4), np.repeat(_f16(blocks, 0), 2), _f16(blocks, 2)
    if ggml_type == _T.Q5_K:  # d, dmin, 12 bytes of 6-bit (sc, m), 32 of fifth bits, 128 of nibbles
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        fifth = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = _nibbles(blocks[:, 48:], 32).reshape(n, 8, 32)
        q |= (fifth & 1) << 4
        scale = d[:, None] * sc.reshape(n, 8).astype(np.float32)
        return q, np.repeat(scale, 2, axis=1), -dmin[:, None] * m.reshape(n, 8).astype(np.float32)
    # Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 sub-block scales, d
    q = _nibbles(blocks[:, :128], 64).reshape(n, 2, 4, 32)
    pairs = blocks[:, 128:192].reshape(n, 2, 32)
    for i in range(4):  # bits 2i, 2i + 1 of each byte: elements 32 i.. of its half
        q[:, :, i] |= ((pairs >> (2 * i)) & 3) << 4
    q = q.reshape(n, 256).view(np.int8)
    q -= 32
    scale = _f16(blocks, 208)[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return q, scale, np.zeros((n, 8), np.float32)
