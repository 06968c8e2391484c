"""What every loader returns: the architecture, the weights under HF names, and the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import ModelArchConfig
from pagedllm.model_loader.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    config: ModelArchConfig
    # HF parameter names -> tensors. GGUF weights come dequantized to float32; safetensors weights
    # keep their stored dtype (the model casts). Tied embeddings: no "lm_head.weight" entry.
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    name: str
