"""Weight-only quantized linear layers on torch's own CPU kernels, and swapping them into a model.

The weights stay quantized in memory; activations stay in the model's float dtype.

int8 (`Int8Linear`): one symmetric scale per output channel, w = q * scale, q in [-127, 127];
  `aten._weight_int8pack_mm(x [M, K], q int8 [N, K], scale [N])`.
int4 (`Int4Linear`): groups of `group_size` input channels, each with a scale and a zero,
  w = (q - 8) * scale + zero, q in [0, 15] (torch's convention; the kernel computes it with one
  fused multiply-add); `aten._convert_weight_to_int4pack_for_cpu(q int32 [N, K], 1)` packs
  q into uint8 [N, K / 2] (a blocked layout: rows cannot be packed separately and concatenated)
  and `aten._weight_int4pack_mm_for_cpu(x [M, K], packed, group_size, scale_zero [K / g, N, 2])`.

What the kernels accept (torch 2.13, checked numerically in tests/layers/test_quantization.py):
  x must be 2-D with a contiguous last dimension; scales (and zeros) must have x's dtype (float32,
  bfloat16 or float16); int4 needs N % 16 == 0, group_size in {32, 64, 128, 256} and
  K % group_size == 0. A layer that cannot meet this stays in float (see `quantize_model`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.config import QUANTIZATION_METHODS

logger = logging.getLogger(__name__)

INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu's requirement on output channels


def _matmul_2d(x: torch.Tensor, fn) -> torch.Tensor:
    """Both kernels take a 2-D input: flatten leading dimensions and restore them."""
    lead = x.shape[:-1]
    y = fn(x.reshape(-1, x.shape[-1]).contiguous())
    return y.reshape(*lead, y.shape[-1])


class Int8Linear(nn.Module):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)  # int8 [N, K]; not cast by module.to(dtype)
        self.register_buffer("scales", scales)  # float [N]; follows module.to(dtype)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """Symmetric per-output-channel quantization: scale = max|w| / 127 (float32 math).
        A GGUF Q8_0 weight arrives here dequantized: its per-32 block scales do not map onto one
        scale per output channel, so it is requantized (not bit-exact, unlike int4 from Q4)."""
        w = weight.detach().float()
        scales = w.abs().amax(dim=1) / 127
        q = torch.round(w / scales.clamp(min=1e-12)[:, None]).clamp(-127, 127).to(torch.int8)
        dtype = weight.dtype
        return cls(q, scales.to(dtype), None if bias is None else bias.detach().to(dtype))

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scales = self.scales if self.scales.dtype == x.dtype else self.scales.to(x.dtype)
        y = _matmul_2d(x, lambda a: torch.ops.aten._weight_int8pack_mm(a, self.qweight, scales))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


@dataclass
class Int4Weight:
    """Group-wise 4-bit codes before packing: w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]
    with g = k // group_size. Rows can be concatenated (fused projections) and permuted."""

    q: torch.Tensor  # uint8 [N, K], values 0..15
    scale: torch.Tensor  # float32 [N, K / group_size]
    zero: torch.Tensor  # float32 [N, K / group_size]
    group_size: int

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int) -> Int4Weight:
        """Asymmetric min/max quantization per group: scale = (max - min) / 15,
        q = round((w - min) / scale), zero = min + 8 * scale."""
        n, k = weight.shape
        w = weight.detach().float().reshape(n, k // group_size, group_size)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scale = (hi - lo) / 15
        inv = torch.where(scale == 0, 0.0, 1 / scale)  # a constant group: every q = 0, w = lo
        q = torch.round((w - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
        return cls(q.reshape(n, k), scale, lo + 8 * scale, group_size)

    @classmethod
    def cat(cls, parts: list[Int4Weight]) -> Int4Weight:
        if len({p.group_size for p in parts}) != 1:
            raise ValueError("cannot fuse int4 weights of different group sizes")
        return cls(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
            parts[0].group_size,
        )

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], rounded as the kernel does (one fused multiply-add)."""
        g = self.group_size
        scale = self.scale.repeat_interleave(g, dim=1)
        zero = self.zero.repeat_interleave(g, dim=1)
        return torch.addcmul(zero, self.q.float() - 8, scale)


class Int4Linear(nn.Module):
    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = weight.q.shape
        self.group_size = weight.group_size
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32), 1)
        self.register_buffer("packed", packed)  # uint8 [N, K / 2]
        # [K / g, N, 2]: the kernel's layout; float, so module.to(dtype) casts it.
        scale_zero = torch.stack([weight.scale.t(), weight.zero.t()], dim=-1).to(dtype)
        self.register_buffer("scale_zero", scale_zero.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 32
    ) -> Int4Linear:
        bias = None if bias is None else bias.detach()
        return cls(Int4Weight.from_float(weight, group_size), bias, weight.dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, as float32 [N, K] (x = identity: exact sums)."""
        eye = torch.eye(self.in_features, dtype=self.scale_zero.dtype)
        return self._mm(eye, self.scale_zero).t().float()

    def _mm(self, x: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, scale_zero
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sz = self.scale_zero if self.scale_zero.dtype == x.dtype else self.scale_zero.to(x.dtype)
        y = _matmul_2d(x, lambda a: self._mm(a, sz))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4, group_size={self.group_size}"
        )


def int4_group_size(out_features: int, in_features: int, preferred: int = 32) -> int | None:
    """The group size an [N, K] weight can use (the preferred one or a larger one dividing K),
    or None when the int4 kernel cannot take it at all."""
    if out_features % INT4_N_MULTIPLE:
        return None
    for g in INT4_GROUP_SIZES:
        if g >= preferred and in_features % g == 0:
            return g
    return None


def weight_bytes(module: nn.Module) -> int:
    """Bytes of parameters and buffers, a tensor shared by two modules (tied embeddings) once."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        key = (t.untyped_storage().data_ptr(), t.data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    # Prepacked weights (layers/packed_linear.py) are neither parameters nor buffers.
    return total + sum(getattr(m, "nbytes", 0) for m in module.modules())


def validate_method(method: str) -> None:
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}"
        )


def quantize_model(
    model: nn.Module,
    method: str,
    int4_weights: dict[str, Int4Weight] | None = None,
    skip: tuple[str, ...] = (),
) -> list[str]:
    """Replace every nn.Linear of a loaded float model by its `method` counterpart, in place.

    `int4_weights` (module name -> codes) gives exact int4 weights for modules the checkpoint
    already stores as 4-bit groups (GGUF Q4_0 / Q4_1 / Q4_K): used as they are instead of being
    quantized again from the dequantized floats. Modules named in `skip`, and a Linear whose
    weight is shared with another module (a tied lm_head: quantizing it would add a copy next to
    the float embedding rather than save memory), stay float. Returns the names kept in float.
    The replaced float weights are dropped with the old modules.
    """
    validate_method(method)
    if method == "none":
        return []
    int4_weights = int4_weights or {}
    shared = {
        id(p)
        for m in model.modules()
        if not isinstance(m, nn.Linear)
        for p in m.parameters(recurse=False)
    }
    kept_float = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        if name in skip or id(module.weight) in shared:
            kept_float.append(name)
            continue
        if module.weight.device.type != "cpu":
            raise ValueError("quantized weights run on torch's CPU kernels: use --device cpu")
        bias = None if module.bias is None else module.bias.detach()
        if method == "int8":
            new = Int8Linear.from_float(module.weight, bias)
        else:
            n, k = module.weight.shape
            exact = int4_weights.get(name)
            group = exact.group_size if exact is not None else int4_group_size(n, k)
            if group is None or n % INT4_N_MULTIPLE:
                logger.warning(
                    "int4: %s [%d, %d] does not fit the kernel; kept in float", name, n, k
                )
                kept_float.append(name)
                continue
            codes = exact if exact is not None else Int4Weight.from_float(module.weight, group)
            new = Int4Linear(codes, bias, module.weight.dtype)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    return kept_float
