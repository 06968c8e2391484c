"""A Gated DeltaNet layer (the linear attention of Qwen3-Next and Qwen3.5) over flattened tokens,
each sequence's state in a slot of a state pool instead of a paged KV cache.

Per sequence and value head, the layer keeps S [key dim, value dim] whatever the length (and,
like Mamba-2, its convolution's last kernel - 1 inputs). For each token, with q and k
L2-normalised (q also scaled by key dim ** -0.5), g <= 0 the token's log decay and beta in
(0, 1) its write strength:

    S = exp(g) * S        delta = beta * (v - S^T k)        S = S + k delta^T        o = S^T q

(the delta rule: S moves its prediction for k towards v). o is normalised per head and gated by
silu(z) (RMSNormGated), then projected out, as transformers' Qwen3NextGatedDeltaNet computes.

Decode rows (one token of a sequence) update their states in place (in C++: kernels/csrc/
mamba_state.cpp, two passes over each state; delta_rule_step is its reference); a prompt chunk
is computed CHUNK tokens at a time (chunked_delta_rule: within a chunk the deltas solve one unit
lower triangular system), checked against the token-by-token recurrence (delta_rule_reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import kernels
from pagedllm.config import ModelArchConfig
from pagedllm.distributed import tp_group
from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.recurrent import Conv1d, RecurrentState, causal_conv, reset_fresh, single_rows

CHUNK = 64  # tokens solved at once: a [heads, CHUNK, CHUNK] triangular system


class HeadRMSNormGated(nn.Module):
    """RMSNorm of each head's output (weight [head_dim]), times silu(z) in float32."""

    def __init__(self, head_dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(head_dim, dtype=dtype), False)
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o, z [T, heads, head_dim]."""
        dtype = o.dtype
        x = o.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x.to(dtype) * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """Parameters as Qwen3.5's checkpoints name them, in_proj_qkv / in_proj_z and in_proj_b /
    in_proj_a packed as in_proj_qkvz and in_proj_ba (Qwen3-Next's checkpoints interleave them
    head group by head group: the model's split_weight takes them apart)."""

    def __init__(
        self,
        config: ModelArchConfig,
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ):
        super().__init__()
        if tp_group().size > 1:
            raise ValueError("tensor parallelism over Gated DeltaNet layers is not supported yet")
        hidden = config.hidden_size
        self.num_k_heads, self.num_v_heads = (
            config.linear_num_key_heads,
            config.linear_num_value_heads,
        )
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads {self.num_v_heads} must be a multiple of "
                f"linear_num_key_heads {self.num_k_heads}"
            )
        self.tiled = config.linear_value_heads_tiled
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz = MergedColumnParallelLinear(
            hidden, [self.conv_dim, self.value_dim], False, dtype, quant_config,
            f"{prefix}.in_proj_qkvz",
        )  # fmt: skip
        self.in_proj_ba = MergedColumnParallelLinear(
            hidden, [self.num_v_heads] * 2, False, dtype, quant_config, f"{prefix}.in_proj_ba"
        )
        self.conv1d = Conv1d(self.conv_dim, config.linear_conv_kernel_dim, False, dtype)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype), False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype), False)
        self.norm = HeadRMSNormGated(self.head_v_dim, config.rms_norm_eps, dtype)
        self.out_proj = RowParallelLinear(
            self.value_dim, hidden, False, dtype, quant_config, f"{prefix}.out_proj"
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
        T = hidden_states.shape[0]
        qkv, z = self.in_proj_qkvz(hidden_states).split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(hidden_states).split([self.num_v_heads] * 2, dim=-1)
        reset_fresh(state, slots, fresh)
        qkv = causal_conv(qkv, self.conv1d, state, slots, query_start_loc)
        q, k, v = qkv.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (self._per_value_head(_l2norm(t.view(T, self.num_k_heads, -1))) for t in (q, k))
        q = q * self.head_k_dim**-0.5
        v = v.view(T, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        o = torch.empty_like(v)
        singles, rows = single_rows(query_start_loc)
        if singles and kernels.fused_cpu_ops_apply(v):  # decode: each state read once, in C++
            idx = torch.tensor([slots[i] for i in singles])
            o_rows = torch.empty_like(v[rows])
            kernels.cpu_ops().delta_rule_state_update(
                state.ssm, idx, q[rows], k[rows], v[rows], g[rows].contiguous(),
                beta[rows].contiguous(), o_rows,
            )  # fmt: skip
            o[rows] = o_rows
        elif singles:  # each state stepped where it lies (MiBs a sequence: no gathered copy)
            for i, row in zip(singles, rows, strict=True):
                part = slice(row, row + 1)
                o[part] = delta_rule_step(
                    q[part], k[part], v[part], g[part], beta[part], state.ssm[slots[i]][None]
                )
        for i, slot in enumerate(slots):
            start, end = query_start_loc[i], query_start_loc[i + 1]
            if end - start == 1:
                continue
            part = slice(start, end)
            o[part], s = chunked_delta_rule(
                q[part], k[part], v[part], g[part], beta[part], state.ssm[slot]
            )
            state.ssm[slot].copy_(s)
        z = z.view(T, self.num_v_heads, self.head_v_dim)
        o = self.norm(o.to(hidden_states.dtype), z)
        return self.out_proj(o.view(T, self.value_dim))

    def _per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        """[T, key heads, d] -> [T, value heads, d]: each value head's key head."""
        r = self.num_v_heads // self.num_k_heads
        if r == 1:
            return x
        return x.repeat(1, r, 1) if self.tiled else x.repeat_interleave(r, dim=1)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_step(q, k, v, g, beta, s) -> torch.Tensor:
    """One token of B sequences, float32: q / k [B, heads, dk], v [B, heads, dv], g / beta [B,
    heads], s [B, heads, dk, dv] updated in place -> o [B, heads, dv]."""
    s.mul_(g.exp()[..., None, None])
    delta = beta[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, s))
    s.add_(k[..., :, None] * delta[..., None, :])
    return torch.einsum("bhk,bhkv->bhv", q, s)


def chunked_delta_rule(q, k, v, g, beta, s, chunk: int = CHUNK):
    """One sequence, float32: q / k [L, heads, dk], v [L, heads, dv], g / beta [L, heads], s
    [heads, dk, dv] at the start -> (o [L, heads, dv], s at the end).

    Within a chunk, with c_t the running sum of g from the chunk's start (decays exp(c_t - c_s)
    <= 1 for s <= t) and s0 the state before it, each token's delta is
        delta_t = beta_t (v_t - exp(c_t) s0^T k_t - sum_{s<t} exp(c_t - c_s) (k_t . k_s) delta_s)
    a unit lower triangular system (I + A) delta = beta v - beta exp(c) K s0, solved once for
    both right-hand sides, so that delta = u - w s0 whatever s0 is. Then
        o_t = exp(c_t) s0^T q_t + sum_{s<=t} exp(c_t - c_s) (q_t . k_s) delta_s
        s   = exp(c_C) s0 + sum_s exp(c_C - c_s) k_s delta_s^T."""
    L, dv = v.shape[0], v.shape[-1]
    pad = -L % chunk  # zero tokens at the end: no write (beta 0), no decay (g 0)
    q, k, v, g, beta = (_pad(t, pad) for t in (q, k, v, g, beta))
    n = q.shape[0] // chunk
    # [heads, chunks, C, ...]
    q, k, v = (t.view(n, chunk, *t.shape[1:]).permute(2, 0, 1, 3) for t in (q, k, v))
    g, beta = (t.view(n, chunk, -1).permute(2, 0, 1) for t in (g, beta))
    c = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    a = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    system = a + torch.eye(chunk, dtype=a.dtype, device=a.device)
    rhs = beta[..., None] * torch.cat([v, c.exp()[..., None] * k], dim=-1)
    uw = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = uw.split([dv, k.shape[-1]], dim=-1)
    attn = (q @ k.transpose(-1, -2)) * decay  # [heads, chunks, t, s]
    q_decayed = c.exp()[..., None] * q
    k_to_end = (c[..., -1:] - c).exp()[..., None] * k
    out = torch.empty_like(u)
    for i in range(n):
        delta = u[:, i] - w[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + attn[:, i] @ delta
        s = c[:, i, -1].exp()[:, None, None] * s + k_to_end[:, i].transpose(-1, -2) @ delta
    return out.permute(1, 2, 0, 3).reshape(n * chunk, -1, dv)[:L], s


def _pad(t: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def delta_rule_reference(q, k, v, g, beta, s):
    """chunked_delta_rule's oracle: the recurrence token by token."""
    s = s.clone()
    out = [delta_rule_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1],
                           beta[t : t + 1], s[None])[0] for t in range(q.shape[0])]  # fmt: skip
    return torch.stack(out), s
