"""The supported architectures, in one place: HF architecture name (config.json "architectures")
-> model class, and llama.cpp's GGUF architecture name -> HF architecture name. The HF and GGUF
loaders consult these tables; an architecture missing here is rejected with the list of these."""

from __future__ import annotations

from torch import nn

from pagedllm.models.bert import BertModel
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.llama import LlamaForCausalLM

# Llama's close relatives share its decoder; their differences are ModelArchConfig options.
_MODELS: dict[str, type[nn.Module]] = {
    "GraniteForCausalLM": LlamaForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "BertModel": BertModel,  # an encoder: embeddings only (the pooling runner)
}

# general.architecture in a GGUF file -> the HF architecture it loads as. llama.cpp's converter
# writes Mistral as "llama" (and does not store its sliding window).
GGUF_ARCHITECTURES: dict[str, str] = {
    "gemma3": "Gemma3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "llama": "LlamaForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(_MODELS))}"
        )
    return _MODELS[architecture]


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
