"""BERT-style encoders (sentence-transformers' MiniLM, BGE, ...) for the pooling runner.

An encoder's every token attends to the whole prompt, both ways, so a request's prompt runs
in one step (the engine turns chunked prefill and prefix caching off for it) and attention is
computed within each request from this step's q, k and v alone: nothing is read from or written
to the paged KV cache. Post-norm layers (LayerNorm after each residual add), learned absolute
positions, token type 0 for every token, exact GELU. The checkpoint's names are kept (HF's
BertModel, with or without a "bert." prefix); its pooler and pre-training heads are not used."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn
from torch.nn import functional as F

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import ModelArchConfig
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.quantization import QuantizationConfig, QuantWeight
from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding
from pagedllm.models.fused_decoder import NotFusable
from pagedllm.models.utils import load_weights

# Checkpoint tensors an encoder for embeddings does not use
_UNUSED = ("pooler.", "cls.", "embeddings.position_ids")


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelArchConfig, dtype: torch.dtype):
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, h, dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])


class BertSelfAttention(nn.Module):
    def __init__(self, config, dtype, quant_config, prefix: str):
        super().__init__()
        heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, heads, heads, True, dtype, quant_config,
            f"{prefix}.qkv_proj",
        )  # fmt: skip
        self.num_heads = self.qkv_proj.head_shard.num_heads  # this rank's
        self.q_size = self.num_heads * self.head_dim

    def forward(self, x: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size] * 3, dim=-1)
        out = torch.empty_like(q)
        starts = attn_metadata.query_start_loc_cpu
        for start, end in zip(starts[:-1], starts[1:], strict=True):  # one request each
            if end == start:
                continue
            q_i, k_i, v_i = (t[start:end].view(end - start, self.num_heads, self.head_dim)
                             .transpose(0, 1) for t in (q, k, v))  # fmt: skip
            o = F.scaled_dot_product_attention(q_i, k_i, v_i)  # bidirectional
            out[start:end] = o.transpose(0, 1).reshape(end - start, self.q_size)
        return out


class BertLayer(nn.Module):
    def __init__(self, config, dtype, quant_config, prefix: str):
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.attention = nn.Module()
        self.attention.self = BertSelfAttention(config, dtype, quant_config,
                                                f"{prefix}.attention.self")  # fmt: skip
        self.attention.output = nn.Module()
        self.attention.output.dense = RowParallelLinear(
            h, h, True, dtype, quant_config, f"{prefix}.attention.output.dense"
        )
        self.attention.output.LayerNorm = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.intermediate = nn.Module()
        self.intermediate.dense = ColumnParallelLinear(
            h, config.intermediate_size, True, dtype, quant_config, f"{prefix}.intermediate.dense"
        )
        self.output = nn.Module()
        self.output.dense = RowParallelLinear(
            config.intermediate_size, h, True, dtype, quant_config, f"{prefix}.output.dense"
        )
        self.output.LayerNorm = nn.LayerNorm(h, eps=eps, dtype=dtype)

    def forward(self, x: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        attn = self.attention.output.dense(self.attention.self(x, attn_metadata))
        x = self.attention.output.LayerNorm(attn + x)
        y = self.output.dense(F.gelu(self.intermediate.dense(x)))
        return self.output.LayerNorm(y + x)


class BertModel(nn.Module):
    """input_ids / positions [T] -> the last layer's hidden states [T, hidden]."""

    packed_modules_mapping = {"qkv_proj": ["query", "key", "value"]}

    def __init__(
        self,
        config: ModelArchConfig,
        attention_backend: str = "auto",
        dtype: torch.dtype = torch.float32,
        quant_config: QuantizationConfig | None = None,
    ):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config, dtype)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(
            BertLayer(config, dtype, quant_config, f"encoder.layer.{i}")
            for i in range(config.num_hidden_layers)
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.LayerNorm.weight.dtype

    def fused_decoder(self):
        raise NotFusable("an encoder (no decode steps)")

    def forward(self, input_ids, positions, kv_caches, attn_metadata: AttentionMetadata):
        x = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            x = layer(x, attn_metadata)
        return x

    def compute_logits(self, hidden_states: torch.Tensor) -> None:
        return None  # an encoder has no LM head: it only pools

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        codes: Mapping[str, QuantWeight] | None = None,
    ) -> None:
        load_weights(self, _encoder_weights(weights), codes)


def _encoder_weights(weights) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint's encoder tensors under BertModel's names (a "bert." prefix dropped), the
    others skipped, read one at a time."""
    items = ((n, lambda n=n: weights[n]) for n in weights) if isinstance(weights, Mapping) else (
        (n, lambda t=t: t) for n, t in weights)  # fmt: skip
    for name, read in items:
        name = name.removeprefix("bert.")
        if not name.startswith(_UNUSED):
            yield name, read()
