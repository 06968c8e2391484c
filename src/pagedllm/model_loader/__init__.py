"""Model loading: GGUF files and Hugging Face directories -> config, HF-named weights, tokenizer."""

from pagedllm.model_loader.gguf_loader import load_gguf, load_gguf_tokenizer
from pagedllm.model_loader.hf_loader import load_hf_dir, load_hf_tokenizer
from pagedllm.model_loader.loaded_model import LoadedModel
from pagedllm.model_loader.loader import DEFAULT_MODEL, load_model, load_tokenizer, resolve_model
from pagedllm.model_loader.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "LoadedModel",
    "Tokenizer",
    "load_gguf",
    "load_gguf_tokenizer",
    "load_hf_dir",
    "load_hf_tokenizer",
    "load_model",
    "load_tokenizer",
    "resolve_model",
]
