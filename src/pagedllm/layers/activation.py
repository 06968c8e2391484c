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


class ClampedSwiGLU(nn.Module):
    """gpt-oss's gated activation on a fused gate_up output [..., 2 * intermediate]:
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), with g = min(gate, limit)."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
