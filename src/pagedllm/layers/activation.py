from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import kernels


class SiluAndMul(nn.Module):
    """silu(gate) * up on the output of a fused gate_up projection [..., 2 * intermediate].
    On CPU one C++ call (pagedllm.kernels) that rounds where this torch code rounds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous() and kernels.fused_cpu_ops_apply(x):
            out = x.new_empty(x.shape[0], x.shape[1] // 2)
            kernels.cpu_ops().silu_and_mul(out, x)
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up on a fused gate_up output (Gemma's "gelu_pytorch_tanh")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
