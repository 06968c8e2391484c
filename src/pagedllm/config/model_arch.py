"""A model's architecture hyper-parameters, as every loader reads them (config.json or GGUF)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelArchConfig:
    """Architecture hyper-parameters in Hugging Face's vocabulary (from config.json or GGUF)."""

    architecture: str  # e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF's rope_scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None for plain RoPE.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Sliding-window attention, HF semantics: a query at position p sees keys at positions
    # > p - sliding_window. `layer_types[i]` is "full_attention" or "sliding_attention"; None
    # means every layer slides when `sliding_window` is set, none otherwise.
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    # Per-architecture options of the one decoder (the defaults are Llama's).
    qkv_bias: bool = False  # bias on q/k/v only (Qwen2); attention_bias puts one on o_proj too
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * factor dims (Phi-3/4)
    embedding_multiplier: float = 1.0  # Granite: embeddings scaled by this
    residual_multiplier: float = 1.0  # Granite: each block's output scaled before the residual add
    attention_multiplier: float | None = None  # Granite: attention scale; None is head_dim**-0.5
    logits_scaling: float = 1.0  # Granite: logits divided by this
    # RoPE base of the sliding layers when it differs from rope_theta (Gemma 3's local base).
    rope_local_base_freq: float | None = None
    # Attention scale is query_pre_attn_scalar ** -0.5 when set (Gemma), else head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # tanh soft-capping: cap * tanh(x / cap) of attention scores / final logits (Gemma).
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # The pooling a sentence-transformers model directory declares (1_Pooling/config.json):
    # LAST, MEAN or CLS; None for a model without one (an embedding model if set).
    pooling_type: str | None = None
    # An encoder (BERT): every token attends to the whole prompt both ways, so a prompt runs in
    # one step and is only pooled (no generation). Its post-norm LayerNorms' epsilon and the
    # number of token types (only type 0 is used).
    is_encoder: bool = False
    layer_norm_eps: float = 1e-12
    # The checkpoint holds weights in codes pagedllm multiplies as they are (a GGUF's Q4_0,
    # Q4_1, Q4_K, Q5_0 or Q8_0 tensors, ...; gpt-oss's MXFP4 experts in safetensors): --dtype
    # auto multiplies them in integers on CPU.
    quantized_codes: bool = False
    type_vocab_size: int = 2
    # Mixture of experts (Qwen3-MoE, Mixtral): each token's MLP is the weighted sum of
    # num_experts_per_tok of num_experts MLPs of moe_intermediate_size, chosen by a softmax
    # router (its top-k weights renormalised to sum to 1 when norm_topk_prob). Layers in
    # mlp_only_layers, and all but every decoder_sparse_step-th, keep a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # gpt-oss's mixture: the softmax over the top k logits (not top k of the softmax), biases on
    # the router and the experts, and its clamped SwiGLU: (clamp(up, +-limit) + 1) *
    # g * sigmoid(alpha * g) with g = min(gate, limit).
    # A dense MLP of this size beside the experts, added to their sum (Granite 4.0-H's shared
    # MLP); 0: none.
    shared_expert_intermediate_size: int = 0
    router_softmax_after_topk: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None  # None: silu(gate) * up
    swiglu_alpha: float = 1.702
    # Each head's attention sink (gpt-oss): a learned logit in the softmax's sum with no value.
    attention_sinks: bool = False
    # False: attention without positions (Granite 4.0-H: its Mamba-2 layers carry the order).
    use_rope: bool = True
    # Hybrid models: layer_types[i] == "mamba" makes layer i a Mamba-2 mixer (Granite 4.0-H,
    # layers/mamba2.py), "linear_attention" a Gated DeltaNet (Qwen3-Next / Qwen3.5,
    # layers/gated_deltanet.py): each keeps a fixed-size recurrent state per sequence instead
    # of K/V (a model has one kind).
    mamba_expand: int = 2
    mamba_n_heads: int = 0
    mamba_d_head: int = 0
    mamba_n_groups: int = 1
    mamba_d_state: int = 0
    mamba_d_conv: int = 4
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_time_step_limit: tuple[float, float] = (0.0, float("inf"))
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # llama.cpp's Qwen3.5 files order the value heads tiled ([k0, k1, .., k0, k1, ..]: value
    # head j reads key head j % key heads), HF's grouped (j // (value heads / key heads)).
    linear_value_heads_tiled: bool = False
    # Qwen3-Next / Qwen3.5: q_proj also gives a per-head output gate (q and gate interleaved
    # head by head), the attention output multiplied by its sigmoid; norms weighted by (1 + w)
    # (as loaded: norm_weight_offset is added to each checkpoint norm weight); a shared expert
    # scaled by sigmoid(shared_expert_gate(x)).
    attn_output_gate: bool = False
    norm_weight_offset: float = 0.0
    shared_expert_gate: bool = False

    def is_recurrent_layer(self, layer_idx: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer_idx] in (
            "mamba",
            "linear_attention",
        )

    @property
    def num_recurrent_layers(self) -> int:
        return sum(self.is_recurrent_layer(i) for i in range(self.num_hidden_layers))

    @property
    def recurrent_kind(self) -> str:
        """What its recurrent layers' state is called: "Mamba" or "Gated DeltaNet"."""
        return "Gated DeltaNet" if self.linear_num_value_heads else "Mamba"

    @property
    def recurrent_layer_name(self) -> str:
        return "Gated DeltaNet" if self.linear_num_value_heads else "Mamba-2"

    @property
    def recurrent_state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(conv, ssm) shapes of one sequence's state in one recurrent layer: the convolution's
        last kernel - 1 inputs [conv_dim, kernel - 1], and the recurrent state: Mamba-2's h
        [heads, head_dim, d_state], a Gated DeltaNet's S [value heads, key dim, value dim]."""
        if self.linear_num_value_heads:
            key_dim = self.linear_num_key_heads * self.linear_key_head_dim
            value_dim = self.linear_num_value_heads * self.linear_value_head_dim
            return (2 * key_dim + value_dim, self.linear_conv_kernel_dim - 1), (
                self.linear_num_value_heads,
                self.linear_key_head_dim,
                self.linear_value_head_dim,
            )
        conv_dim = (
            self.mamba_expand * self.hidden_size + 2 * self.mamba_n_groups * self.mamba_d_state
        )
        return (conv_dim, self.mamba_d_conv - 1), (
            self.mamba_n_heads,
            self.mamba_d_head,
            self.mamba_d_state,
        )

    def recurrent_state_bytes(self, dtype_bytes: int) -> int:
        """One sequence's state over all recurrent layers: the conv inputs of dtype_bytes each,
        the recurrent state in float32."""
        (c, k), (h, p, n) = self.recurrent_state_shapes
        return self.num_recurrent_layers * (c * k * dtype_bytes + h * p * n * 4)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx`'s MLP is a mixture of experts (Qwen3-MoE's rule)."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window of layer `layer_idx`, or None for a full-attention (or Mamba) layer."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None


# The rope_scaling types layers/rotary.py computes; the loaders refuse others when they read a
# config (torch-free, so reading a model's config imports no torch).
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_type(rope_scaling: dict | None) -> str:
    """The type of `rope_scaling`; ValueError, naming the supported types, for one we cannot
    compute."""
    if not rope_scaling:
        return "default"
    kind = rope_scaling.get("rope_type", rope_scaling.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    return kind
