"""A GGUF file's config and tokenizer, read from its metadata and tensor shapes (no tensor
data): what an engine reads before its weights. Torch-free, so the API server's process reads
them without importing torch (gguf_loader.py loads the weights). A file that is not GGUF,
truncated or corrupt is one ValueError naming the file."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import struct

import gguf
import numpy as np

from pagedllm.config import ModelArchConfig
from pagedllm.config.model_arch import rope_type
from pagedllm.model_loader.chat_template import ChatTemplateSecurityError
from pagedllm.model_loader.gguf_file import GGUFFile
from pagedllm.model_loader.gguf_tokenizer import tokenizer_from_gguf_metadata
from pagedllm.model_loader.tokenizer import Tokenizer
from pagedllm.models.registry import architecture_from_gguf

_T = gguf.GGMLQuantizationType
# The block types whose codes the layers take as they are (gguf_codes.py makes them).
CODE_TYPES = (_T.Q4_0, _T.Q4_1, _T.Q4_K, _T.Q8_0, _T.Q5_0, _T.Q6_K, _T.Q5_K, _T.Q5_1, _T.MXFP4)


# What reading a truncated or corrupt file raises from inside gguf / numpy / struct.
CORRUPT = (
    ValueError, IndexError, KeyError, TypeError, struct.error, OverflowError, EOFError,
    UnicodeDecodeError, MemoryError,
)  # fmt: skip


@contextlib.contextmanager
def naming(path) -> object:
    """Errors raised while loading `path` come out as ValueError naming the file (the template
    security error keeps its type): never a bare IndexError from deep inside a reader."""
    try:
        yield
    except ChatTemplateSecurityError as e:
        raise ChatTemplateSecurityError(f"{path}: {e}") from None
    except CORRUPT as e:
        why = str(e) if type(e) is ValueError else f"{type(e).__name__}: {e}"
        raise ValueError(f"{path}: {why}") from e


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The file parsed (gguf_file.py); a file that is not GGUF, truncated or corrupt is one
    ValueError naming the file. The last file opened stays parsed (until it changes on disk):
    an engine reads the config, the tokenizer and the weights of one file."""
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise ValueError(f"{path} is empty: not a GGUF file")
    try:
        stat = os.stat(path)
    except OSError:
        return GGUFFile(path)  # its own error (no such file, ...)
    return _read_gguf(os.fspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _read_gguf(path: str, size: int, mtime_ns: int) -> GGUFFile:
    """(`size` and `mtime_ns` key the cache: a file rewritten in place is read again.)"""
    try:
        return GGUFFile(path)
    except CORRUPT as e:
        raise ValueError(
            f"{path} is not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from e


def llama3_rope_freq_factors(
    head_dim: int, rope_theta: float, factor: float, low: float, high: float, original_max: int
) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for HF's llama3 rope scaling."""
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original_max / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(
        wavelen < original_max / high, 1.0, np.where(wavelen > original_max / low, factor, mid)
    )


def _llama3_scaling_from_factors(
    factors: np.ndarray, head_dim: int, rope_theta: float, original_max: int
) -> dict | None:
    """Recover HF's llama3 rope_scaling dict from llama.cpp's precomputed rope_freqs factors.

    The factors are invariant under scaling (original_max, low, high) together, so original_max is
    taken from metadata (default 8192, as the converter does) and low/high are solved from the
    linear "smooth" ramp between the two bands.
    """
    factors = factors.astype(np.float64)
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    x = original_max / (2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2) / head_dim))
    ramp = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    if ramp.sum() >= 2:  # smooth = (x - low) / (high - low), linear in x
        smooth = (1 / factors[ramp] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(x[ramp], smooth, 1)
        low = -intercept / slope
        high = low + 1 / slope
    else:  # no ramp to fit: HF's defaults, checked below
        low, high = 1.0, 4.0
    low, high = round(float(low), 4), round(float(high), 4)
    rebuilt = llama3_rope_freq_factors(head_dim, rope_theta, factor, low, high, original_max)
    if not np.allclose(rebuilt, factors, rtol=1e-4, atol=1e-4):
        raise ValueError("rope_freqs in this GGUF do not follow llama3 rope scaling; not supported")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original_max,
    }


def _rope_scaling(meta: dict, arch: str, config: ModelArchConfig, rope_freqs) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind not in (None, "none"):
        scaling = {"rope_type": kind, "factor": float(meta[f"{arch}.rope.scaling.factor"])}
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        for key in ("yarn_beta_fast", "yarn_beta_slow"):
            if f"{arch}.rope.scaling.{key}" in meta:
                scaling[key.removeprefix("yarn_")] = float(meta[f"{arch}.rope.scaling.{key}"])
        return scaling
    if rope_freqs is not None:
        factors = gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type).reshape(-1)
        return _llama3_scaling_from_factors(
            factors, config.head_dim, config.rope_theta, int(orig or 8192)
        )
    return None


def _granite_options(meta: dict, arch: str) -> dict:
    """Granite's multipliers (llama.cpp: a missing attention.scale means 1/sqrt(head_dim))."""
    scale = meta.get(f"{arch}.attention.scale")
    return {
        "embedding_multiplier": float(meta.get(f"{arch}.embedding_scale", 1.0)),
        "residual_multiplier": float(meta.get(f"{arch}.residual_scale", 1.0)),
        "attention_multiplier": None if scale is None else float(scale),
        "logits_scaling": float(meta.get(f"{arch}.logit_scale", 1.0)),
    }


def _mamba_options(meta: dict, arch: str, tensors: dict) -> dict:
    """A hybrid's Mamba-2 layers: those with no KV heads (llama.cpp's per-layer head_count_kv),
    their sizes from the ssm keys; RoPE only where the file says so (llama.cpp's converter
    writes rope.scaling.finetuned for a hybrid that uses it)."""
    kv_heads = meta.get(f"{arch}.attention.head_count_kv")
    n = int(meta[f"{arch}.block_count"])
    if not isinstance(kv_heads, list) or len(kv_heads) != n:
        raise ValueError(f"{arch} GGUF without a per-layer attention.head_count_kv")
    inner, heads = int(meta[f"{arch}.ssm.inner_size"]), int(meta[f"{arch}.ssm.time_step_rank"])
    hidden = int(meta[f"{arch}.embedding_length"])
    if inner % heads or inner % hidden:
        raise ValueError(f"{arch} GGUF: ssm.inner_size {inner} is not heads x head_dim")
    first = next((i for i, h in enumerate(kv_heads) if not h), 0)
    return {
        "layer_types": ["full_attention" if h else "mamba" for h in kv_heads],
        "use_rope": bool(meta.get(f"{arch}.rope.scaling.finetuned", False)),
        "intermediate_size": int(meta[f"{arch}.expert_shared_feed_forward_length"]),
        "mamba_expand": inner // hidden,
        "mamba_n_heads": heads,
        "mamba_d_head": inner // heads,
        "mamba_n_groups": int(meta[f"{arch}.ssm.group_count"]),
        "mamba_d_state": int(meta[f"{arch}.ssm.state_size"]),
        "mamba_d_conv": int(meta[f"{arch}.ssm.conv_kernel"]),
        "mamba_conv_bias": f"blk.{first}.ssm_conv1d.bias" in tensors,
        "mamba_proj_bias": f"blk.{first}.ssm_in.bias" in tensors,
    }


def _linear_attention_options(meta: dict, arch: str, tensors: dict, head_dim: int) -> dict:
    """Qwen3-Next / Qwen3.5: Gated DeltaNet layers where recurrent_layers says, their sizes in
    the ssm keys (state_size the key head dim, group_count the key heads, time_step_rank the
    value heads, inner_size all value heads' dims), gated attention with partial RoPE; Qwen3.5's
    files hold the value heads tiled (llama.cpp's converter reorders them)."""
    n = int(meta[f"{arch}.block_count"]) - int(meta.get(f"{arch}.nextn_predict_layers") or 0)
    recurrent = meta.get(f"{arch}.attention.recurrent_layers")
    if not isinstance(recurrent, list) or len(recurrent) < n:
        raise ValueError(f"{arch} GGUF without attention.recurrent_layers for its {n} layers")
    k_heads, v_heads = int(meta[f"{arch}.ssm.group_count"]), int(meta[f"{arch}.ssm.time_step_rank"])
    inner = int(meta[f"{arch}.ssm.inner_size"])
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    options = {
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:n]],
        "qk_norm": True,
        "attn_output_gate": True,
        "norm_weight_offset": 1.0,
        "partial_rotary_factor": rope_dims / head_dim,
        "linear_num_key_heads": k_heads,
        "linear_num_value_heads": v_heads,
        "linear_key_head_dim": int(meta[f"{arch}.ssm.state_size"]),
        "linear_value_head_dim": inner // v_heads,
        "linear_conv_kernel_dim": int(meta[f"{arch}.ssm.conv_kernel"]),
        "linear_value_heads_tiled": arch != "qwen3next" and k_heads != v_heads,
    }
    if int(meta.get(f"{arch}.expert_count") or 0):
        options.update(_moe_options(meta, arch, tensors))
        options["shared_expert_intermediate_size"] = int(
            meta.get(f"{arch}.expert_shared_feed_forward_length", 0)
        )
        options["shared_expert_gate"] = "blk.0.ffn_gate_inp_shexp.weight" in tensors
    return options


def _arch_options(meta: dict, arch: str, tensors: dict, head_dim: int) -> dict:
    """The ModelArchConfig options that set an architecture apart from Llama."""
    if arch in ("qwen3next", "qwen35", "qwen35moe"):
        return _linear_attention_options(meta, arch, tensors, head_dim)
    if arch == "granite":
        return _granite_options(meta, arch)
    if arch == "granitehybrid":
        options = {**_granite_options(meta, arch), **_mamba_options(meta, arch, tensors)}
        if int(meta.get(f"{arch}.expert_count") or 0):
            options.update(_moe_options(meta, arch, tensors))
        return options
    if int(meta.get(f"{arch}.expert_count") or 0):
        return _moe_options(meta, arch, tensors)
    if arch == "phi3":
        if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
            raise ValueError("phi3 GGUF with LongRoPE factors (rope_factors_*): not supported")
        rope_dims = meta.get(f"{arch}.rope.dimension_count")
        return {"partial_rotary_factor": 1.0 if rope_dims is None else rope_dims / head_dim}
    return {}


def _moe_options(meta: dict, arch: str, tensors: dict) -> dict:
    """A mixture of experts (qwen3moe; Mixtral, written as llama): llama.cpp's graphs of these
    architectures always renormalise the top k weights, and put experts in every layer."""
    if arch not in ("qwen3moe", "llama", "gpt-oss", "granitehybrid", "qwen3next", "qwen35moe"):
        raise ValueError(f"{arch} GGUF with experts: not supported")
    experts, used = int(meta[f"{arch}.expert_count"]), int(meta.get(f"{arch}.expert_used_count", 0))
    if not 0 < used <= experts:
        raise ValueError(f"{arch}.expert_used_count {used} of {experts} experts")
    gating = meta.get(f"{arch}.expert_gating_func")
    if gating not in (None, int(gguf.ExpertGatingFuncType.SOFTMAX)):
        raise ValueError(f"{arch} GGUF with expert gating function {gating}: only softmax")
    size = meta.get(f"{arch}.expert_feed_forward_length", meta.get(f"{arch}.feed_forward_length"))
    missing = [
        name for name in ("ffn_gate_inp", "ffn_gate_exps") if f"blk.0.{name}.weight" not in tensors
    ]
    if missing:
        raise ValueError(f"{arch} GGUF with experts lacks blk.0.{missing[0]}.weight")
    fields = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(size),
        "norm_topk_prob": True,
    }
    if arch == "granitehybrid":  # the softmax of the top k logits; a shared MLP beside
        fields.update(
            norm_topk_prob=False, router_softmax_after_topk=True,
            shared_expert_intermediate_size=int(meta[f"{arch}.expert_shared_feed_forward_length"]),
        )  # fmt: skip
    if arch == "gpt-oss":  # llama.cpp's graph fixes its SwiGLU's alpha and limit
        fields.update(
            norm_topk_prob=False, router_softmax_after_topk=True, router_bias=True,
            expert_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702, attention_sinks=True,
        )  # fmt: skip
    return fields


def config_from_metadata(meta: dict, tensors: dict) -> ModelArchConfig:
    arch = meta.get("general.architecture")
    architecture = architecture_from_gguf(arch)

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF file lacks the required metadata key {arch}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some files; llama uses one value
        kv_heads = max(kv_heads)
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        emb = tensors["output.weight" if "output.weight" in tensors else "token_embd.weight"]
        vocab = len(tokens) if tokens is not None else int(emb.shape[-1])  # ggml order: (in, out)
    eos_ids = [
        int(meta[f"tokenizer.ggml.{k}"])
        for k in ("eos_token_id", "eot_token_id", "eom_token_id")  # end of text / turn / message
        if meta.get(f"tokenizer.ggml.{k}") is not None
    ]
    head_dim = int(get("attention.key_length", hidden // heads))
    # llama.cpp's converter writes it for phi3 (0: none), not for Mistral (a "llama" file) nor
    # Qwen2. Where present it slides every layer, as HF's Phi-3 and Mistral do.
    sliding_window = int(meta.get(f"{arch}.attention.sliding_window") or 0) or None
    # The first attention layer's tensors tell its options (a hybrid's layer 0 may be Mamba).
    # Blocks past the model's (Qwen3-Next's and Qwen3.5's multi-token prediction, which
    # llama.cpp's converter appends) are not run: load_gguf leaves them unread.
    n = int(get("block_count")) - int(meta.get(f"{arch}.nextn_predict_layers") or 0)
    attn = next((f"blk.{i}." for i in range(n) if f"blk.{i}.attn_output.weight" in tensors), "")
    options = {"intermediate_size": int(get("feed_forward_length"))}
    options["qk_norm"] = f"{attn}attn_q_norm.weight" in tensors
    options.update(_arch_options(meta, arch, tensors, head_dim))
    config = ModelArchConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=f"{attn}attn_output.bias" in tensors,
        qkv_bias=f"{attn}attn_q.bias" in tensors or f"{attn}attn_qkv.bias" in tensors,
        mlp_bias="blk.0.ffn_down.bias" in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos_ids)),
        sliding_window=sliding_window,
        quantized_codes=any(t.tensor_type in CODE_TYPES for t in tensors.values()),
        **options,
    )
    config.rope_scaling = _rope_scaling(meta, arch, config, tensors.get("rope_freqs.weight"))
    rope_type(config.rope_scaling)  # ValueError for a type we cannot compute
    if arch == "gemma3":
        _gemma3_config(meta, config)
    if arch == "gpt-oss":
        # Sliding and full layers alternate (llama.cpp's pattern of 2); YaRN's correction range
        # is not rounded to whole dims (transformers' gpt-oss config: truncate false; llama.cpp
        # rounds it).
        n = config.num_hidden_layers
        config.layer_types = ["full_attention" if i % 2 else "sliding_attention" for i in range(n)]
        if config.rope_scaling is not None and config.rope_scaling["rope_type"] == "yarn":
            config.rope_scaling["truncate"] = False
    return config


def _gemma3_config(meta: dict, config: ModelArchConfig) -> None:
    """What llama.cpp's gemma3 graph takes from metadata, or hard-codes when a file has none:
    one full-attention layer in 6, local RoPE base 10000, and attention scaled by head_dim ** -0.5
    (hidden / heads for the 27B model, the one with 62 layers)."""
    n = config.num_hidden_layers
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one flag per layer, true for sliding ones
        sliding = [bool(x) for x in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(n)]
    config.layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    window = meta.get("gemma3.attention.sliding_window")
    if window is None:
        raise ValueError("GGUF file lacks the metadata key gemma3.attention.sliding_window")
    config.sliding_window = int(window)
    config.rope_local_base_freq = float(meta.get("gemma3.rope.freq_base_swa", 10000.0))
    if "gemma3.attention.scale" in meta:
        config.query_pre_attn_scalar = float(meta["gemma3.attention.scale"]) ** -2
    elif n == 62:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = config.head_dim
    config.attn_logit_softcapping = meta.get("gemma3.attn_logit_softcapping")
    config.final_logit_softcapping = meta.get("gemma3.final_logit_softcapping")
    # Chat turns end with <end_of_turn> (llama.cpp treats it as end of generation too).
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if "<end_of_turn>" in tokens and tokens.index("<end_of_turn>") not in config.eos_token_ids:
        config.eos_token_ids.append(tokens.index("<end_of_turn>"))


def tokenizer_from_metadata(meta: dict) -> Tokenizer | None:
    if "tokenizer.ggml.tokens" not in meta:
        return None
    prefix = "tokenizer.ggml."
    tok_meta = {k.removeprefix(prefix): v for k, v in meta.items() if k.startswith(prefix)}
    tok_meta["token_types"] = tok_meta.pop("token_type", None) or [1] * len(tok_meta["tokens"])
    tok_meta["chat_template"] = meta.get("tokenizer.chat_template")
    tok_meta["architecture"] = meta.get("general.architecture")
    return tokenizer_from_gguf_metadata(tok_meta)


def load_gguf_tokenizer(path: str | os.PathLike) -> Tokenizer | None:
    """Only the tokenizer of a GGUF file (no tensor is dequantized)."""
    reader = open_gguf(path)
    with naming(path):
        return tokenizer_from_metadata(reader.metadata)


def load_gguf_config(path: str | os.PathLike) -> ModelArchConfig:
    """Only the architecture (metadata and tensor shapes; no tensor is read)."""
    reader = open_gguf(path)
    with naming(path):
        return config_from_metadata(reader.metadata, {t.name: t for t in reader.tensors})
