"""What every weight_loader shares: slicing a checkpoint tensor (or a GGUF's codes), checking its
shape, copying it in; and what the loaded weights take in memory."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.quantization.codes import QuantWeight


def narrow(loaded: torch.Tensor | QuantWeight, dim: int, start: int, length: int):
    """Rows (dim 0) or columns (dim 1) of a float tensor or of codes."""
    if start == 0 and length == loaded.shape[dim]:
        return loaded
    return loaded.narrow(dim, start, length)


def check_shape(loaded: torch.Tensor | QuantWeight, expected: tuple[int, ...]) -> None:
    """A checkpoint tensor's shape is the whole layer's (tensor parallelism slices it after)."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(expected)}")


def default_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
) -> None:
    """A parameter held whole by every rank (norms): copied in, rounded to its dtype."""
    check_shape(loaded, param.shape)
    param.data.copy_(loaded)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of parameters and buffers, a tensor shared by two modules (tied embeddings) once,
    and of prepacked weights, which are neither (their modules report `nbytes`)."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        key = (t.untyped_storage().data_ptr(), t.data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total + sum(getattr(m, "nbytes", 0) for m in module.modules())
