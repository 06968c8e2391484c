"""What every loader returns: the architecture, the weights under HF names, and the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.config import ModelArchConfig
from pagedllm.layers.quantization import Int4Weight
from pagedllm.model_loader.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    config: ModelArchConfig
    # HF parameter names -> tensors. GGUF weights come dequantized to float32; safetensors weights
    # keep their stored dtype (the model casts). Tied embeddings: no "lm_head.weight" entry.
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    name: str
    # HF weight names -> int4 codes, for weights a GGUF stores as 4-bit groups (only when asked
    # for, see load_gguf's keep_int4); `weights` holds them dequantized all the same.
    int4_weights: dict[str, Int4Weight] = field(default_factory=dict)
    source: str | None = None  # the file or directory loaded, for error messages
