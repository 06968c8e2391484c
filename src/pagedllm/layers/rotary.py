"""Rotary position embedding (RoPE) applied to flattened tokens by their position ids.

Uses HF's rotate_half layout (first half / second half of head_dim, not interleaved pairs),
because checkpoints are in HF layout. cos/sin are computed once, in float32, for every
position, then cast to the activations' dtype per call, exactly as HF does. With a `rotary_dim`
below head_dim (partial rotary, e.g. Phi-4-mini), only each head's first rotary_dim dims rotate.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm import kernels
from pagedllm.config.model_arch import rope_type


def compute_inv_freq(
    head_dim: int, base: float, rope_scaling: dict | None, max_position_embeddings: int
) -> tuple[torch.Tensor, int]:
    """Inverse frequencies [head_dim // 2] and the number of positions to cache."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    kind = rope_type(rope_scaling)
    if kind == "default":
        return inv_freq, max_position_embeddings
    if kind == "yarn":
        return yarn_inv_freq(head_dim, base, rope_scaling, max_position_embeddings)
    factor = float(rope_scaling["factor"])
    if kind == "linear":
        # Positions are divided by factor, i.e. the context is stretched factor times.
        return inv_freq / factor, int(max_position_embeddings * factor)
    if kind == "dynamic":
        # NTK-aware base, fixed at the longest supported context (as vLLM does). HF instead
        # recomputes it per forward from the batch's longest position, which a KV cache cannot
        # follow; the two agree only in the limit.
        max_len = int(max_position_embeddings * factor)
        base = base * (factor * max_len / max_position_embeddings - (factor - 1)) ** (
            head_dim / (head_dim - 2)
        )
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, max_len
    # llama3: same formula as HF's _compute_llama3_parameters.
    low_freq_factor = float(rope_scaling["low_freq_factor"])
    high_freq_factor = float(rope_scaling["high_freq_factor"])
    old_context_len = rope_scaling.get("original_max_position_embeddings", max_position_embeddings)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama), max_position_embeddings


def yarn_inv_freq(
    head_dim: int, base: float, rope_scaling: dict, max_position_embeddings: int
) -> tuple[torch.Tensor, int]:
    """YaRN (transformers' _compute_yarn_parameters): the dims that turn fewer than beta_slow
    times over the original context are interpolated (divided by factor), those turning more
    than beta_fast times keep their frequency, a linear ramp between."""
    factor = rope_scaling.get("factor")
    original = rope_scaling.get("original_max_position_embeddings", max_position_embeddings)
    factor = float(factor if factor is not None else max_position_embeddings / original)
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, max_position_embeddings


def rope_attention_factor(rope_scaling: dict | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (0.1 ln(factor) + 1, or its
    mscale form), 1 for the other types."""
    if rope_type(rope_scaling) != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = float(rope_scaling.get("factor") or 1.0)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, m) / mscale(factor, m_all)
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        base: float = 10000.0,
        rope_scaling: dict | None = None,
        rotary_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        with torch.device("cpu"):  # the same float32 tables whatever device the model is on
            inv_freq, max_len = compute_inv_freq(
                self.rotary_dim, base, rope_scaling, max_position_embeddings
            )
            freqs = torch.outer(torch.arange(max_len, dtype=torch.float), inv_freq)  # [P, d/2]
            # The fused CPU kernel's float32 tables: plain attributes, which module.to() keeps.
            self.cos_f32, self.sin_f32 = freqs.cos(), freqs.sin()
            attention_factor = rope_attention_factor(rope_scaling)
            if attention_factor != 1.0:  # in float32 before any rounding, as transformers does
                self.cos_f32, self.sin_f32 = (
                    self.cos_f32 * attention_factor,
                    self.sin_f32 * attention_factor,
                )
        # Non-persistent: derived from the config, never part of a checkpoint. In the model's
        # dtype: HF casts cos/sin to the activations' dtype as well, and so does cos_sin.
        device = torch.get_default_device()
        for name, table in (("cos_cache", self.cos_f32), ("sin_cache", self.sin_f32)):
            self.register_buffer(name, table.to(device, dtype), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; query/key [T, n_heads * head_dim] or [T, n_heads, head_dim]."""
        return self.apply(query, key, self.cos_sin(positions, query.dtype))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """(cos, sin, positions): the [T, 1, d/2] cos and sin of `positions`, gathered once a
        step for all layers; (None, None, positions) where the fused CPU kernel rotates."""
        if kernels.fused_cpu_ops_apply(positions):
            return None, None, positions
        cos = self.cos_cache[positions].to(dtype)[:, None, :]
        sin = self.sin_cache[positions].to(dtype)[:, None, :]
        return cos, sin, positions

    def apply(self, query: torch.Tensor, key: torch.Tensor, cos_sin):
        cos, sin, positions = cos_sin
        if cos is None:
            return self._rotate_fused(query, positions), self._rotate_fused(key, positions)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate_fused(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """In place, in one C++ call, which rounds cos/sin to x's dtype first as torch's path
        does (the buffers in the model's dtype hold those very values)."""
        x2d = x.view(x.shape[0], -1)
        kernels.cpu_ops().rotary_embedding(
            x2d, positions, self.cos_f32, self.sin_f32, self.head_dim, self.rotary_dim
        )
        return x

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_dim)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        # == x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), element for element.
        parts = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
        return torch.cat(parts + (rest,) if rest.shape[-1] else parts, dim=-1).view(shape)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
            f"max_positions={self.cos_cache.shape[0]}"
        )
