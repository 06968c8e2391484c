"""What a hybrid model's recurrent layers (Mamba-2: layers/mamba2.py; Gated DeltaNet:
layers/gated_deltanet.py) share: a sequence's state in a slot of a state pool, and the causal
depthwise convolution in front of the recurrence, which continues from each sequence's last
kernel - 1 inputs (its conv state)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class RecurrentState:
    """One layer's state pool: conv [slots, conv_dim, kernel - 1] (the model's dtype) and ssm
    [slots, ...] (the recurrence's state, float32)."""

    conv: torch.Tensor
    ssm: torch.Tensor


class Conv1d(nn.Module):
    """The depthwise convolution's parameters, named as nn.Conv1d's ([channels, 1, kernel])."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype), False)
        self.bias = nn.Parameter(torch.empty(channels, dtype=dtype), False) if bias else None


def single_rows(query_start_loc: list[int]) -> tuple[list[int], list[int]]:
    """(the sequences with one row this step, their rows)."""
    singles = [i for i in range(len(query_start_loc) - 1)
               if query_start_loc[i + 1] - query_start_loc[i] == 1]  # fmt: skip
    return singles, [query_start_loc[i] for i in singles]


def reset_fresh(state: RecurrentState, slots: list[int], fresh: list[bool]) -> None:
    """A sequence's first step starts from zero state."""
    for slot, new in zip(slots, fresh, strict=True):
        if new:
            state.conv[slot].zero_()
            state.ssm[slot].zero_()


def causal_conv(
    x: torch.Tensor, conv: Conv1d, state: RecurrentState, slots: list[int],
    query_start_loc: list[int],
) -> torch.Tensor:  # fmt: skip
    """silu(causal depthwise conv1d) of x [T, channels], each sequence continuing from its conv
    state, which is left holding its last kernel - 1 inputs. Single-token rows together."""
    weight, bias = conv.weight, conv.bias
    keep = weight.shape[-1] - 1
    out = torch.empty_like(x)
    singles, rows = single_rows(query_start_loc)
    if singles:  # [B, channels, kernel]: the state then the new input
        idx = torch.tensor([slots[i] for i in singles], device=x.device)
        seq = torch.cat([state.conv[idx], x[rows, :, None].to(state.conv.dtype)], dim=2)
        y = (seq.to(weight.dtype) * weight[:, 0]).sum(-1)
        out[rows] = F.silu(y if bias is None else y + bias).to(out.dtype)
        state.conv.index_copy_(0, idx, seq[:, :, 1:])
    for i, slot in enumerate(slots):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if end - start == 1:
            continue
        seq = torch.cat([state.conv[slot], x[start:end].T.to(state.conv.dtype)], dim=1)
        y = F.conv1d(seq[None].to(weight.dtype), weight, bias, groups=weight.shape[0])[0]
        out[start:end] = F.silu(y).T.to(out.dtype)
        state.conv[slot].copy_(seq[:, seq.shape[1] - keep :])
    return out
