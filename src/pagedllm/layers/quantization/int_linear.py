"""Weight-only int8 / int4 linear layers for CPU: the weights stay quantized in memory, in ggml's
blocks of 32 input channels (codes.py), and activations stay in the model's float dtype.

int4: w = q * scale + min, q in 0..15, a float16 scale and min per group of 32 input channels.
int8: w = q * scale, q in -127..127, a float16 scale per group (ggml's Q8_0).

pagedllm's C++ kernels (kernels/csrc/quant_linear.cpp) multiply the activations by the codes up
to MAX_GEMV_ROWS rows (decode: bound by reading the weights); for more (prefill, big batches)
the layer expands its weight and runs a float GEMM. With `fixed_order` (--deterministic, the
float32 default) they take every row count in float32, in the fixed order of linear_tiles.h
(faster than MKL on the expanded weight up to 64 rows, 0.7x at 256: `cpu_microbench.py
--fixed-order`), so a row's result does not depend on the batch; bfloat16 x against int4 codes
on a CPU with AVX512-BF16 takes the kernel's bf16 dot products at every row count instead
(their own fixed order, faster). Without the kernels, the weight is expanded by torch on every
call (slow, but the same numbers).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import kernels
from pagedllm.layers.quantization.base import LinearMethodBase
from pagedllm.layers.quantization.codes import (
    BLOCK,
    Int4Weight,
    Int8Weight,
    QuantWeight,
    unpack_int4,
)

# Up to this many rows the kernels multiply the codes directly; above, expand and run a GEMM.
# Measured on this project's 2-core AVX-512 machine (docs/performance.md).
MAX_GEMV_ROWS = 16
# Rows of a float weight quantized at a time (rows quantize on their own).
_QUANTIZE_ROWS = 4096
# dtype -> a buffer for expanded weights, per thread (engines stepped on two threads must not
# share it); see _BlockQuantMethod.weight_as.
_SCRATCH = threading.local()


def _with_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.to(y.dtype)


class _BlockQuantMethod(LinearMethodBase):
    """The layer holds `weight` (the codes, a parameter), `weight_scale` (and for int4
    `weight_min`), float16 buffers [rows, columns / 32], all zeros until loaded: the padding
    rows of a vocabulary shard stay zero weights."""

    bits: int
    codes_cls: type[QuantWeight]

    def __init__(self, takes_codes: bool = False, tied: bool = False, fixed_order: bool = False):
        """takes_codes: the checkpoint's own codes are loaded as they are. tied: the layer is a
        tied LM head, whose float weight is the embedding's (no float bytes of its own).
        fixed_order: batch invariant (see the module's docstring)."""
        self.takes_codes, self.tied, self.fixed_order = takes_codes, tied, fixed_order

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        rows, cols = layer.output_size_per_partition, layer.input_size_per_partition
        codes = torch.zeros(rows, cols * self.bits // 8, dtype=self._code_dtype)
        layer.weight = nn.Parameter(codes, requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        for name in self._scale_names:
            layer.register_buffer(name, torch.zeros(rows, cols // BLOCK, dtype=torch.float16))
        self.dtype = dtype  # float slices round to it before quantizing, as the float model's

    def load_weight(self, layer: nn.Module, loaded: torch.Tensor | QuantWeight, row: int) -> None:
        if isinstance(loaded, torch.Tensor):
            # Rows at a time: quantizing takes a few float32 copies of what it is given.
            for start in range(0, loaded.shape[0], _QUANTIZE_ROWS):
                part = loaded[start : start + _QUANTIZE_ROWS].to(self.dtype)
                self._write(layer, self.codes_cls.from_float(part), row + start)
            return
        if not isinstance(loaded, self.codes_cls):
            raise ValueError(f"has {type(loaded).__name__} codes, not int{self.bits}")
        self._write(layer, loaded, row)

    def _write(self, layer: nn.Module, loaded: QuantWeight, row: int) -> None:
        rows = slice(row, row + loaded.shape[0])
        layer.weight.data[rows] = self._packed(loaded)
        layer.weight_scale[rows] = loaded.scale.to(torch.float16)
        if self.bits == 4:
            layer.weight_min[rows] = loaded.min.to(torch.float16)

    def codes(self, layer: nn.Module) -> tuple[torch.Tensor, ...]:
        """The kernels' arguments after x (or out): codes, scales[, mins]."""
        return (layer.weight, *(getattr(layer, name) for name in self._scale_names))

    def nbytes(self, layer: nn.Module) -> int:
        return sum(t.nbytes for t in self.codes(layer))

    def float_bytes(self, layer: nn.Module) -> int:
        """What the weight took in the model's dtype (a tied head's: nothing of its own)."""
        numel = layer.output_size_per_partition * layer.input_size_per_partition
        return 0 if self.tied else numel * self.dtype.itemsize

    def bytes_read(self, layer: nn.Module, num_rows: int) -> int:
        """The codes; above MAX_GEMV_ROWS also the expanded weight, written then read (but in
        fixed order, which multiplies the codes at every row count)."""
        numel = layer.output_size_per_partition * layer.input_size_per_partition
        whole = num_rows > MAX_GEMV_ROWS and not self.fixed_order
        expanded = 2 * numel * self.dtype.itemsize if whole else 0
        return self.nbytes(layer) + expanded

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2d = x.reshape(-1, layer.input_size_per_partition)
        if self.fixed_order and kernels.fixed_order(x):
            if self._takes_bf16(x2d):  # AVX512-BF16 dot products, invariant in their own order
                y = self._codes_product(layer, x2d, bias)
            else:  # the bias added before rounding
                y = kernels.in_float32(lambda x32: self._codes_product(layer, x32, bias), x2d)
        elif x2d.shape[0] <= MAX_GEMV_ROWS and kernels.fused_cpu_ops_apply(x):
            y = self._codes_product(layer, x2d, bias)
        else:
            y = _with_bias(F.linear(x2d, self.weight_as(layer, x.dtype)), bias)
        return y.view(*x.shape[:-1], layer.output_size_per_partition)

    def _takes_bf16(self, x2d: torch.Tensor) -> bool:
        """Whether the codes kernel multiplies this bfloat16 x as it is (the fused decoder's
        Linear takes the same choice)."""
        return (
            self.bits == 4
            and x2d.dtype == torch.bfloat16
            and kernels.cpu_ops().int4_takes_bf16(x2d.shape[1])
        )

    def _codes_product(self, layer: nn.Module, x2d: torch.Tensor, bias) -> torch.Tensor:
        kernel = getattr(kernels.cpu_ops(), f"int{self.bits}_linear")
        return _with_bias(kernel(x2d.contiguous(), *self.codes(layer)), bias)

    def weight_as(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [N, K] in `dtype`. With the kernels it is expanded into a scratch
        buffer shared by all layers (valid until the next layer's call): a fresh tensor of
        megabytes per call costs its page faults again each time."""
        if not kernels.available():
            return self.dequantize(layer).to(dtype)
        rows, cols = layer.output_size_per_partition, layer.input_size_per_partition
        buffers = _SCRATCH.__dict__
        scratch = buffers.get(dtype)
        if scratch is None or scratch.numel() < rows * cols:
            scratch = buffers[dtype] = torch.empty(rows * cols, dtype=dtype)
        out = scratch[: rows * cols].view(rows, cols)
        getattr(kernels.cpu_ops(), f"int{self.bits}_dequantize")(out, *self.codes(layer))
        return out

    def dequantize(self, layer: nn.Module, rows: slice = slice(None)) -> torch.Tensor:
        """float32 [N, K] (or those rows), rounded as the kernels round (one fused multiply-add
        for int4)."""
        raise NotImplementedError


class Int8LinearMethod(_BlockQuantMethod):
    bits, codes_cls = 8, Int8Weight
    _code_dtype, _scale_names = torch.int8, ("weight_scale",)

    def _packed(self, codes: Int8Weight) -> torch.Tensor:
        return codes.q

    def dequantize(self, layer: nn.Module, rows: slice = slice(None)) -> torch.Tensor:
        scale = layer.weight_scale[rows].float().repeat_interleave(BLOCK, dim=1)
        return layer.weight[rows].float() * scale


class Int4LinearMethod(_BlockQuantMethod):
    bits, codes_cls = 4, Int4Weight
    _code_dtype, _scale_names = torch.uint8, ("weight_scale", "weight_min")

    def _packed(self, codes: Int4Weight) -> torch.Tensor:
        return codes.packed  # two codes a byte, in ggml's order

    def dequantize(self, layer: nn.Module, rows: slice = slice(None)) -> torch.Tensor:
        return torch.addcmul(
            layer.weight_min[rows].float().repeat_interleave(BLOCK, dim=1),
            unpack_int4(layer.weight[rows]).float(),
            layer.weight_scale[rows].float().repeat_interleave(BLOCK, dim=1),
        )
