from __future__ import annotations

import functools

import torch
from torch import nn

from pagedllm import kernels
from pagedllm.layers.weight_utils import check_shape


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, like HF's LlamaRMSNorm.

    With `residual`, x + residual is normalised and returned too (the decoder's residual
    stream), as vLLM's fused_add_rms_norm. On CPU both run as one C++ call (pagedllm.kernels)
    that rounds where this torch code rounds."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        dtype: torch.dtype | None = None,
        weight_offset: float = 0.0,
    ):
        """weight_offset: added to the checkpoint's weight as it loads (Qwen3-Next stores its
        norms' weights as offsets from 1 and applies 1 + w, in float32 before rounding)."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        if weight_offset:
            self.weight.weight_loader = functools.partial(_load_offset, offset=weight_offset)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if kernels.fused_cpu_ops_apply(x):
            x2d = x.reshape(-1, x.shape[-1])
            out = torch.empty_like(x2d)
            if residual is None:
                kernels.cpu_ops().rms_norm(out, x2d.contiguous(), self.weight, None, self.eps)
                return out.view(x.shape)
            # residual becomes x + residual, in place: it is the caller's own running sum.
            kernels.cpu_ops().rms_norm(out, x2d.contiguous(), self.weight, residual, self.eps)
            return out.view(x.shape), residual
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _load_offset(param: nn.Parameter, loaded: torch.Tensor, shard_id=None, *, offset: float):
    check_shape(loaded, tuple(param.shape))
    param.data.copy_(loaded.float() + offset)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 and applied as (1 + w), all in
    float32 before casting back (Llama casts before the weight), as HF's Gemma3RMSNorm does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
