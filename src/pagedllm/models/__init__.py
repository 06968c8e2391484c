"""The model classes, imported when first used: the registry (architecture names) is torch-free."""

import importlib

_EXPORTS = {
    "Gemma3ForCausalLM": "gemma3",
    "LlamaForCausalLM": "llama",
    "get_model_class": "registry",
    "supported_architectures": "registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
