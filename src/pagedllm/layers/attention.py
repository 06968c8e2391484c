from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.selector import AttentionBackend, get_attention_backend


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends over the whole context."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int | None = None,
        backend: str | AttentionBackend = "auto",
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        layer_idx: int = 0,
    ):
        """`sliding_window`: HF semantics, a query at p sees keys at positions > p - window.
        `logits_soft_cap`: scores -> cap * tanh(scores / cap) (Gemma 2 style).
        `layer_idx`: the model's layer number, which picks this layer's KV cache group."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.layer_idx = layer_idx
        self.backend = get_attention_backend(backend) if isinstance(backend, str) else backend

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [T, H * d], key/value [T, kv_heads * d] -> [T, H * d]; `sinks` [H]: each head's
        attention sink logit (gpt-oss)."""
        num_tokens = query.shape[0]
        attn_metadata = attn_metadata.for_layer(self.layer_idx)
        k_cache, v_cache = kv_cache
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        self.backend.write_kv_cache(key, value, k_cache, v_cache, attn_metadata.slot_mapping)
        if k_cache.dtype != key.dtype:
            # A cache of another dtype or quantized: every read goes through the cache, so a
            # prompt sees the same K/V whether it was computed now or found in the prefix cache.
            key = value = None
        out = self.backend.forward(
            query.view(num_tokens, self.num_heads, self.head_dim),
            k_cache,
            v_cache,
            attn_metadata,
            self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            key=key,
            value=value,
            **({} if sinks is None else {"sinks": sinks}),
        )
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"backend={self.backend.name}, sliding_window={self.sliding_window}"
        )
