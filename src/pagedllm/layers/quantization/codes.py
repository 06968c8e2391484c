"""Group-wise int4 / int8 codes in ggml's blocks of 32 input channels, as a GGUF's Q4_0 / Q4_1 /
Q4_K / Q8_0 blocks hold them (model_loader/gguf_codes.py), or quantized from float weights; and
int8x, 8-bit codes with a scale per half group and a min per group, which Q6_K, Q5_K and Q5_1
become for the integer kernels (layers/quantization/int8_act.py).

Every row, and every group of 32 columns in it, quantizes on its own: the codes of a matrix's
rows (or of its columns, cut on group boundaries) are those rows (columns) of the whole matrix's
codes, so a layer can quantize each checkpoint shard as it arrives, or take a rank's slice of a
GGUF's codes, and hold what quantizing the whole matrix would have given.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

BLOCK = 32  # ggml's block of input channels: one scale (and min) per row and block


def _groups(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> float32 [N, K / 32, 32]."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"quantized weights need in_features % {BLOCK} == 0, got {k}")
    return weight.detach().float().reshape(n, k // BLOCK, BLOCK)


class _Codes:
    """Row and column slices, shared by every kind of codes."""

    q: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def narrow(self, dim: int, start: int, length: int):
        """Rows, or columns on group boundaries, as torch.Tensor.narrow does."""
        if dim == 0:
            rows = {f.name: getattr(self, f.name).narrow(0, start, length) for f in fields(self)}
            return replace(self, **rows)
        if start % BLOCK or length % BLOCK:
            raise ValueError(
                f"quantized columns split on groups of {BLOCK}, not at {start}..{start + length}"
            )
        k = self.shape[1]  # every field's columns are a fixed fraction of K's
        columns = {}
        for f in fields(self):
            t = getattr(self, f.name)
            columns[f.name] = t.narrow(1, start * t.shape[1] // k, length * t.shape[1] // k)
        return replace(self, **columns)

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self))

    def rows(self, index: torch.Tensor):
        """The rows at `index` (an embedding's lookups), as codes."""
        return replace(self, **{f.name: getattr(self, f.name)[index] for f in fields(self)})


@dataclass
class Int4Weight(_Codes):
    """4-bit codes, two a byte in ggml's order (as a GGUF's Q4_0 / Q4_1 blocks hold them, so
    those are taken without unpacking): w[n, k] = q[n, k] * scale[n, k // 32] + min[n, k // 32]."""

    packed: torch.Tensor  # uint8 [N, K / 2]: pack_int4's order
    scale: torch.Tensor  # float32 [N, K / 32]
    min: torch.Tensor  # float32 [N, K / 32]

    @property
    def q(self) -> torch.Tensor:
        """uint8 [N, K], values 0..15."""
        return unpack_int4(self.packed)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], 2 * self.packed.shape[1]))

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int4Weight:
        """Asymmetric min/max quantization per group: scale = (max - min) / 15,
        q = round((w - min) / scale)."""
        n, k = weight.shape
        w = _groups(weight)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scale = (hi - lo) / 15
        inv = torch.where(scale == 0, 0.0, 1 / scale)  # a constant group: every q = 0, w = lo
        q = torch.round((w - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
        return cls(pack_int4(q.reshape(n, k)), scale, lo)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: q * scale + min (q * scale is exact for float16 scales)."""
        scale = self.scale.repeat_interleave(BLOCK, dim=1)
        return torch.addcmul(self.min.repeat_interleave(BLOCK, dim=1), self.q.float(), scale)


@dataclass
class Int8Weight(_Codes):
    """Symmetric 8-bit codes: w[n, k] = q[n, k] * scale[n, k // 32] (ggml's Q8_0)."""

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K / 32]

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Weight:
        """scale = max |w| / 127 per group, q = round(w / scale)."""
        n, k = weight.shape
        w = _groups(weight)
        scale = w.abs().amax(dim=-1) / 127
        inv = torch.where(scale == 0, 0.0, 1 / scale)
        q = torch.round(w * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return cls(q.reshape(n, k), scale)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.repeat_interleave(BLOCK, dim=1)


HALF = BLOCK // 2  # Q6_K's sub-blocks: int8x's scales are per half group


@dataclass
class Int8xWeight(_Codes):
    """8-bit codes with a scale per half group of 16 columns and a min per group:
    w[n, k] = q[n, k] * scale[n, k // 16] + min[n, k // 32]. What the integer kernels take for
    GGUF's Q6_K (16-column sub-blocks), Q5_K and Q5_1 (5-bit codes with mins), and for a layer
    whose parts the file stores in different kinds (of, below)."""

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K / 16]
    min: torch.Tensor  # float32 [N, K / 32]

    @classmethod
    def of(cls, codes: QuantWeight) -> Int8xWeight:
        """The same weights as int8x codes, exactly (int4's codes 0..15 and int8's fit 8 bits;
        their group scale serves both halves)."""
        if isinstance(codes, Int8xWeight):
            return codes
        scale = codes.scale.repeat_interleave(2, dim=1)
        if isinstance(codes, Int4Weight):
            return cls(codes.q.to(torch.int8), scale, codes.min)
        return cls(codes.q, scale, torch.zeros_like(codes.scale))

    @classmethod
    def from_float(cls, weight: torch.Tensor, bits: int = 8) -> Int8xWeight:
        """Symmetric codes of `bits` bits per half group: scale = max |w| / (2^(bits-1) - 1),
        q = round(w / scale) (bits 6: the codes int6 layers hold, in -31..31), mins 0."""
        n, k = weight.shape
        w = _groups(weight).reshape(n, k // HALF, HALF)
        top = 2 ** (bits - 1) - 1
        scale = w.abs().amax(dim=-1) / top
        inv = torch.where(scale == 0, 0.0, 1 / scale)
        q = torch.round(w * inv[..., None]).clamp(-top, top).to(torch.int8)
        return cls(q.reshape(n, k), scale, torch.zeros(n, k // BLOCK))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: q * scale + min."""
        scale = self.scale.repeat_interleave(HALF, dim=1)
        return torch.addcmul(self.min.repeat_interleave(BLOCK, dim=1), self.q.float(), scale)


QuantWeight = Int4Weight | Int8Weight | Int8xWeight


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] -> [N, K / 2] in ggml's order: byte i of each 32-code block holds code
    i (low nibble) and code i + 16 (high nibble)."""
    n, k = q.shape
    blocks = q.reshape(n, k // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    blocks = packed.reshape(n, half // (BLOCK // 2), 1, BLOCK // 2)
    return torch.cat([blocks & 15, blocks >> 4], dim=2).reshape(n, 2 * half)
