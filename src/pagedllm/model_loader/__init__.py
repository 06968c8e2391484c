"""Model loading: GGUF files and Hugging Face directories -> config, HF-named weights, tokenizer.

The names below are imported when first used: reading a model's config or tokenizer (the API
server's process does) imports no torch; loading its weights does."""

import importlib

_EXPORTS = {
    "DEFAULT_MODEL": "loader",
    "LoadedModel": "loaded_model",
    "Tokenizer": "tokenizer",
    "load_gguf": "gguf_loader",
    "load_gguf_tokenizer": "gguf_config",
    "load_hf_dir": "hf_loader",
    "load_hf_tokenizer": "hf_config",
    "load_model": "loader",
    "load_tokenizer": "loader",
    "resolve_model": "loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
