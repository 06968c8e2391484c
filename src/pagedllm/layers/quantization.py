"""Weight-only quantized linear layers for CPU, and swapping them into a model.

The weights stay quantized in memory, in blocks of 32 input channels as ggml stores them (so a
GGUF's Q4_0 / Q4_1 / Q4_K / Q8_0 blocks are used as they are); activations stay in the model's
float dtype.

int4 (`Int4Linear`): w = q * scale + min, q in 0..15, one float16 scale and min per group of
  `group_size` input channels (a multiple of 32; 32 for GGUF blocks).
int8 (`Int8Linear`): w = q * scale, q in -127..127, one float16 scale per group (ggml's Q8_0).

pagedllm's C++ kernels (kernels/csrc/quant_linear.cpp) multiply a few rows of activations by
the codes directly (decode: bound by reading the weights); for more rows (prefill, big batches)
the layer expands its weight to the activations' dtype and runs a float GEMM, which is
compute-bound there. Without the kernels, the weight is expanded by torch on every call (slow,
but the same numbers).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import kernels
from pagedllm.config import QUANTIZATION_METHODS

logger = logging.getLogger(__name__)

BLOCK = 32  # ggml's block of input channels; a group is one or more blocks
# Up to this many rows the kernels multiply the codes directly; above, expand and run a GEMM.
# Measured on this project's 2-core AVX-512 machine (docs/performance.md).
MAX_GEMV_ROWS = 16
# dtype -> a buffer for expanded weights, per thread (engines stepped on two threads must not
# share it); see _BlockQuantLinear.weight_as.
_SCRATCH = threading.local()


def _groups(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> float32 [N, K / group_size, group_size]."""
    n, k = weight.shape
    if group_size % BLOCK or k % group_size:
        raise ValueError(
            f"quantized weights need in_features % {BLOCK} == 0 and groups of whole blocks of "
            f"{BLOCK}: in_features {k}, group size {group_size}"
        )
    return weight.detach().float().reshape(n, k // group_size, group_size)


@dataclass
class Int4Weight:
    """Group-wise 4-bit codes, unpacked: w[n, k] = q[n, k] * scale[n, g] + min[n, g] with
    g = k // group_size. Rows can be concatenated (fused projections) and permuted."""

    q: torch.Tensor  # uint8 [N, K], values 0..15
    scale: torch.Tensor  # float32 [N, K / group_size]
    min: torch.Tensor  # float32 [N, K / group_size]
    group_size: int = BLOCK

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = BLOCK) -> Int4Weight:
        """Asymmetric min/max quantization per group: scale = (max - min) / 15,
        q = round((w - min) / scale)."""
        n, k = weight.shape
        w = _groups(weight, group_size)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scale = (hi - lo) / 15
        inv = torch.where(scale == 0, 0.0, 1 / scale)  # a constant group: every q = 0, w = lo
        q = torch.round((w - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
        return cls(q.reshape(n, k), scale, lo, group_size)

    @classmethod
    def cat(cls, parts: list[Int4Weight]) -> Int4Weight:
        if len({p.group_size for p in parts}) != 1:
            raise ValueError("cannot fuse int4 weights of different group sizes")
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "min")),
                   parts[0].group_size)  # fmt: skip

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: q * scale + min (q * scale is exact for float16 scales)."""
        g = self.group_size
        scale, mn = self.scale.repeat_interleave(g, dim=1), self.min.repeat_interleave(g, dim=1)
        return torch.addcmul(mn, self.q.float(), scale)


@dataclass
class Int8Weight:
    """Group-wise symmetric 8-bit codes: w[n, k] = q[n, k] * scale[n, k // group_size]."""

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K / group_size]
    group_size: int = BLOCK

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = BLOCK) -> Int8Weight:
        """scale = max |w| / 127 per group, q = round(w / scale) (ggml's Q8_0)."""
        n, k = weight.shape
        w = _groups(weight, group_size)
        scale = w.abs().amax(dim=-1) / 127
        inv = torch.where(scale == 0, 0.0, 1 / scale)
        q = torch.round(w * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return cls(q.reshape(n, k), scale, group_size)

    @classmethod
    def cat(cls, parts: list[Int8Weight]) -> Int8Weight:
        if len({p.group_size for p in parts}) != 1:
            raise ValueError("cannot fuse int8 weights of different group sizes")
        return cls(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                   parts[0].group_size)  # fmt: skip

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.repeat_interleave(self.group_size, dim=1)


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


class _BlockQuantLinear(nn.Module):
    """The forward pass shared by the int4 and int8 layers. The codes and the float16 scales are
    plain attributes, not buffers: module.to(dtype) must not cast them (counted by `nbytes`)."""

    bits: int
    weight_cls: type  # the codes it is built from: Int4Weight or Int8Weight

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """Quantize a float weight (and keep the bias in its dtype)."""
        bias = None if bias is None else bias.detach()
        return cls(cls.weight_cls.from_float(weight), bias, weight.dtype)

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = weight.q.shape
        if self.in_features % BLOCK or weight.group_size % BLOCK:
            raise ValueError(
                f"quantized weights need in_features % {BLOCK} == 0 and groups of whole "
                f"blocks: in_features {self.in_features}, group size {weight.group_size}"
            )
        self.scales = weight.scale.to(torch.float16).contiguous()
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def _codes(self) -> tuple[torch.Tensor, ...]:
        """The kernels' arguments after x (or out): codes, scales[, mins]."""
        raise NotImplementedError

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(kernels.cpu_ops(), f"int{self.bits}_linear")(x, *self._codes())

    def _expand(self, out: torch.Tensor) -> None:
        getattr(kernels.cpu_ops(), f"int{self.bits}_dequantize")(out, *self._codes())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._codes())

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        if x2d.shape[0] <= MAX_GEMV_ROWS and kernels.fused_cpu_ops_apply(x):
            y = self._gemv(x2d.contiguous())
        else:
            y = F.linear(x2d, self.weight_as(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [N, K] in `dtype`. With the kernels it is expanded into a scratch
        buffer shared by all layers (valid until the next layer's call): a fresh tensor of
        megabytes per call costs its page faults again each time."""
        if not kernels.available():
            return self.dequantize().to(dtype)
        size = self.out_features * self.in_features
        buffers = _SCRATCH.__dict__
        scratch = buffers.get(dtype)
        if scratch is None or scratch.numel() < size:
            scratch = buffers[dtype] = torch.empty(size, dtype=dtype)
        out = scratch[:size].view(self.out_features, self.in_features)
        self._expand(out)
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int{self.bits}, group_size={self.group_size}"
        )


class Int4Linear(_BlockQuantLinear):
    bits, weight_cls = 4, Int4Weight

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__(weight, bias, dtype)
        self.packed = pack_int4(weight.q)  # uint8 [N, K / 2]
        self.mins = weight.min.to(torch.float16).contiguous()

    def _codes(self):
        return self.packed, self.scales, self.mins

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], rounded as the kernel does (one fused multiply-add)."""
        g = self.group_size
        return torch.addcmul(
            self.mins.float().repeat_interleave(g, dim=1),
            unpack_int4(self.packed).float(),
            self.scales.float().repeat_interleave(g, dim=1),
        )


class Int8Linear(_BlockQuantLinear):
    bits, weight_cls = 8, Int8Weight

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__(weight, bias, dtype)
        self.qweight = weight.q.contiguous()  # int8 [N, K]

    def _codes(self):
        return self.qweight, self.scales

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float().repeat_interleave(self.group_size, dim=1)


QuantWeight = Int4Weight | Int8Weight
LAYERS = {"int4": Int4Linear, "int8": Int8Linear}


def weight_bytes(module: nn.Module) -> int:
    """Bytes of parameters and buffers, a tensor shared by two modules (tied embeddings) once."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        key = (t.untyped_storage().data_ptr(), t.data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    # Prepacked weights (layers/packed_linear.py) and quantized codes are neither parameters
    # nor buffers: their modules report `nbytes`.
    return total + sum(getattr(m, "nbytes", 0) for m in module.modules())


def validate_method(method: str) -> None:
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}"
        )


def quantize_model(
    model: nn.Module,
    method: str,
    exact_weights: dict[str, QuantWeight] | None = None,
    skip: tuple[str, ...] = (),
) -> list[str]:
    """Replace every nn.Linear of a loaded float model by its `method` counterpart, in place.

    `exact_weights` (module name -> codes) gives the codes of modules the checkpoint already
    stores in blocks of `method`'s kind (a GGUF's Q4_0 / Q4_1 / Q4_K for int4, Q8_0 for int8):
    used as they are instead of quantizing the dequantized floats again. A tied lm_head (its
    weight is the embedding's) gets an int8 copy whatever the method (int4 would cost the most
    accuracy on the logits): decode reads it every step, and 8-bit reads half of bfloat16's
    bytes; the float embedding stays for the lookups. Modules named in `skip`, and a Linear
    whose input size is not a multiple of 32, stay float. Returns the names kept in float.
    The replaced float weights are dropped with the old modules.
    """
    validate_method(method)
    if method == "none":
        return []
    exact_weights = exact_weights or {}
    kept_float = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        n, k = module.weight.shape
        if name in skip or k % BLOCK:
            kept_float.append(name)
            continue
        if module.weight.device.type != "cpu":
            raise ValueError("quantized weights run on pagedllm's CPU kernels: use --device cpu")
        owner = _owner_of(model, module.weight)  # a tied lm_head: the embedding
        layer_cls = LAYERS["int8" if owner else method]
        codes = exact_weights.get(owner or name)
        if not isinstance(codes, layer_cls.weight_cls):
            codes = layer_cls.weight_cls.from_float(module.weight)
        bias = None if module.bias is None else module.bias.detach()
        parent_name, _, child = name.rpartition(".")
        layer = layer_cls(codes, bias, module.weight.dtype)
        setattr(model.get_submodule(parent_name), child, layer)
    return kept_float


def _owner_of(model: nn.Module, weight: torch.Tensor) -> str | None:
    """The name of the non-Linear module holding `weight` (a tied embedding), or None."""
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) and any(p is weight for p in m.parameters(recurse=False)):
            return name
    return None
