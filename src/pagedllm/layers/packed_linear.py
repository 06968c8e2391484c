"""bfloat16 linear layers on CPU with their weights prepacked once for oneDNN.

torch's plain bfloat16 F.linear on CPU reorders the weight into oneDNN's blocked layout on every
call; packing it once at load (`mkldnn._reorder_linear_weight`, what torch.compile's CPU freezing
does) and calling `mkldnn._linear_pointwise` skips that: 1.3-1.9x faster per projection on this
project's AVX-512/AMX machine at 1 to 64 rows, and the same results (docs/performance.md).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Rows the packing is tuned for (any row count works): a decode batch's size.
BATCH_HINT = 64


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # An opaque oneDNN tensor: kept as a plain attribute, not a parameter or buffer, so that
        # module.to() and state_dict() leave it alone.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        self.nbytes = weight.numel() * weight.element_size()
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed_weight, self.bias, "none", [], ""
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype == torch.bfloat16 and device.type == "cpu" and torch.backends.mkldnn.is_available()


def pack_linear_weights(model: nn.Module, pack_shared: bool = True) -> int:
    """Replace every bfloat16 nn.Linear of `model` (on CPU) by a PackedLinear, in place. A Linear
    whose weight another module shares (a tied lm_head) gets a packed copy, the embedding keeping
    the original, unless `pack_shared` is False (it then stays as it is). Returns the bytes
    added by such copies."""
    shared = {
        id(p)
        for m in model.modules()
        if not isinstance(m, nn.Linear)
        for p in m.parameters(recurse=False)
    }
    added = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or module.weight.dtype != torch.bfloat16:
            continue
        if id(module.weight) in shared and not pack_shared:
            continue
        new = PackedLinear(module.weight, module.bias)
        if id(module.weight) in shared:
            added += new.nbytes
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    return added
