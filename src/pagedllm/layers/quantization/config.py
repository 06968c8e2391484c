"""--quantization and the dtype, made into each linear layer's method when the layer is built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from pagedllm.config import QUANTIZATION_METHODS
from pagedllm.distributed import tp_group
from pagedllm.layers.quantization.base import LinearMethodBase
from pagedllm.layers.quantization.codes import BLOCK, Int4Weight, Int8Weight, Int8xWeight
from pagedllm.layers.quantization.dual import DualLinearMethod
from pagedllm.layers.quantization.int8_act import Int8ActLinearMethod
from pagedllm.layers.quantization.int_linear import Int4LinearMethod, Int8LinearMethod
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod

METHODS = {"int4": Int4LinearMethod, "int8": Int8LinearMethod}
# What --quantization auto becomes (model_loader/build.py): int8_act, the checkpoint's codes
# multiplied in integers (--dtype auto on CPU), or auto, its codes beside a float copy.
RESOLVED_METHODS = (*QUANTIZATION_METHODS, "int8_act")


@dataclass(frozen=True)
class QuantizationConfig:
    # none | int8 | int4 | auto (the checkpoint's codes beside the float weights: dual.py) |
    # int8_act (the checkpoint's codes times 8-bit activations in integers: int8_act.py)
    method: str = "none"
    prepack: bool = False  # float weights prepacked for oneDNN (unquantized.can_pack)
    # Layers (by prefix) that take the checkpoint's own codes: see layers_with_codes.
    layers_with_codes: frozenset[str] = frozenset()
    # auto: the layers the checkpoint has codes for, and their kind (see code_layer_kinds)
    code_kinds: Mapping[str, str] = field(default_factory=dict)
    fixed_order: bool = False  # batch-invariant products (--deterministic)

    def __post_init__(self):
        if self.method not in RESOLVED_METHODS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                f"got {self.method!r}"
            )

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        """`layer`'s sizes and tensor-parallel split are set. A layer whose input is not whole
        groups of 32 stays float; a tied LM head gets int8 whatever the method (int4 would cost
        the most accuracy on the logits): decode reads it every step, and 8 bits are half of
        bfloat16's bytes, while the float embedding stays for the lookups."""
        if self.method in ("auto", "int8_act"):
            return self._dual_or_float(layer, prefix)
        quantized = self.method != "none"
        if not quantized or layer.input_size % BLOCK:
            # A quantized model keeps no packed copy of a tied head: saving memory is its point.
            prepack = self.prepack and not (quantized and layer.tied)
            return UnquantizedLinearMethod(prepack, self.fixed_order)
        start, size = layer.input_start, layer.input_size_per_partition
        if start % BLOCK or size % BLOCK:
            raise ValueError(
                f"--quantization {self.method} with tensor parallel size {tp_group().size}: "
                f"rank {tp_group().rank} would hold input columns {start}..{start + size} of "
                f"{prefix}, which are not whole groups of {BLOCK}"
            )
        method = Int8LinearMethod if layer.tied else METHODS[self.method]
        return method(prefix in self.layers_with_codes, layer.tied, self.fixed_order)

    def _dual_or_float(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        """Where the checkpoint has codes for the layer and this rank's columns are whole groups
        of them: the codes in integers (int8_act) or beside the float weight (auto); the float
        weight alone elsewhere."""
        kind = self.code_kinds.get(prefix)
        start, size = layer.input_start, layer.input_size_per_partition
        if self.method == "auto" and kind not in METHODS:
            kind = None  # int6 and int8x codes: only the integer kernels take them
        if kind is None or start % BLOCK or size % BLOCK:
            return UnquantizedLinearMethod(self.prepack, self.fixed_order)
        if self.method == "int8_act":
            return Int8ActLinearMethod(kind)
        codes = METHODS[kind](takes_codes=True, tied=layer.tied, fixed_order=self.fixed_order)
        return DualLinearMethod(codes, self.prepack, layer.tied)


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
    kinds = code_layer_kinds(code_kinds, packed_modules_mapping, tie_word_embeddings)
    if method not in METHODS:
        return frozenset()
    return frozenset(
        layer
        for layer, kind in kinds.items()
        if kind == method or (layer == "lm_head" and tie_word_embeddings and kind == "int8")
    )


def code_layer_kinds(
    code_kinds: Mapping[str, type],
    packed_modules_mapping: Mapping[str, list[str]],
    tie_word_embeddings: bool,
) -> dict[str, str]:
    """Layer -> "int4" | "int6" | "int8" | "int8x" for the layers whose every part the checkpoint
    stores in codes: int6 for Int8xWeight's (Q6_K, Q5_K, Q5_1: codes in -32..31) and for those
    mixed with int4's, int8x for a mix with int8's (Int8xWeight.of makes any of them int8x,
    exactly); a tied LM head -> the embedding's kind when it is int8 or int6."""
    names = {Int4Weight: "int4", Int8Weight: "int8", Int8xWeight: "int6"}
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
    found = {
        layer: names[k[0]] if len(set(k)) == 1 else "int8x" if Int8Weight in k else "int6"
        for layer, k in kinds.items()
        if len(k) == needed[layer] and all(kind in names for kind in k)
    }
    embedding = code_kinds.get("model.embed_tokens.weight")
    if tie_word_embeddings and embedding in (Int8Weight, Int8xWeight):
        found["lm_head"] = names[embedding]
    return found
