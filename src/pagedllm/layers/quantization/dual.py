"""Both formats of a checkpoint's quantized weight (`--quantization auto`, the default on CPU):
the GGUF's int4 / int8 codes for steps of a few rows, and the same weights in the model's dtype
for steps of more.

A step of a few rows (one stream's decode) is bound by reading the weights: int4 codes are an
eighth of float32's bytes and a quarter of bfloat16's. A step of many rows is bound by
arithmetic, where oneDNN's prepacked bfloat16 GEMMs beat the codes kernel, which expands the
codes for every tile of weight rows. Both copies hold the same numbers, the float one being the
codes dequantized (then rounded to the dtype); the paths differ in the order of their sums.
Keeping both costs the codes' bytes on top of the float model's (logged at load;
`--quantization none` or `int4` keeps one format).

With `fixed_order` (--deterministic, the float32 default) the layer keeps the codes alone: the
kernels' fixed-order product multiplies them about as fast as the float weights up to 64 rows
and at 0.85x at 256 in float32 (`cpu_microbench.py --fixed-order`, docs/performance.md), and
with one path a row's result does not depend on how many rows the step has
(docs/determinism.md).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm import kernels
from pagedllm.layers.quantization.base import LinearMethodBase
from pagedllm.layers.quantization.int_linear import _BlockQuantMethod
from pagedllm.layers.quantization.unquantized import float_bytes_read, float_linear, pack

# Up to this many rows the codes are multiplied; above, the float weight. bfloat16: not measured
# on a machine with oneDNN's bf16 path yet; from that machine's figures of the codes kernel and
# of oneDNN's prepacked GEMMs, about 8. float32: where MKL on the float copy overtook the codes
# kernels before they took the fixed order (docs/performance.md).
MAX_CODE_ROWS = {torch.float32: 48, torch.bfloat16: 8}


def max_code_rows(dtype: torch.dtype) -> int:
    return MAX_CODE_ROWS.get(dtype, 8)


class DualLinearMethod(LinearMethodBase):
    """The codes as `codes`'s method holds them (`weight`, `weight_scale`[, `weight_min`]) and,
    but in fixed order (`codes_only`), the float weight as `dense_weight` (a tied LM head's: the
    embedding's own tensor), or after loading, in bfloat16 on CPU, as `packed_weight` for
    oneDNN."""

    takes_codes = True

    def __init__(self, codes: _BlockQuantMethod, prepack: bool, tied: bool = False):
        self.codes_method, self.prepack, self.tied = codes, prepack, tied
        # fixed order: the codes alone, at every row count
        self.fixed_order = self.codes_only = codes.fixed_order

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        self.codes_method.create_weights(layer, dtype)
        self.dtype, self.max_code_rows = dtype, max_code_rows(dtype)
        if not self.tied and not self.codes_only:
            rows, cols = layer.output_size_per_partition, layer.input_size_per_partition
            layer.register_buffer("dense_weight", torch.empty(rows, cols, dtype=dtype))

    def tie(self, layer: nn.Module, embedding_weight: torch.Tensor) -> None:
        """A tied LM head's float weight is the embedding's (a plain attribute, not counted
        twice); its codes are its own, loaded from the embedding's checkpoint tensor."""
        if not self.codes_only:
            layer.dense_weight = embedding_weight.detach()

    def load_weight(self, layer: nn.Module, loaded, row: int) -> None:
        self.codes_method.load_weight(layer, loaded, row)
        if self.tied or self.codes_only:
            return
        rows = slice(row, row + loaded.shape[0])
        if kernels.available():  # the same numbers as dequantize's, 10x sooner
            codes = [t[rows] for t in self.codes(layer)]
            dequantize = getattr(kernels.cpu_ops(), f"int{self.codes_method.bits}_dequantize")
            dequantize(layer.dense_weight[rows], *codes)
        else:
            layer.dense_weight[rows] = self.codes_method.dequantize(layer, rows).to(self.dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.prepack:
            return
        layer.packed_weight = pack(layer.dense_weight)
        layer.nbytes = layer.dense_weight.nbytes
        del layer.dense_weight

    def codes(self, layer: nn.Module) -> tuple[torch.Tensor, ...]:
        return self.codes_method.codes(layer)

    def nbytes(self, layer: nn.Module) -> int:
        """The codes' bytes (the float copy is counted with the float weights)."""
        return self.codes_method.nbytes(layer)

    def bytes_read(self, layer: nn.Module, num_rows: int) -> int:
        if self.codes_only or num_rows <= self.max_code_rows:
            return self.nbytes(layer)
        return float_bytes_read(layer, getattr(layer, "dense_weight", None))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.codes_only:
            return self.codes_method.apply(layer, x, bias)
        x2d = x.reshape(-1, layer.input_size_per_partition)
        if x2d.shape[0] <= self.max_code_rows and kernels.fused_cpu_ops_apply(x):
            y = getattr(kernels.cpu_ops(), f"int{self.codes_method.bits}_linear")(
                x2d.contiguous(), *self.codes(layer)
            )
            if bias is not None:
                y = y + bias.to(y.dtype)
        else:
            y = float_linear(x2d, layer, getattr(layer, "dense_weight", None), bias)
        return y.view(*x.shape[:-1], layer.output_size_per_partition)
