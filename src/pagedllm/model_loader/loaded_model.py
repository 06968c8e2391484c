"""What every loader returns: the architecture, the weights under HF names, and the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.config import ModelArchConfig
from pagedllm.layers.quantization import QuantWeight
from pagedllm.model_loader.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    config: ModelArchConfig
    # HF parameter names -> tensors. GGUF weights come dequantized to float32; safetensors weights
    # keep their stored dtype (the model casts). Tied embeddings: no "lm_head.weight" entry.
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    name: str
    # HF weight names -> int4 / int8 codes, for weights a GGUF stores in 4- or 8-bit blocks (only
    # when asked for, see load_gguf's keep_codes); `weights` holds them dequantized all the same.
    quant_codes: dict[str, QuantWeight] = field(default_factory=dict)
    source: str | None = None  # the file or directory loaded, for error messages
