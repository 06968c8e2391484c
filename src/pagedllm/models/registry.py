"""The supported architectures, in one place: HF architecture name (config.json "architectures")
-> model class, and llama.cpp's GGUF architecture name -> HF architecture name. The HF and GGUF
loaders consult these tables; an architecture missing here is rejected with the list of these.
Torch-free: a model class is imported when it is asked for, so reading a config (the API
server's process does) imports no torch."""

from __future__ import annotations

import importlib

# Llama's close relatives share its decoder; their differences are ModelArchConfig options.
# HF architecture -> (module under pagedllm.models, class).
_MODELS: dict[str, tuple[str, str]] = {
    "GptOssForCausalLM": ("llama", "LlamaForCausalLM"),
    "GraniteForCausalLM": ("llama", "LlamaForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("llama", "LlamaForCausalLM"),  # Mamba-2 layers among them
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Phi3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("llama", "LlamaForCausalLM"),
    # Gated DeltaNet layers among gated attention layers (with experts in the MoE ones)
    "Qwen3NextForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3_5ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("llama", "LlamaForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "BertModel": ("bert", "BertModel"),  # an encoder: embeddings only (the pooling runner)
}

# general.architecture in a GGUF file -> the HF architecture it loads as. llama.cpp's converter
# writes Mistral as "llama" (and does not store its sliding window), and Mixtral as "llama"
# with experts.
GGUF_ARCHITECTURES: dict[str, str] = {
    "gemma3": "Gemma3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "granite": "GraniteForCausalLM",
    "granitehybrid": "GraniteMoeHybridForCausalLM",
    "llama": "LlamaForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
    "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
}


def get_model_class(architecture: str) -> type:
    """The torch.nn.Module class of an HF architecture name."""
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(_MODELS))}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(f"pagedllm.models.{module}"), name)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def architecture_from_gguf(gguf_arch: str | None) -> str:
    """The HF architecture name of a GGUF general.architecture; ValueError listing the supported."""
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {gguf_arch!r} is not supported; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    return GGUF_ARCHITECTURES[gguf_arch]
