"""The Llama-style decoder over flattened tokens and a paged KV cache.

One implementation serves Llama and its close relatives, switched by ModelArchConfig options:
Mistral (sliding window), Qwen2/2.5 (q/k/v bias, optional sliding layers), Qwen3 (per-head q/k
RMSNorm before RoPE), Granite (embedding/residual/attention/logits multipliers) and Phi-3 (partial
rotary, sliding window). The registry maps each HF architecture name to this class.

q/k/v and gate/up projections are fused into one matmul each (qkv_proj, gate_up_proj);
load_weights takes HF parameter names and packs separate checkpoint tensors into them (Phi-3's
checkpoints already store them fused, and load as they are).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import ModelArchConfig
from pagedllm.distributed import all_reduce, gather_vocab, head_shard, tp_group, vocab_shard
from pagedllm.distributed.parallel import mlp_shard
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.layers.vocab_parallel import VocabParallelEmbedding
from pagedllm.models.fused_decoder import FusedDecoder, NotFusable


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelArchConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        backend: str,
        dtype,
    ):
        super().__init__()
        shard = head_shard(config)  # this rank's heads (all of them with one rank)
        h, kvh, d = shard.num_heads, shard.num_kv_heads, config.head_dim
        self.q_size, self.kv_size, self.head_dim = h * d, kvh * d, d
        qkv_bias = config.attention_bias or config.qkv_bias
        hidden = config.hidden_size
        self.qkv_proj = nn.Linear(hidden, (h + 2 * kvh) * d, bias=qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(h * d, hidden, bias=config.attention_bias, dtype=dtype)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb
        scale = config.attention_multiplier
        self.attn = Attention(
            h,
            d,
            d**-0.5 if scale is None else scale,
            kvh,
            backend,
            sliding_window=config.layer_sliding_window(layer_idx),
            layer_idx=layer_idx,
        )

    def forward(self, cos_sin, hidden_states, kv_cache, attn_metadata):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:  # per head: [T, heads * d] viewed as [T, heads, d]
            q = self.q_norm(q.view(q.shape[0], -1, self.head_dim)).flatten(1)
            k = self.k_norm(k.view(k.shape[0], -1, self.head_dim)).flatten(1)
        q, k = self.rotary_emb.apply(q, k, cos_sin)
        return all_reduce(self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata)))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelArchConfig, dtype):
        super().__init__()
        hidden, bias = config.hidden_size, config.mlp_bias
        _, inter = mlp_shard(config)
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=bias, dtype=dtype)
        self.act_fn = SiluAndMul()

    def forward(self, x):
        return all_reduce(self.down_proj(self.act_fn(self.gate_up_proj(x))))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelArchConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        backend: str,
        dtype,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, layer_idx, rotary_emb, backend, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, cos_sin, hidden_states, residual, kv_cache, attn_metadata):
        """The residual stream is carried apart from each block's output, so that every add
        fuses with the norm after it (RMSNorm's `residual`): (block output, residual) out."""
        if residual is None:  # the first layer: the embeddings are the residual stream
            residual, normed = hidden_states, self.input_layernorm(hidden_states)
        else:
            normed, residual = self.input_layernorm(self._scale(hidden_states), residual)
        h = self.self_attn(cos_sin, normed, kv_cache, attn_metadata)
        normed, residual = self.post_attention_layernorm(self._scale(h), residual)
        return self.mlp(normed), residual

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier


class LlamaModel(nn.Module):
    def __init__(self, config: ModelArchConfig, backend: str, dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        # One RoPE table shared by all layers (it only depends on the config).
        rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            rotary_dim=int(config.head_dim * config.partial_rotary_factor),
        )
        self.rotary_emb = rotary_emb
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary_emb, backend, dtype)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.embedding_multiplier = config.embedding_multiplier
        self.fused: FusedDecoder | None = None  # LlamaForCausalLM.fuse_decoder sets it

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        hidden_states = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            hidden_states = hidden_states * self.embedding_multiplier
        if self.fused is not None and self.fused.applies(len(input_ids), attn_metadata):
            return self.fused(hidden_states, positions, kv_caches, attn_metadata)
        cos_sin = self.rotary_emb.cos_sin(positions, hidden_states.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(
                cos_sin, hidden_states, residual, kv_cache, attn_metadata
            )
        hidden_states = self.layers[-1]._scale(hidden_states)
        return self.norm(hidden_states, residual)[0]


class LlamaForCausalLM(nn.Module):
    model_class: type[nn.Module] = LlamaModel  # the decoder stack (Gemma 3 brings its own)

    def __init__(
        self,
        config: ModelArchConfig,
        attention_backend: str = "auto",
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        if tp_group().size > 1 and self.model_class is not LlamaModel:
            raise ValueError(
                f"tensor parallelism covers Llama-style models, not {config.architecture}"
            )
        self.config = config
        self.model = self.model_class(config, attention_backend, dtype)
        _, vocab_rows = vocab_shard(config.vocab_size)  # all of it with one rank
        self.lm_head = nn.Linear(config.hidden_size, vocab_rows, bias=False, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype  # lm_head may be quantized

    def fuse_decoder(self) -> None:
        """Run decode steps' layers as one C++ call over the current weights (load, quantize
        and pack first); raises NotFusable with the reason where it cannot."""
        if type(self.model) is not LlamaModel:
            raise NotFusable(f"{type(self.model).__name__} layers")
        self.model.fused = FusedDecoder(self.model, self.config)

    def fused_shards(self) -> dict[str, tuple[str, int, int]]:
        """checkpoint module -> (our fused module, row offset, rows)."""
        c = self.config
        shard = head_shard(c)  # this rank's rows of each
        q_size = shard.num_heads * c.head_dim
        kv_size = shard.num_kv_heads * c.head_dim
        _, inter = mlp_shard(c)
        return {
            "q_proj": ("qkv_proj", 0, q_size),
            "k_proj": ("qkv_proj", q_size, kv_size),
            "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
            "gate_proj": ("gate_up_proj", 0, inter),
            "up_proj": ("gate_up_proj", inter, inter),
        }

    def group_by_module(self, weights: Mapping[str, object]) -> dict[str, list[object]]:
        """HF-named `.weight` entries -> our module name -> its parts in row order; a fused
        module appears only when every one of its parts is there (e.g. all of q, k and v)."""
        shards = self.fused_shards()
        parts: dict[str, list[tuple[int, object]]] = {}
        for name, value in weights.items():
            *prefix, module, kind = name.split(".")
            if kind != "weight":
                continue
            fused, offset, _ = shards.get(module, (module, 0, 0))
            parts.setdefault(".".join([*prefix, fused]), []).append((offset, value))
        need = Counter(fused for fused, _, _ in shards.values())  # e.g. qkv_proj: 3
        return {
            module: [v for _, v in sorted(p, key=lambda item: item[0])]
            for module, p in parts.items()
            if len(p) == need.get(module.rpartition(".")[2], 1)
        }

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids/positions [T] -> hidden_states [T, hidden] (flattened tokens, no padding)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] (e.g. each request's last token) -> [N, vocab] float32
        (None on ranks other than 0 of a tensor-parallel group: rank 0 samples)."""
        logits = gather_vocab(self.lm_head(hidden_states), self.config.vocab_size)
        if logits is None:
            return None
        logits = logits.float()
        scaling = self.config.logits_scaling
        return logits if scaling == 1.0 else logits / scaling

    def _tp_shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (distributed/parallel.py); all of it with one
        rank. Rows of q/k/v and gate/up (weights and biases), columns of o_proj and down_proj
        (whose biases rank 0 alone adds), vocabulary rows of the embedding and LM head."""
        tp = tp_group()
        if tp.size == 1:
            return tensor
        c, d = self.config, self.config.head_dim
        shard = head_shard(c)
        *_, module, kind = ["", "", *name.split(".")]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, rows = vocab_shard(c.vocab_size)
            out = tensor.new_zeros(rows, *tensor.shape[1:])  # the padding rows stay zero
            part = tensor[start : start + rows]
            out[: len(part)] = part
            return out
        inter = mlp_shard(c)
        rows = {
            "q_proj": (shard.q_start * d, shard.num_heads * d),
            "k_proj": (shard.kv_start * d, shard.num_kv_heads * d),
            "v_proj": (shard.kv_start * d, shard.num_kv_heads * d),
            "gate_proj": inter,
            "up_proj": inter,
        }
        if module in rows:
            start, n = rows[module]
            return tensor[start : start + n]
        if module in ("o_proj", "down_proj"):
            if kind == "bias":
                return tensor if tp.rank == 0 else torch.zeros_like(tensor)
            start, n = (shard.q_start * d, shard.num_heads * d) if module == "o_proj" else inter
            return tensor[:, start : start + n]
        if module in ("qkv_proj", "gate_up_proj"):  # stored fused (Phi-3): shard each part
            q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
            names, sizes = (
                (("q_proj", "k_proj", "v_proj"), (q, kv, kv))
                if module == "qkv_proj"
                else (("gate_proj", "up_proj"), (c.intermediate_size,) * 2)
            )
            parts = zip(names, tensor.split(sizes), strict=True)
            return torch.cat([self._tp_shard(f"x.{n}.{kind}", t) for n, t in parts])
        return tensor

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> None:
        """Copy HF-named tensors in, casting to the model's dtype and packing fused projections.

        Raises ValueError on an unknown name, a wrong shape, or a parameter left unloaded.
        """
        c = self.config
        shards = self.fused_shards()
        params = dict(self.named_parameters())  # the tied lm_head.weight appears once, as embed
        # (our parameter, row offset) -> the checkpoint name that fills it
        required = {}
        for pname in params:
            *prefix, module, kind = pname.split(".")
            parts = [(m, off) for m, (fused, off, _) in shards.items() if fused == module]
            for hf_module, off in parts or [(module, 0)]:
                required[pname, off] = ".".join([*prefix, hf_module, kind])
        if isinstance(weights, Mapping):
            weights = weights.items()
        loaded = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from the config
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue  # some checkpoints store the tied copy too
            tensor = self._tp_shard(name, tensor)
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in shards:
                fused, offset, rows = shards[parts[-2]]
                target = ".".join([*parts[:-2], fused, parts[-1]])
            else:
                target, offset, rows = name, 0, None
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {c.architecture}")
            param = params[target]
            expected = (rows or param.shape[0], *param.shape[1:])
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}"
                )
            with torch.no_grad():
                param[offset : offset + expected[0]].copy_(tensor)
            if rows is None:  # a whole parameter, e.g. Phi-3's stored qkv_proj: every shard
                loaded.update(key for key in required if key[0] == target)
            else:
                loaded.add((target, offset))
        missing = sorted(hf_name for key, hf_name in required.items() if key not in loaded)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {', '.join(missing)}")
