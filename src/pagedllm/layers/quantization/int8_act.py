"""A GGUF's int4 / int8 codes multiplied in integers with 8-bit activations (the default for a
quantized GGUF on CPU, `--dtype auto`), as llama.cpp does.

Each call quantizes its input per row and block of 32 columns (Q8_0's rule), multiplies the
codes in int32 and applies the block scales in one fixed order per output
(kernels/csrc/int8_act.h): a row's result does not depend on the rest of the batch, on the
variant the CPU runs (AVX512-VNNI, AVX2 or the plain reference) or on the row count. The codes
are repacked once at load into the kernels' layout (tiles of 16 output rows, 4 bytes a row at a
time: a permutation of the file's bytes) and nothing else is kept: no float copy, nothing
prepared per batch shape.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm import kernels
from pagedllm.layers.quantization.base import LinearMethodBase
from pagedllm.layers.quantization.codes import BLOCK, QuantWeight
from pagedllm.layers.quantization.int_linear import _BlockQuantMethod

TILE = 16  # output rows interleaved in the kernels' layout


def _tiles(rows: int) -> int:
    return -(-rows // TILE)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def repack_int4(packed: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor):
    """ggml-ordered int4 codes [N, K / 2] (byte i of a block: code i low, i + 16 high), float16
    scales and mins [N, K / 32] -> the kernels' (codes, scales, mins)."""
    n, half = packed.shape
    tiles, blocks = _tiles(n), half // (BLOCK // 2)
    codes = _pad_rows(packed, tiles * TILE).reshape(tiles, TILE, blocks, 4, 4)
    return (
        codes.permute(0, 2, 3, 1, 4).contiguous().reshape(-1),
        _pad_rows(scale, tiles * TILE).reshape(tiles, TILE, blocks).transpose(1, 2).contiguous(),
        _pad_rows(mn, tiles * TILE).reshape(tiles, TILE, blocks).transpose(1, 2).contiguous(),
    )


def repack_int8(q: torch.Tensor, scale: torch.Tensor):
    """int8 codes [N, K] and float16 scales [N, K / 32] -> the kernels' (codes + 128, scales)."""
    n, k = q.shape
    tiles, blocks = _tiles(n), k // BLOCK
    biased = _pad_rows(q, tiles * TILE).view(torch.uint8) ^ 128
    codes = biased.reshape(tiles, TILE, blocks, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    return (
        codes.reshape(-1),
        _pad_rows(scale, tiles * TILE).reshape(tiles, TILE, blocks).transpose(1, 2).contiguous(),
    )


class Int8ActLinearMethod(LinearMethodBase):
    """Loads the checkpoint's codes as `codes`'s method does (`weight`, `weight_scale`[,
    `weight_min`]), then holds them repacked as `int8_act_codes`, `int8_act_scales`[,
    `int8_act_mins`]."""

    takes_codes = True
    fixed_order = True  # batch invariant by construction

    def __init__(self, codes: _BlockQuantMethod, variant: str = ""):
        """variant: the kernel to run ('' for the fastest this CPU has; tests name others)."""
        self.codes_method, self.bits, self.variant = codes, codes.bits, variant

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        self.codes_method.create_weights(layer, dtype)

    def load_weight(self, layer: nn.Module, loaded: torch.Tensor | QuantWeight, row: int) -> None:
        self.codes_method.load_weight(layer, loaded, row)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if hasattr(layer, "int8_act_codes"):
            return
        if self.bits == 4:
            packed = repack_int4(layer.weight.data, layer.weight_scale, layer.weight_min)
            del layer.weight_min
        else:
            packed = repack_int8(layer.weight.data, layer.weight_scale)
        del layer.weight, layer.weight_scale
        names = ("int8_act_codes", "int8_act_scales", "int8_act_mins")[: len(packed)]
        for name, t in zip(names, packed, strict=True):
            layer.register_buffer(name, t)

    def codes(self, layer: nn.Module) -> tuple[torch.Tensor, ...]:
        """The kernel's arguments after x: codes, scales, mins (None for int8)."""
        mins = getattr(layer, "int8_act_mins", None)
        return layer.int8_act_codes, layer.int8_act_scales, mins

    def nbytes(self, layer: nn.Module) -> int:
        return sum(t.nbytes for t in self.codes(layer) if t is not None)

    def bytes_read(self, layer: nn.Module, num_rows: int) -> int:
        return self.nbytes(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2d = x.reshape(-1, layer.input_size_per_partition)
        y = kernels.cpu_ops().int8_act_linear(
            x2d, *self.codes(layer), self.bits, layer.output_size_per_partition, self.variant
        )
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.view(*x.shape[:-1], layer.output_size_per_partition)
