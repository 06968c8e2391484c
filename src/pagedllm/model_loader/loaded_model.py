"""What every loader returns: the architecture, the weights under HF names, and the tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from pagedllm.config import ModelArchConfig
from pagedllm.layers.quantization import QuantWeight
from pagedllm.model_loader.tokenizer import Tokenizer


class LazyWeights(Mapping[str, torch.Tensor]):
    """Weights read from the file one at a time, when asked for (`load_model(lazy=True)`): a
    tensor-parallel rank slices each and drops it, never holding the whole model."""

    def __init__(self, readers: dict[str, Callable[[], torch.Tensor]]) -> None:
        self._readers = readers

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._readers[name]()

    def __contains__(self, name: object) -> bool:
        # Mapping's own would read the tensor (it tries self[name]): a whole decode to ask.
        return name in self._readers

    def __iter__(self) -> Iterator[str]:
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)

    def clear(self) -> None:
        self._readers.clear()


class LazyCodes(LazyWeights):
    """A GGUF's 4- and 8-bit blocks (gguf_codes.py) or gpt-oss's MXFP4 experts (mxfp4.py) as
    codes, decoded when asked for; `kinds` tells which each is (Int4Weight, Int8Weight or
    Int8xWeight) before anything is decoded, for the layers to be built to take them."""

    def __init__(
        self,
        readers: dict[str, Callable[[], QuantWeight]] | None = None,
        kinds: dict[str, type] | None = None,
    ) -> None:
        super().__init__(readers or {})
        self.kinds = kinds or {}

    def clear(self) -> None:
        super().clear()
        self.kinds.clear()


@dataclass
class LoadedModel:
    config: ModelArchConfig
    # HF parameter names -> tensors. GGUF weights come dequantized to float32; safetensors weights
    # keep their stored dtype (the model casts). Tied embeddings: no "lm_head.weight" entry.
    weights: dict[str, torch.Tensor] | LazyWeights
    tokenizer: Tokenizer | None
    name: str
    # HF weight names -> int4 / int8 codes, for weights a GGUF stores in 4- or 8-bit blocks, or a
    # gpt-oss checkpoint in MXFP4 (only when asked for, see load_gguf's and load_hf_dir's
    # keep_codes); `weights` holds them dequantized all the same.
    quant_codes: LazyCodes = field(default_factory=LazyCodes)
    source: str | None = None  # the file or directory loaded, for error messages
