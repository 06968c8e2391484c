"""--quantization and the dtype, made into each linear layer's method when the layer is built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from pagedllm.config import QUANTIZATION_METHODS
from pagedllm.distributed import tp_group
from pagedllm.layers.quantization.base import LinearMethodBase
from pagedllm.layers.quantization.codes import BLOCK, Int4Weight, Int8Weight
from pagedllm.layers.quantization.int_linear import Int4LinearMethod, Int8LinearMethod
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod

METHODS = {"int4": Int4LinearMethod, "int8": Int8LinearMethod}


@dataclass(frozen=True)
class QuantizationConfig:
    method: str = "none"  # none | int8 | int4
    prepack: bool = False  # float weights prepacked for oneDNN (unquantized.can_pack)
    # Layers (by prefix) that take the checkpoint's own codes: see layers_with_codes.
    layers_with_codes: frozenset[str] = frozenset()

    def __post_init__(self):
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                f"got {self.method!r}"
            )

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        """`layer`'s sizes and tensor-parallel split are set. A layer whose input is not whole
        groups of 32 stays float; a tied LM head gets int8 whatever the method (int4 would cost
        the most accuracy on the logits): decode reads it every step, and 8 bits are half of
        bfloat16's bytes, while the float embedding stays for the lookups."""
        quantized = self.method != "none"
        if not quantized or layer.input_size % BLOCK:
            # A quantized model keeps no packed copy of a tied head: saving memory is its point.
            return UnquantizedLinearMethod(self.prepack and not (quantized and layer.tied))
        start, size = layer.input_start, layer.input_size_per_partition
        if start % BLOCK or size % BLOCK:
            raise ValueError(
                f"--quantization {self.method} with tensor parallel size {tp_group().size}: "
                f"rank {tp_group().rank} would hold input columns {start}..{start + size} of "
                f"{prefix}, which are not whole groups of {BLOCK}"
            )
        method = Int8LinearMethod if layer.tied else METHODS[self.method]
        return method(takes_codes=prefix in self.layers_with_codes, tied=layer.tied)


def layers_with_codes(
    code_kinds: Mapping[str, type],
    packed_modules_mapping: Mapping[str, list[str]],
    method: str,
    tie_word_embeddings: bool,
) -> frozenset[str]:
    """The layers that take a checkpoint's codes as they are (not its dequantized floats again):
    those whose every part (q, k and v of a qkv_proj...) the checkpoint stores in codes of the
    method's kind (`code_kinds`: HF weight name -> Int4Weight or Int8Weight); and a tied LM
    head, when the embedding's are int8 codes. The others quantize their float weights."""
    want = {"int4": Int4Weight, "int8": Int8Weight}.get(method)
    if want is None:
        return frozenset()
    part_of = {p: (packed, len(ps)) for packed, ps in packed_modules_mapping.items() for p in ps}
    kinds: dict[str, list[type]] = {}
    needed: dict[str, int] = {}
    for name, kind in code_kinds.items():
        *prefix, module, param = name.split(".")
        if param != "weight":
            continue
        packed, parts = part_of.get(module, (module, 1))
        layer = ".".join([*prefix, packed])
        kinds.setdefault(layer, []).append(kind)
        needed[layer] = parts
    found = {layer for layer, k in kinds.items() if len(k) == needed[layer] and set(k) == {want}}
    if tie_word_embeddings and code_kinds.get("model.embed_tokens.weight") is Int8Weight:
        found.add("lm_head")
    return frozenset(found)
