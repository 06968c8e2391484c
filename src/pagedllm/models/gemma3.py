"""Gemma 3 (text) over flattened tokens and a paged KV cache.

What differs from Llama:
  - embeddings scaled by sqrt(hidden_size) (the scale cast to the weights' dtype first, as HF);
  - Gemma RMSNorm (weight applied as 1 + w, in float32), four norms per layer (before and after
    attention and the MLP), and q_norm / k_norm on each head before RoPE;
  - a GELU-tanh gated MLP; attention scaled by query_pre_attn_scalar ** -0.5;
  - interleaved layers: sliding-window ones use RoPE with rope_local_base_freq, full-attention ones
    rope_theta (and rope_scaling);
  - optional tanh soft-capping of attention scores and of the final logits (released Gemma 3
    configs leave attn_logit_softcapping null, and HF's Gemma3 ignores it; we apply it when set,
    as Gemma 2 does).
Checkpoint names, the packed q/k/v and gate/up layers and the tensor-parallel split are
Llama's, so loading is shared.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.config import ModelArchConfig
from pagedllm.distributed import gather_vocab
from pagedllm.layers.activation import GeluTanhAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import GemmaRMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding
from pagedllm.models.llama import LlamaForCausalLM


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_idx: int, backend: str, dtype, quant_config,
                 prefix: str):  # fmt: skip
        super().__init__()
        d = self.head_dim = config.head_dim
        bias = config.attention_bias
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, config.num_attention_heads, config.num_key_value_heads, bias,
            dtype, quant_config, f"{prefix}.qkv_proj",
        )  # fmt: skip
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * d, config.hidden_size, bias, dtype, quant_config,
            f"{prefix}.o_proj", input_shard=self.qkv_proj.output_columns,
        )  # fmt: skip
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps, dtype)
        scalar = config.query_pre_attn_scalar or d
        heads = self.qkv_proj.head_shard  # this rank's
        self.attn = Attention(
            heads.num_heads,
            d,
            scalar**-0.5,
            heads.num_kv_heads,
            backend,
            sliding_window=config.layer_sliding_window(layer_idx),
            logits_soft_cap=config.attn_logit_softcapping,
            layer_idx=layer_idx,
        )

    def forward(self, rotary_emb, cos_sin, hidden_states, kv_cache, attn_metadata):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = hidden_states.shape[0]
        q = self.q_norm(q.view(num_tokens, -1, self.head_dim)).view(num_tokens, self.q_size)
        k = self.k_norm(k.view(num_tokens, -1, self.head_dim)).view(num_tokens, self.kv_size)
        q, k = rotary_emb.apply(q, k, cos_sin)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class Gemma3MLP(nn.Module):
    def __init__(self, config: ModelArchConfig, dtype, quant_config, prefix: str):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inter, inter], False, dtype, quant_config, f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            inter, hidden, False, dtype, quant_config, f"{prefix}.down_proj"
        )
        self.act_fn = GeluTanhAndMul()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_idx: int, backend: str, dtype, quant_config,
                 prefix: str):  # fmt: skip
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_sliding = config.layer_sliding_window(layer_idx) is not None
        self.self_attn = Gemma3Attention(
            config, layer_idx, backend, dtype, quant_config, f"{prefix}.self_attn"
        )
        self.mlp = Gemma3MLP(config, dtype, quant_config, f"{prefix}.mlp")
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(self, rotary_emb, cos_sin, hidden_states, kv_cache, attn_metadata):
        h = self.self_attn(
            rotary_emb, cos_sin, self.input_layernorm(hidden_states), kv_cache, attn_metadata
        )
        hidden_states = hidden_states + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(h)


class Gemma3Model(nn.Module):
    def __init__(
        self,
        config: ModelArchConfig,
        backend: str,
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str = "model",
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        # In the weights' dtype (bfloat16 rounds it, as in HF), from a float32 scalar.
        scale = torch.tensor(config.hidden_size**0.5).to(dtype)
        self.register_buffer("embed_scale", scale, persistent=False)
        d, max_pos = config.head_dim, config.max_position_embeddings
        # Two RoPE tables: full-attention layers use rope_theta (+ scaling), sliding ones the
        # local base without scaling.
        self.rotary_emb_global = RotaryEmbedding(
            d, max_pos, config.rope_theta, config.rope_scaling, dtype=dtype
        )
        local_base = config.rope_local_base_freq or config.rope_theta
        self.rotary_emb_local = RotaryEmbedding(d, max_pos, local_base, dtype=dtype)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, backend, dtype, quant_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        hidden_states = self.embed_tokens(input_ids)
        hidden_states = hidden_states * self.embed_scale.to(hidden_states.dtype)
        ropes = {
            sliding: (rope, rope.cos_sin(positions, hidden_states.dtype))
            for sliding, rope in ((False, self.rotary_emb_global), (True, self.rotary_emb_local))
        }
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            rope, cos_sin = ropes[layer.is_sliding]
            hidden_states = layer(rope, cos_sin, hidden_states, kv_cache, attn_metadata)
        return self.norm(hidden_states)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Llama's wrapper (HF parameter names, packed layers, tied embeddings) around Gemma 3's
    decoder, with its final-logit soft-capping."""

    model_class = Gemma3Model

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] -> [N, vocab] float32, soft-capped if the config says so
        (None on ranks other than 0)."""
        logits = gather_vocab(self.lm_head(hidden_states), self.config.vocab_size)
        if logits is None:
            return None
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
