"""Architecture name (config.json "architectures"[0]) -> model class."""

from __future__ import annotations

from torch import nn

from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.llama import LlamaForCausalLM

# Mistral is Llama's graph; its sliding window is not applied yet (exact up to the window).
_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(_MODELS))}"
        )
    return _MODELS[architecture]


def supported_architectures() -> list[str]:
    return sorted(_MODELS)
