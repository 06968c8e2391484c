"""The Llama-style decoder over flattened tokens and a paged KV cache.

One implementation serves Llama and its close relatives, switched by ModelArchConfig options:
Mistral (sliding window), Qwen2/2.5 (q/k/v bias, optional sliding layers), Qwen3 (per-head q/k
RMSNorm before RoPE), Granite (embedding/residual/attention/logits multipliers), Phi-3 (partial
rotary, sliding window), Qwen3-MoE, Mixtral and gpt-oss (a mixture of experts for the MLP:
layers/moe.py), and Granite 4.0-H (Mamba-2 layers among the attention layers:
layers/mamba2.py). The registry maps each HF architecture name to this class.

q/k/v and gate/up projections are one matmul each (qkv_proj, gate_up_proj: the checkpoint's
separate tensors are their parts, packed_modules_mapping; Phi-3's checkpoints store them fused
already). The layers split themselves across a tensor-parallel group (layers/linear.py).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import ModelArchConfig
from pagedllm.distributed import gather_vocab
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.gated_deltanet import GatedDeltaNet
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.mamba2 import MambaMixer2
from pagedllm.layers.moe import SparseMoeBlock
from pagedllm.layers.quantization import QuantizationConfig, QuantWeight
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.weight_utils import check_shape
from pagedllm.models.fused_decoder import FusedDecoder, NotFusable
from pagedllm.models.utils import load_weights


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelArchConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        backend: str,
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ):
        super().__init__()
        d = self.head_dim = config.head_dim
        # Qwen3-Next's gated attention: q_proj gives each head's query and then its output gate,
        # taken as twice the query heads (one rank: hybrid models refuse more).
        self.gated = config.attn_output_gate
        q_heads = config.num_attention_heads * (2 if self.gated else 1)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, q_heads, config.num_key_value_heads,
            config.attention_bias or config.qkv_bias, dtype, quant_config, f"{prefix}.qkv_proj",
        )  # fmt: skip
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        start, columns = self.qkv_proj.output_columns
        if self.gated:
            start, columns = start // 2, columns // 2
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * d, config.hidden_size, config.attention_bias, dtype,
            quant_config, f"{prefix}.o_proj", input_shard=(start, columns),
        )  # fmt: skip
        if config.qk_norm:
            offset = config.norm_weight_offset
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype, offset)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype, offset)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb if config.use_rope else None  # Granite 4.0-H: none
        scale = config.attention_multiplier
        heads = self.qkv_proj.head_shard  # this rank's
        self.attn = Attention(
            heads.num_heads // (2 if self.gated else 1),
            d,
            d**-0.5 if scale is None else scale,
            heads.num_kv_heads,
            backend,
            sliding_window=config.layer_sliding_window(layer_idx),
            layer_idx=layer_idx,
        )
        self.sinks = None
        if config.attention_sinks:  # this rank's heads' sinks, kept in float32
            if self.attn.backend.name == "triton":
                raise ValueError(
                    "attention sinks (gpt-oss) are not in the triton attention backend: use "
                    "--attention-backend sdpa"
                )
            self.sinks = nn.Parameter(torch.empty(heads.num_heads), requires_grad=False)
            self.sinks.weight_loader = functools.partial(
                _load_heads, start=heads.q_start, total=config.num_attention_heads
            )

    def forward(self, cos_sin, hidden_states, kv_cache, attn_metadata):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.gated:  # [T, heads, (query, gate), d]
            q, gate = q.view(q.shape[0], -1, 2, self.head_dim).unbind(2)
            q, gate = q.flatten(1), gate.flatten(1)
        if self.q_norm is not None:  # per head: [T, heads * d] viewed as [T, heads, d]
            q = self.q_norm(q.view(q.shape[0], -1, self.head_dim)).flatten(1)
            k = self.k_norm(k.view(k.shape[0], -1, self.head_dim)).flatten(1)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb.apply(q, k, cos_sin)
        out = self.attn(q, k, v, kv_cache, attn_metadata, sinks=self.sinks)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


def _load_heads(param: nn.Parameter, loaded: torch.Tensor, shard_id=None, *, start, total):
    """A per-head parameter's rows of this rank's query heads."""
    check_shape(loaded, (total,))
    param.data.copy_(loaded[start : start + param.shape[0]])


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelArchConfig, dtype, quant_config, prefix: str):
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inter, inter], bias, dtype, quant_config, f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            inter, hidden, bias, dtype, quant_config, f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelArchConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        backend: str,
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ):
        super().__init__()
        offset = config.norm_weight_offset
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, offset)
        # A hybrid model's recurrent layers: its kv_cache is its state pool.
        if config.layer_types and config.layer_types[layer_idx] == "mamba":
            self.mamba = MambaMixer2(config, dtype, quant_config, f"{prefix}.mamba")
        elif config.layer_types and config.layer_types[layer_idx] == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, dtype, quant_config, f"{prefix}.linear_attn")
        else:
            self.self_attn = LlamaAttention(
                config, layer_idx, rotary_emb, backend, dtype, quant_config, f"{prefix}.self_attn"
            )
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, offset
        )
        mlp = SparseMoeBlock if config.is_moe_layer(layer_idx) else LlamaMLP
        self.mlp = mlp(config, dtype, quant_config, f"{prefix}.mlp")
        self.residual_multiplier = config.residual_multiplier

    def forward(self, cos_sin, hidden_states, residual, kv_cache, attn_metadata):
        """The residual stream is carried apart from each block's output, so that every add
        fuses with the norm after it (RMSNorm's `residual`): (block output, residual) out."""
        if residual is None:  # the first layer: the embeddings are the residual stream
            residual, normed = hidden_states, self.input_layernorm(hidden_states)
        else:
            normed, residual = self.input_layernorm(self._scale(hidden_states), residual)
        recurrent = getattr(self, "mamba", None) or getattr(self, "linear_attn", None)
        if recurrent is not None:
            meta = attn_metadata
            h = recurrent(normed, kv_cache, meta.state_slots, meta.query_start_loc_cpu, meta.fresh)
        else:
            h = self.self_attn(cos_sin, normed, kv_cache, attn_metadata)
        normed, residual = self.post_attention_layernorm(self._scale(h), residual)
        return self.mlp(normed), residual

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier


class LlamaModel(nn.Module):
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
        # One RoPE table shared by all layers (it only depends on the config).
        rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            rotary_dim=int(config.head_dim * config.partial_rotary_factor),
            dtype=dtype,
        )
        self.rotary_emb = rotary_emb
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config, i, rotary_emb, backend, dtype, quant_config, f"{prefix}.layers.{i}"
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, config.norm_weight_offset
        )
        self.embedding_multiplier = config.embedding_multiplier

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            hidden_states = hidden_states * self.embedding_multiplier
        return hidden_states

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        hidden_states = self.embed(input_ids)
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
    # Our packed layers -> the checkpoint's parts of them, in row order (their shard ids).
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
        "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],  # a Gated DeltaNet's (Qwen3.5's names)
        "in_proj_ba": ["in_proj_b", "in_proj_a"],
    }
    # Checkpoint names -> ours, where an architecture names a layer its own way (Mixtral's
    # experts: w1 / w3 / w2 are gate / up / down), as re.sub patterns.
    _RENAMES = (
        (r"^model\.language_model\.", "model."),  # Qwen3.5's text within its multimodal model
        (r"\.block_sparse_moe\.router\.layer\.", ".mlp.gate."),  # Granite 4.0-H's experts
        (r"\.block_sparse_moe\.input_linear\.weight$", ".mlp.experts.gate_up_proj"),
        (r"\.block_sparse_moe\.output_linear\.weight$", ".mlp.experts.down_proj"),
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"\.mlp\.router\.", ".mlp.gate."),  # gpt-oss's router
        (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
        (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
        (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    )

    # Checkpoint tensors the model does not use: Qwen3-Next's and Qwen3.5's multi-token
    # prediction layers, Qwen3.5's vision tower (images: not yet).
    ignored_weights = re.compile(r"(mtp|model\.visual)\.")

    @property
    def weight_renames(self) -> tuple[tuple[str, str], ...]:
        """Granite 4.0-H's dense MLP (shared_mlp) is the layer's MLP, or, beside experts, their
        shared expert."""
        shared = ".mlp.shared_expert." if self.config.num_experts else ".mlp."
        return (
            *self._RENAMES,
            (r"\.shared_mlp\.input_linear\.", f"{shared}gate_up_proj."),
            (r"\.shared_mlp\.output_linear\.", f"{shared}down_proj."),
        )

    _FUSED_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)(_bias)?")
    _INTERLEAVED = re.compile(r"(.*\.linear_attn)\.(in_proj_qkvz|in_proj_ba)\.weight")
    # The names split_weight may split (load_weights reads only these at once).
    split_names = re.compile(r"(_proj|_proj_bias|\.in_proj_qkvz\.weight|\.in_proj_ba\.weight)$")

    def split_weight(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A checkpoint tensor that holds several of the model's (load_weights asks about each
        name its weight_renames leave): a layer's experts stacked, as transformers 5 holds
        them ([experts, 2 x intermediate, hidden]: gate then up; gpt-oss's transposed, [experts,
        hidden, 2 x intermediate], gate and up interleaved column by column), one expert's gate,
        up or down projection each; any other tensor as it is."""
        m = self._INTERLEAVED.fullmatch(name)
        if m is not None:
            return self._deinterleave(m.group(1), m.group(2), tensor)
        m = self._FUSED_EXPERTS.fullmatch(name)
        if m is None or tensor.dim() != 2 + (m.group(3) is None):
            return [(name, tensor)]
        stem, proj, kind = m.group(1), m.group(2), "bias" if m.group(3) else "weight"
        interleaved = self.config.architecture == "GptOssForCausalLM"
        parts = []
        for e, t in enumerate(tensor):
            if interleaved and kind == "weight":
                t = t.T  # [out, in], as the layers take them
            if proj == "down_proj":
                parts.append((f"{stem}.{e}.down_proj.{kind}", t))
                continue
            gate, up = (t[0::2], t[1::2]) if interleaved else t.chunk(2)
            parts += [(f"{stem}.{e}.gate_proj.{kind}", gate), (f"{stem}.{e}.up_proj.{kind}", up)]
        return parts

    def _deinterleave(self, stem: str, proj: str, tensor: torch.Tensor):
        """Qwen3-Next's Gated DeltaNet projections hold, key head after key head, that head's
        q, k, v and z rows (in_proj_qkvz) or b and a rows (in_proj_ba); Qwen3.5's (and the
        layer's) hold q of all heads, then k, v, z: in_proj_qkv / in_proj_z, in_proj_b / _a."""
        c = self.config
        heads, r = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads
        rows = tensor.view(heads, -1, tensor.shape[-1])
        if proj == "in_proj_ba":
            b, a = rows.split([r, r], dim=1)
            return [(f"{stem}.in_proj_b.weight", b.reshape(-1, tensor.shape[-1])),
                    (f"{stem}.in_proj_a.weight", a.reshape(-1, tensor.shape[-1]))]  # fmt: skip
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        q, k, v, z = (t.reshape(-1, tensor.shape[-1])
                      for t in rows.split([dk, dk, r * dv, r * dv], dim=1))  # fmt: skip
        return [(f"{stem}.in_proj_qkv.weight", torch.cat([q, k, v])),
                (f"{stem}.in_proj_z.weight", z)]  # fmt: skip

    def __init__(
        self,
        config: ModelArchConfig,
        attention_backend: str = "auto",
        dtype: torch.dtype = torch.float32,
        quant_config: QuantizationConfig | None = None,
    ):
        """Built in `dtype` on the default device, this rank's shard of every layer (the
        tensor-parallel group is set before), each linear in quant_config's format."""
        super().__init__()
        self.config = config
        self.model = self.model_class(config, attention_backend, dtype, quant_config)
        tied = config.tie_word_embeddings
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, dtype, quant_config, "lm_head", tied
        )
        if tied:
            self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.model.embed_tokens.take_codes()

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.dtype  # lm_head may be quantized

    def fused_decoder(self) -> FusedDecoder:
        """The decoder layers as one C++ call over the current weights and LoRA slots (load,
        process_weights_after_loading and attach slots first), for the runner's decode steps;
        raises NotFusable with the reason where it cannot."""
        if type(self.model) is not LlamaModel:
            raise NotFusable(f"{type(self.model).__name__} layers")
        if self.config.num_experts:
            raise NotFusable("mixture-of-experts layers")
        if self.config.num_recurrent_layers:
            raise NotFusable(f"{self.config.recurrent_layer_name} layers")
        return FusedDecoder(self.model, self.config)

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

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        codes: Mapping[str, QuantWeight] | None = None,
    ) -> None:
        """HF-named checkpoint tensors in, each through its parameter's weight_loader (codes:
        a GGUF's blocks, for the layers built to take them). Raises ValueError on an unknown
        name, a wrong shape, or a parameter left unloaded."""
        load_weights(self, weights, codes)
