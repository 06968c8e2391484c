"""A Hugging Face model directory's config and tokenizer (config.json, sentence-transformers'
pooling, tokenizer.json and its config): what an engine reads before its weights. Torch-free, so
the API server's process reads them without importing torch (hf_loader.py loads the weights)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import tokenizers

from pagedllm.config import ModelArchConfig
from pagedllm.config.model_arch import rope_type
from pagedllm.model_loader.chat_template import ChatTemplateSecurityError
from pagedllm.model_loader.tokenizer import Tokenizer
from pagedllm.models.registry import supported_architectures

# config.json keys every supported architecture needs, as positive integers (intermediate_size
# but where every MLP is experts: Qwen3.5-MoE).
_REQUIRED_INTS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
)  # fmt: skip


_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings")


def read_json(path: Path, kind: type = dict) -> Any:
    """A JSON object (or a `kind`) from `path`; ValueError naming the file if it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if kind is list and not isinstance(data, list):
        raise ValueError(f"{path} must hold a JSON list, not a {type(data).__name__}")
    if kind is dict and not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not a {type(data).__name__}")
    return data


def _check_config(cfg: dict) -> None:
    missing = [k for k in _REQUIRED_INTS if k not in cfg
               and not (k == "intermediate_size" and cfg.get("moe_intermediate_size"))]  # fmt: skip
    if missing:
        raise ValueError(f"lacks the required key(s) {', '.join(missing)}")
    for key in _REQUIRED_INTS + _OPTIONAL_INTS:
        value = cfg.get(key)
        if key in cfg and value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")


def _rope(cfg: dict) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling, partial_rotary_factor) from transformers 4 (top-level keys,
    `rope_scaling`) or transformers 5 (`rope_parameters` holding them all) style configs."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = params.pop("partial_rotary_factor", None)
    scaling = cfg.get("rope_scaling") or params or None
    if scaling is not None:
        scaling = dict(scaling)
        scaling.pop("rope_theta", None)
        partial = scaling.pop("partial_rotary_factor", partial)
        if "type" in scaling and "rope_type" not in scaling:  # old spelling
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = None
    rope_type(scaling)  # ValueError for a type we cannot compute
    return theta, scaling, float(partial or cfg.get("partial_rotary_factor") or 1.0)


def _sliding_window(arch: str, cfg: dict) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) as transformers applies them for each architecture."""
    window = cfg.get("sliding_window")
    if arch == "GptOssForCausalLM":  # sliding and full layers alternating, as listed
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention"
            for i in range(cfg["num_hidden_layers"])
        ]
        return window, list(layer_types)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        return window, None  # every layer slides when a window is set (layer_types ignored)
    if arch == "Qwen3MoeForCausalLM":  # every layer slides when use_sliding_window
        return (window if cfg.get("use_sliding_window") else None), None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not cfg.get("use_sliding_window") or window is None:
            return None, None
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"
            for i in range(cfg["num_hidden_layers"])
        ]
        return window, layer_types
    return None, None  # Llama, Granite: no sliding window


def _arch_options(arch: str, cfg: dict) -> dict:
    """The ModelArchConfig options that set an architecture apart from Llama."""
    if arch == "Qwen2ForCausalLM":
        return {"qkv_bias": True}  # q/k/v always carry a bias, o_proj never
    if arch == "Qwen3ForCausalLM":
        return {"qk_norm": True}
    if arch == "Qwen3MoeForCausalLM":
        return {"qk_norm": True, **_moe_fields(cfg, cfg.get("moe_intermediate_size"))}
    if arch == "MixtralForCausalLM":  # every layer's experts, of the dense intermediate size
        return {**_moe_fields(cfg, cfg["intermediate_size"]), "norm_topk_prob": True}
    if arch == "GptOssForCausalLM":
        return {
            **_moe_fields({**cfg, "hidden_act": "silu"}, cfg["intermediate_size"]),
            "router_softmax_after_topk": True,
            "router_bias": True,
            "expert_bias": True,
            "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
            "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
            "attention_sinks": True,
        }
    if arch == "BertModel":
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"BERT with {cfg['position_embedding_type']} position embeddings")
        if cfg.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"BERT with hidden_act {cfg['hidden_act']!r} (only gelu)")
        return {
            "is_encoder": True,
            "layer_norm_eps": float(cfg.get("layer_norm_eps", 1e-12)),
            "type_vocab_size": int(cfg.get("type_vocab_size", 2)),
        }  # fmt: skip
    if arch == "GraniteForCausalLM":
        return {
            "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
            "attention_multiplier": float(cfg.get("attention_multiplier", 1.0)),
            "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
        }
    return {}


def _granite_hybrid_fields(cfg: dict) -> dict:
    """Granite 4.0-H: Mamba-2 layers ("linear_attention" / "mamba") among attention layers,
    usually without RoPE, Granite's multipliers, and a dense (shared) MLP."""
    kinds = cfg.get("layer_types") or cfg.get("layers_block_type")
    if not kinds or len(kinds) != cfg["num_hidden_layers"]:
        raise ValueError("a hybrid config needs layer_types, one per layer")
    names = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full_attention",
             "full_attention": "full_attention"}  # fmt: skip
    unknown = sorted({k for k in kinds if k not in names})
    if unknown:
        raise ValueError(f"layer types {unknown} (only mamba and attention)")
    # transformers writes infinity as {"__float__": "Infinity"}
    limit = [v["__float__"] if isinstance(v, dict) else v
             for v in cfg.get("time_step_limit") or (0.0, float("inf"))]  # fmt: skip
    experts = {}
    if cfg.get("num_local_experts"):  # Granite 4.0-H tiny / small: experts beside the MLP
        experts = _moe_fields(cfg, cfg["intermediate_size"])
        experts["router_softmax_after_topk"] = True
        experts["shared_expert_intermediate_size"] = int(cfg["shared_intermediate_size"])
    return {
        **experts,
        "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
        "attention_multiplier": float(cfg.get("attention_multiplier", 1.0)),
        "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
        "use_rope": cfg.get("position_embedding_type") == "rope",
        "layer_types": [names[k] for k in kinds],
        "intermediate_size": int(cfg.get("shared_intermediate_size") or cfg["intermediate_size"]),
        "mamba_expand": int(cfg.get("mamba_expand", 2)),
        "mamba_n_heads": int(cfg["mamba_n_heads"]),
        "mamba_d_head": int(cfg["mamba_d_head"]),
        "mamba_n_groups": int(cfg.get("mamba_n_groups", 1)),
        "mamba_d_state": int(cfg["mamba_d_state"]),
        "mamba_d_conv": int(cfg.get("mamba_d_conv", 4)),
        "mamba_conv_bias": bool(cfg.get("mamba_conv_bias", True)),
        "mamba_proj_bias": bool(cfg.get("mamba_proj_bias", False)),
        "mamba_time_step_limit": (float(limit[0]), float(limit[1])),
    }


_QWEN3_NEXT_ARCHS = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")


def _qwen3_next_fields(arch: str, cfg: dict) -> dict:
    """Qwen3-Next and Qwen3.5: Gated DeltaNet layers ("linear_attention") among gated attention
    layers, (1 + w) norms, and (Qwen3-Next, Qwen3.5-MoE) experts beside a gated shared
    expert. Qwen3.5's multimodal RoPE sections coincide with plain RoPE for text."""
    n = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0
        else "linear_attention" for i in range(n)
    ]  # fmt: skip
    unknown = sorted({k for k in kinds if k not in ("linear_attention", "full_attention")})
    if len(kinds) != n or unknown:
        raise ValueError(f"layer_types must give each of {n} layers linear_ or full_attention")
    fields = {
        "qk_norm": True,
        "attn_output_gate": True,
        "norm_weight_offset": 1.0,
        "layer_types": list(kinds),
        "linear_num_key_heads": int(cfg["linear_num_key_heads"]),
        "linear_num_value_heads": int(cfg["linear_num_value_heads"]),
        "linear_key_head_dim": int(cfg["linear_key_head_dim"]),
        "linear_value_head_dim": int(cfg["linear_value_head_dim"]),
        "linear_conv_kernel_dim": int(cfg.get("linear_conv_kernel_dim", 4)),
    }
    if arch == "Qwen3_5ForCausalLM":
        return fields
    moe = _moe_fields(cfg, cfg.get("moe_intermediate_size"))
    if arch == "Qwen3_5MoeForCausalLM":
        moe["norm_topk_prob"] = True  # always renormalised
    return {
        **fields,
        **moe,
        "intermediate_size": int(cfg.get("intermediate_size") or cfg["moe_intermediate_size"]),
        "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size", 0)),
        "shared_expert_gate": bool(cfg.get("shared_expert_intermediate_size")),
    }


def _moe_fields(cfg: dict, expert_size) -> dict:
    """The mixture-of-experts fields (Qwen3-MoE's names; transformers 5 saves num_experts as
    num_local_experts, Mixtral's name)."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    fields = {
        "num_experts": experts,
        "num_experts_per_tok": cfg.get("num_experts_per_tok"),
        "moe_intermediate_size": expert_size,
    }
    for key, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if fields["num_experts_per_tok"] > experts:
        raise ValueError(f"num_experts_per_tok {fields['num_experts_per_tok']} > {experts} experts")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"experts with hidden_act {cfg['hidden_act']!r} (only silu)")
    step = cfg.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    return {
        **fields,
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "decoder_sparse_step": step,
        "mlp_only_layers": [int(i) for i in cfg.get("mlp_only_layers") or []],
    }


def _gemma3_fields(cfg: dict) -> dict:
    """Gemma 3's extra ModelArchConfig fields: layer types, per-layer-type RoPE, soft-capping."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention is not supported")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma 3 with hidden_activation {cfg['hidden_activation']!r}")
    n = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # older configs: every `pattern`-th layer is a full-attention one
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        layer_types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
        ]
    per_type = cfg.get("rope_parameters") or {}
    if "full_attention" in per_type:  # transformers 5: one RoPE dict per layer type
        theta, scaling, _ = _rope({"rope_parameters": per_type["full_attention"]})
        local_theta, local_scaling, _ = _rope({"rope_parameters": per_type["sliding_attention"]})
        if local_scaling is not None:
            raise ValueError("Gemma 3 with rope scaling on sliding layers is not supported")
    else:  # transformers 4: rope_theta (+ rope_scaling) global, rope_local_base_freq local
        theta, scaling, _ = _rope(cfg)
        local_theta = cfg.get("rope_local_base_freq", 10000.0)
    return dict(
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_base_freq=float(local_theta),
        sliding_window=cfg.get("sliding_window"),
        layer_types=list(layer_types),
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
    )


def _quantized_codes(arch: str, cfg: dict) -> bool:
    """Whether the checkpoint's weights are codes pagedllm takes as they are: OpenAI's gpt-oss
    experts in MXFP4 (mxfp4.py). Other quantization_configs (GPTQ, AWQ, bitsandbytes, FP8...)
    store layouts no loader here reads: refused here, not as a puzzle of unexpected tensors."""
    quant = cfg.get("quantization_config")
    if quant is None:
        return False
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "mxfp4" and arch == "GptOssForCausalLM":
        return True
    raise ValueError(
        f"quantization_config's quant_method {method!r} ({arch}) is not supported: of quantized "
        "checkpoints, pagedllm reads gpt-oss's MXFP4 experts only. Load the unquantized "
        "checkpoint (pagedllm quantizes it with --quantization int8 / int4) or a GGUF file"
    )


# Multimodal checkpoints whose text model pagedllm runs (their vision towers left unread until
# images are supported): the architecture -> its text model's.
_TEXT_OF = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}


def config_from_hf(cfg: dict) -> ModelArchConfig:
    archs = cfg.get("architectures") or []
    text = next((_TEXT_OF[a] for a in archs if a in _TEXT_OF), None)
    if text is not None and isinstance(cfg.get("text_config"), dict):
        tied = cfg.get("tie_word_embeddings", cfg["text_config"].get("tie_word_embeddings"))
        cfg = {**cfg["text_config"], "architectures": [text], "tie_word_embeddings": bool(tied)}
        archs = [text]
    if "Gemma3ForConditionalGeneration" in archs:
        raise ValueError(
            "Gemma3ForConditionalGeneration (the multimodal checkpoint) is not supported: use a "
            "text-only Gemma3ForCausalLM checkpoint"
        )
    supported = supported_architectures()
    arch = next((a for a in archs if a in supported), None)
    if arch is None:
        raise ValueError(f"architectures {archs} not supported; supported: {', '.join(supported)}")
    _check_config(cfg)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    theta, scaling, partial_rotary_factor = _rope(cfg)
    sliding_window, layer_types = _sliding_window(arch, cfg)
    eos = cfg.get("eos_token_id")
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    extra = {}  # fields that replace the generic ones
    if arch == "Gemma3ForCausalLM":
        extra = _gemma3_fields(cfg)
    elif arch == "GraniteMoeHybridForCausalLM":
        extra = _granite_hybrid_fields(cfg)
    elif arch in _QWEN3_NEXT_ARCHS:
        extra = _qwen3_next_fields(arch, cfg)
    fields = dict(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg.get("intermediate_size", 0),
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", False),
        mlp_bias=cfg.get("mlp_bias", False),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        sliding_window=sliding_window,
        layer_types=layer_types,
        partial_rotary_factor=partial_rotary_factor,
        quantized_codes=_quantized_codes(arch, cfg),
        **_arch_options(arch, cfg),
    )
    return ModelArchConfig(**{**fields, **extra})


def load_hf_config(path: str | os.PathLike) -> ModelArchConfig:
    """From a model directory's config.json, or a config.json path."""
    path = Path(path)
    config = config_from_file(path / "config.json" if path.is_dir() else path)
    pooling = _sentence_transformers_pooling(path if path.is_dir() else path.parent)
    return config if pooling is None else dataclasses.replace(config, pooling_type=pooling)


# sentence-transformers' Pooling module: which of its modes a directory turns on.
_POOLING_MODES = {
    "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS",
    "pooling_mode_lasttoken": "LAST",
}  # fmt: skip


def _sentence_transformers_pooling(directory: Path) -> str | None:
    """The pooling a sentence-transformers model directory declares (modules.json naming a
    Pooling module and its config); None when it declares none we serve."""
    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        return None
    for module in read_json(modules_file, list):
        if isinstance(module, dict) and str(module.get("type", "")).endswith("Pooling"):
            config = read_json(directory / str(module.get("path", "")) / "config.json")
            modes = [kind for key, kind in _POOLING_MODES.items() if config.get(key)]
            if len(modes) != 1:
                raise ValueError(
                    f"{directory}: its pooling module turns on {len(modes)} of the modes this "
                    "engine serves (mean, cls, last token); it needs exactly one"
                )
            return modes[0]
    return None


def config_from_file(path: Path) -> ModelArchConfig:
    try:
        return config_from_hf(read_json(path))
    except (KeyError, TypeError, ValueError) as e:
        why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise ValueError(why if why.startswith(str(path)) else f"{path}: {why}") from None


def _token_content(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(directory: Path, tok_cfg: dict) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _appends_specials(backend: tokenizers.Tokenizer) -> bool:
    """Whether tokenizer.json's post-processor puts special tokens after the text (BERT's
    [CLS] ... [SEP]): then its own rule adds the special tokens, not our BOS policy."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    return len(full) > len(plain) and full[len(full) - len(plain) :] != plain


def load_hf_tokenizer(directory: str | os.PathLike) -> Tokenizer | None:
    """Tokenizer from tokenizer.json, tokenizer_config.json, chat_template.jinja; None if absent."""
    directory = Path(directory)
    if not (directory / "tokenizer.json").exists():
        return None
    try:
        backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise ValueError(
            f"{directory / 'tokenizer.json'} is not a readable tokenizer: {e}"
        ) from None
    # A prompt is encoded whole, never padded to a length or cut (some files ask for both)
    backend.no_padding()
    backend.no_truncation()
    cfg_path = directory / "tokenizer_config.json"
    tok_cfg = read_json(cfg_path) if cfg_path.exists() else {}
    special = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        token = _token_content(tok_cfg.get(key))
        special[key] = (
            token if token is not None and backend.token_to_id(token) is not None else None
        )
    add_bos = tok_cfg.get("add_bos_token")
    if add_bos is None and special["bos_token"] is not None:
        # No flag: follow what tokenizer.json's post-processor does (Llama 3 adds BOS there).
        probe = backend.encode("a", add_special_tokens=True).ids
        add_bos = bool(probe) and probe[0] == backend.token_to_id(special["bos_token"])
    try:
        return Tokenizer(
            backend,
            add_bos_token=bool(add_bos),
            post_processor_specials=_appends_specials(backend),
            chat_template=_chat_template(directory, tok_cfg),
            **special,
        )
    except ChatTemplateSecurityError as e:
        raise ChatTemplateSecurityError(f"{directory}: {e}") from None
