"""A GGUF's int4 / int6 / int8 codes multiplied in integers with 8-bit activations (the default
for a quantized GGUF on CPU, `--dtype auto`), as llama.cpp does.

Each call quantizes its input per row and block of 32 columns (Q8_0's rule), multiplies the
codes in int32 and applies the block scales in one fixed order per output
(kernels/csrc/int8_act.h): a row's result does not depend on the rest of the batch, on the
variant the CPU runs (AVX512-VNNI, AVX-VNNI, AVX2 or the plain reference) or on the row count.
The codes are written at load straight into the kernels' layout (tiles of 16 output rows, 4 bytes
a row at a time: a permutation of the file's bytes) and nothing else is kept: no float copy, nothing
prepared per batch shape.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm import kernels
from pagedllm.layers.quantization.base import LinearMethodBase
from pagedllm.layers.quantization.codes import (
    BLOCK,
    Int4Weight,
    Int8Weight,
    Int8xWeight,
    QuantWeight,
)

TILE = 16  # output rows interleaved in the kernels' layout


def _tiles(rows: int) -> int:
    return -(-rows // TILE)


# int6 holds int8x's numbers (Int8xWeight) whose codes fit in -32..31 (Q6_K, Q5_K, Q5_1, and
# int4's codes beside them) in 6 bits; int8x keeps 8 (a layer that mixes them with int8's).
KINDS = {"int4": Int4Weight, "int6": Int8xWeight, "int8": Int8Weight, "int8x": Int8xWeight}
BITS = {"int4": 4, "int6": 6, "int8": 8, "int8x": 8}


def int6_codes(chunks: torch.Tensor) -> torch.Tensor:
    """int8_act_int6_words' inverse, on bytes: uint8 [..., 6 chunks, 4] -> int16 codes [..., 32]
    in -32..31 (u = q + 32: its low 4 bits in chunks 0-3 as int4's, its high 2 in chunks 4-5,
    kernels/csrc/int8_act.h)."""
    nibbles, pairs = chunks[..., :4, :], chunks[..., 4:, :].repeat_interleave(2, dim=-2)
    at = torch.tensor([0, 4, 0, 4], dtype=torch.uint8)[:, None]  # chunk j's pairs: bits 4 (j % 2)
    lo = (nibbles & 15) | ((pairs >> at) & 3) << 4  # codes 4j + i
    hi = (nibbles >> 4) | ((pairs >> (at + 2)) & 3) << 4  # codes 16 + 4j + i
    codes = torch.cat([lo.flatten(-2), hi.flatten(-2)], dim=-1)
    return codes.to(torch.int16) - 32


def _words(codes: QuantWeight, kind: str) -> torch.Tensor:
    """int32 [N, K / 32, chunks]: each row's codes as the kernels read them, 4 bytes (one word)
    at a time (int4: a Q4 block's 16 bytes as they are; int8 and int8x: the codes + 128; int6:
    int8_act_int6_words). Moved as words, the layout's strided copy is a quarter of the elements."""
    if kind == "int4":
        chunks = codes.packed.reshape(codes.shape[0], -1, 4, 4)
    elif kind == "int6":
        return kernels.cpu_ops().int8_act_int6_words(codes.q)
    else:
        chunks = (codes.q.view(torch.uint8) ^ 128).reshape(codes.shape[0], -1, 8, 4)
    return chunks.view(torch.int32).squeeze(-1)


class Int8ActLinearMethod(LinearMethodBase):
    """The layer holds `int8_act_codes`, `int8_act_scales`[, `int8_act_mins`] in the kernels'
    layout, each checkpoint slice written into its rows as it arrives (no other copy; the
    padding rows of the last tile are zeros); `weight` is an empty placeholder for the loader."""

    takes_codes = True
    fixed_order = True  # batch invariant by construction

    def __init__(self, kind: str, variant: str = ""):
        """kind: the layer's codes, "int4", "int6", "int8" or "int8x" (config.code_layer_kinds);
        variant: the kernel to run ('' for the fastest this CPU has; tests name others)."""
        self.kind, self.codes_cls, self.variant = kind, KINDS[kind], variant
        self.bits = BITS[kind]
        self.halves = 2 if self.codes_cls is Int8xWeight else 1  # scales per block

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        rows, cols = layer.output_size_per_partition, layer.input_size_per_partition
        tiles, blocks, chunks = _tiles(rows), cols // BLOCK, self.bits
        codes = torch.empty(tiles, blocks, chunks, TILE, 4, dtype=torch.uint8)
        codes[-1].zero_()  # the last tile's padding rows: zero scales, zero weights
        layer.register_buffer("int8_act_codes", codes)
        scales = torch.zeros(tiles, blocks * self.halves, TILE, dtype=torch.float16)
        layer.register_buffer("int8_act_scales", scales)
        if self.kind != "int8":
            mins = torch.zeros(tiles, blocks, TILE, dtype=torch.float16)
            layer.register_buffer("int8_act_mins", mins)
        layer.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader

    def load_weight(self, layer: nn.Module, loaded: torch.Tensor | QuantWeight, row: int) -> None:
        if isinstance(loaded, torch.Tensor):  # a tied head's padding rows, or float weights
            bits = {"bits": self.bits} if self.codes_cls is Int8xWeight else {}  # int6: 6 bits
            loaded = self.codes_cls.from_float(loaded.float(), **bits)
        if self.codes_cls is Int8xWeight:  # a part of another kind in a layer that mixes them
            loaded = Int8xWeight.of(loaded)
        if not isinstance(loaded, self.codes_cls):
            raise ValueError(f"has {type(loaded).__name__} codes, not {self.kind}")
        words = _words(loaded, self.kind)
        parts = [(layer.int8_act_codes.view(torch.int32).squeeze(-1).permute(0, 3, 1, 2), words)]
        parts.append((layer.int8_act_scales.transpose(1, 2), loaded.scale))
        if self.kind != "int8":
            parts.append((layer.int8_act_mins.transpose(1, 2), loaded.min))
        # [tiles, 16 rows, ...] views: whole tiles as slices (one strided copy), the rest by row
        end, first = row + loaded.shape[0], -(-row // TILE)
        whole = max(0, end // TILE - first)
        for dst, src in parts:
            src = src.to(dst.dtype)
            at = first * TILE - row
            if whole:
                part = src[at : at + whole * TILE]
                dst[first : first + whole].copy_(part.reshape(whole, TILE, *part.shape[1:]))
            # rows before the first whole tile and after the last (ends of a partial tile; a
            # part within one tile is all "before")
            head_end = min(end, first * TILE)
            tail = max(head_end, (first + whole) * TILE)
            index = torch.cat([torch.arange(row, head_end), torch.arange(tail, max(tail, end))])
            if len(index):
                dst[index // TILE, index % TILE] = src[index - row]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if "weight" in layer._parameters:
            del layer.weight
        mins = getattr(layer, "int8_act_mins", None)
        if self.halves == 2 and mins is not None and not mins.any():  # Q6_K: the kernels skip 0s
            del layer.int8_act_mins

    def codes(self, layer: nn.Module) -> tuple[torch.Tensor, ...]:
        """The kernel's arguments after x: codes, scales, mins (None for int8, and for int8x and
        int6 whose mins are all 0). int8x's and int6's scales are [tiles, blocks * 2, 16]: each
        block's two halves in turn."""
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
