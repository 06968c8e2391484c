"""Float weights in the model's dtype; on CPU, bfloat16 ones prepacked once for oneDNN.

torch's plain bfloat16 F.linear on CPU reorders the weight into oneDNN's blocked layout on every
call; packing it once after loading (`mkldnn._reorder_linear_weight`, what torch.compile's CPU
freezing does) and calling `mkldnn._linear_pointwise` skips that: 1.3-1.9x faster per projection
on this project's AVX-512/AMX machine at 1 to 64 rows, and the same results
(docs/performance.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import kernels
from pagedllm.cpu_info import cpu_flags
from pagedllm.layers.quantization.base import LinearMethodBase

# Rows the packing is tuned for (any row count works): a decode batch's size.
BATCH_HINT = 64
# What oneDNN's bfloat16 reorder needs of the CPU (it refuses to pack without).
_ONEDNN_BF16 = ({"avx_ne_convert"}, {"avx512bw", "avx512vl", "avx512dq"})


def pack(weight: torch.Tensor) -> torch.Tensor:
    """An opaque oneDNN tensor, neither a parameter nor a buffer: module.to() and state_dict()
    leave it alone (weight_bytes counts the module's `nbytes`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)


def float_linear(
    x: torch.Tensor, layer: nn.Module, weight: torch.Tensor | None, bias, fixed_order: bool = False
):
    """x times a float weight: the layer's oneDNN-packed copy when it has one; with
    `fixed_order` (--deterministic) on CPU, the kernels' fixed-order product in float32 (a row's
    result whatever the batch); else F.linear."""
    packed = getattr(layer, "packed_weight", None)
    if packed is None:
        if fixed_order and kernels.fixed_order(x) and weight.dtype == x.dtype:
            dense = kernels.cpu_ops().dense_linear
            return kernels.in_float32(lambda x32: dense(x32.contiguous(), weight, bias), x)
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    bucket = padded_rows(rows)
    if bucket != rows:
        x = F.pad(x, (0, 0, 0, bucket - rows))
    out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return out if bucket == rows else out[:rows]


def padded_rows(rows: int) -> int:
    """The row count a packed GEMM runs at (the input padded with zero rows): exact up to 16,
    then one of 8 counts per doubling, at most 1/8 more rows. oneDNN caches a primitive (its
    JIT-compiled kernels) per shape it has seen: with every row count a step can have, that
    cache grew the process by hundreds of MiB under load (docs/reliability.md); 72 shapes cover
    steps of up to 2048 rows."""
    step = 1 << max(0, rows.bit_length() - 4)
    return -(-rows // step) * step


def float_bytes_read(layer: nn.Module, weight: torch.Tensor | None) -> int:
    return layer.nbytes if hasattr(layer, "packed_weight") else weight.nbytes


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        dtype == torch.bfloat16
        and device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and any(need <= cpu_flags() for need in _ONEDNN_BF16)
    )


class UnquantizedLinearMethod(LinearMethodBase):
    def __init__(self, prepack: bool = False, fixed_order: bool = False):
        """prepack: replace the weight by a oneDNN-packed copy after loading (bfloat16 on CPU);
        a weight another module shares (a tied LM head's) stays there, the copy is the head's.
        fixed_order: batch invariant (float_linear)."""
        self.prepack, self.fixed_order = prepack, fixed_order

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        rows, cols = layer.output_size_per_partition, layer.input_size_per_partition
        layer.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader

    def load_weight(self, layer: nn.Module, loaded: torch.Tensor, row: int) -> None:
        layer.weight.data[row : row + loaded.shape[0]].copy_(loaded)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.prepack:
            return
        layer.packed_weight = pack(layer.weight)
        layer.nbytes = layer.weight.nbytes
        del layer.weight

    def bytes_read(self, layer: nn.Module, num_rows: int) -> int:
        return float_bytes_read(layer, getattr(layer, "weight", None))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return float_linear(x, layer, getattr(layer, "weight", None), bias, self.fixed_order)
