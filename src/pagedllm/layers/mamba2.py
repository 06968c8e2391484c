"""A Mamba-2 mixer (Granite 4.0-H's recurrent layers) over flattened tokens, each sequence's
recurrent state in a slot of a state pool instead of a paged KV cache.

Per sequence, a Mamba-2 layer keeps a fixed-size state whatever its length: the last
`conv_kernel - 1` inputs of its causal depthwise convolution, and the SSM state h [heads,
head_dim, state_size]. For each token t (x_t its heads' inputs, B_t / C_t its group's input and
output projections, dt_t > 0 per head):

    h = exp(dt_t * A) * h + dt_t * x_t (outer) B_t        y_t = h . C_t + D * x_t

then y is gated by silu(z) and normalised per group (RMSNormGated), as transformers' Mamba-2
layers compute it. A sequence's first step starts from zero state; a later step (the next chunk
of its prompt, a decode step) from its slot, which every step updates in place.

Decode rows (one token of a sequence) are updated together; a prompt chunk is scanned CHUNK
tokens at a time in float32 (ssd_scan: the recurrence unrolled within a chunk, as Mamba-2's
state space duality computes it), checked against the token-by-token recurrence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import kernels
from pagedllm.config import ModelArchConfig
from pagedllm.distributed import tp_group
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.recurrent import Conv1d, RecurrentState, causal_conv, reset_fresh, single_rows


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over groups of `group_size` channels, in float32."""

    def __init__(self, size: int, group_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), False)
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        y = y.float() * F.silu(z.float())
        groups = y.view(*y.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * groups.view(y.shape).to(dtype)


class MambaMixer2(nn.Module):
    """Checkpoint names as transformers' (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj)."""

    def __init__(
        self,
        config: ModelArchConfig,
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ):
        super().__init__()
        if tp_group().size > 1:
            raise ValueError("tensor parallelism over Mamba-2 layers is not supported yet")
        hidden, bias = config.hidden_size, config.mamba_proj_bias
        self.num_heads, self.head_dim = config.mamba_n_heads, config.mamba_d_head
        self.n_groups, self.state_size = config.mamba_n_groups, config.mamba_d_state
        self.inner = config.mamba_expand * hidden
        if self.num_heads * self.head_dim != self.inner:
            raise ValueError(
                f"mamba_n_heads {self.num_heads} x mamba_d_head {self.head_dim} must equal "
                f"mamba_expand x hidden_size ({self.inner})"
            )
        self.conv_dim = self.inner + 2 * self.n_groups * self.state_size
        self.kernel = config.mamba_d_conv
        self.time_step_limit = config.mamba_time_step_limit
        self.in_proj = ColumnParallelLinear(
            hidden, self.inner + self.conv_dim + self.num_heads, bias, dtype, quant_config,
            f"{prefix}.in_proj",
        )  # fmt: skip
        self.conv1d = Conv1d(self.conv_dim, self.kernel, config.mamba_conv_bias, dtype)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), False)
        self.D = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), False)
        self.norm = GatedRMSNorm(
            self.inner, self.inner // self.n_groups, config.rms_norm_eps, dtype
        )
        self.out_proj = RowParallelLinear(
            self.inner, hidden, bias, dtype, quant_config, f"{prefix}.out_proj"
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        state: RecurrentState,
        slots: list[int],
        query_start_loc: list[int],
        fresh: list[bool],
    ) -> torch.Tensor:
        """hidden_states [T, hidden]: the step's tokens, sequence after sequence (sequence i's
        rows query_start_loc[i]..[i + 1], its state in slot slots[i], which starts from zero
        where fresh[i])."""
        proj = self.in_proj(hidden_states)
        z, xbc, dt = proj.split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        reset_fresh(state, slots, fresh)
        xbc = causal_conv(xbc, self.conv1d, state, slots, query_start_loc)
        x, b, c = xbc.split(
            [self.inner, self.n_groups * self.state_size, self.n_groups * self.state_size], dim=-1
        )
        dt = F.softplus(dt.float() + self.dt_bias.float())
        lo, hi = self.time_step_limit
        if lo > 0.0 or hi != float("inf"):
            dt = dt.clamp(lo, hi)
        y = self._scan(x, b, c, dt, state, slots, query_start_loc)
        return self.out_proj(self.norm(y.to(hidden_states.dtype), z))

    def _scan(self, x, b, c, dt, state: RecurrentState, slots, query_start_loc) -> torch.Tensor:
        """The selective scan in float32; y [T, inner]. Single-token rows (decode) update their
        states together; a prompt chunk is scanned in chunks of CHUNK tokens (ssd_scan)."""
        heads, group = self.num_heads, self.num_heads // self.n_groups
        x = x.float().view(-1, heads, self.head_dim)
        b = b.float().view(-1, self.n_groups, self.state_size).repeat_interleave(group, dim=1)
        c = c.float().view(-1, self.n_groups, self.state_size).repeat_interleave(group, dim=1)
        a = -torch.exp(self.A_log.float())
        d = self.D.float()[:, None]
        y = torch.empty_like(x)
        singles, rows = single_rows(query_start_loc)
        if singles and kernels.fused_cpu_ops_apply(x):  # one pass over each state, in C++
            idx = torch.tensor([slots[i] for i in singles])
            y_rows = torch.empty_like(x[rows])
            kernels.cpu_ops().mamba_state_update(
                state.ssm, idx, x[rows], dt[rows].contiguous(), a.contiguous(), b[rows],
                c[rows], y_rows,
            )  # fmt: skip
            y[rows] = y_rows + d * x[rows]
        elif singles:  # each state updated where it lies (h is MiBs a sequence: no gathered copy)
            decay = torch.exp(dt[rows] * a)  # [B, heads]
            dtx = (dt[rows][:, :, None] * x[rows])[..., None]  # [B, heads, head_dim, 1]
            for j, i in enumerate(singles):
                h = state.ssm[slots[i]]  # [heads, head_dim, state]
                h.mul_(decay[j][:, None, None]).baddbmm_(dtx[j], b[rows[j]][:, None, :])
                y[rows[j]] = torch.bmm(h, c[rows[j]][:, :, None])[..., 0]
            y[rows] += d * x[rows]
        for i, slot in enumerate(slots):
            start, end = query_start_loc[i], query_start_loc[i + 1]
            if end - start == 1:
                continue
            part = slice(start, end)
            y[part], h = ssd_scan(x[part], b[part], c[part], dt[part], a, state.ssm[slot])
            y[part] += d * x[part]
            state.ssm[slot].copy_(h)
        return y.view(-1, self.inner)


CHUNK = 64  # tokens scanned at once: a [CHUNK, CHUNK, heads] decay matrix


def ssd_scan(x, b, c, dt, a, h, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's scan (without D's skip), float32: x [L, heads, head_dim], b / c [L,
    heads, state], dt [L, heads], a [heads], h [heads, head_dim, state] at the start -> (y
    [L, heads, head_dim], h at the end). Chunk by chunk, the recurrence unrolled: within a
    chunk, h_t = exp(cum_t) h_0 + sum_{s <= t} exp(cum_t - cum_s) dt_s x_s (outer) b_s with
    cum the running sum of dt * a (so every factor is at most 1), y_t = h_t . c_t."""
    ys = []
    for start in range(0, x.shape[0], chunk):
        xs, bs, cs, dts = (t[start : start + chunk] for t in (x, b, c, dt))
        cum = (dts * a).cumsum(0)  # [q, heads], decreasing
        seg = cum[:, None, :] - cum[None, :, :]  # [t, s, heads]: log decay from s to t
        causal = torch.ones(seg.shape[:2], dtype=torch.bool, device=x.device).tril()
        decay = torch.exp(seg.masked_fill(~causal[..., None], float("-inf")))
        scores = torch.einsum("thn,shn->tsh", cs, bs) * decay  # [t, s, heads]
        y = torch.einsum("tsh,shp->thp", scores, dts[..., None] * xs)
        y += torch.einsum("thn,hpn->thp", cs, h) * torch.exp(cum)[..., None]
        ys.append(y)
        to_end = torch.exp(cum[-1] - cum) * dts  # [s, heads]
        h = h * torch.exp(cum[-1])[:, None, None] + torch.einsum("sh,shp,shn->hpn", to_end, xs, bs)
    return torch.cat(ys), h


def ssm_scan_reference(x, b, c, dt, a, h) -> tuple[torch.Tensor, torch.Tensor]:
    """ssd_scan's oracle: the recurrence token by token."""
    ys = []
    for t in range(x.shape[0]):
        h = (
            h * torch.exp(dt[t] * a)[:, None, None]
            + (dt[t][:, None] * x[t])[..., None] * b[t][:, None, :]
        )
        ys.append((h * c[t][:, None, :]).sum(-1))
    return torch.stack(ys), h
