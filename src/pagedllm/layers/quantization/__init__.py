"""Each linear layer's weight format (its quant_method): float (unquantized.py; prepacked for
oneDNN in bfloat16 on CPU), weight-only int8 / int4 codes (int_linear.py, codes.py), a GGUF's
codes multiplied in integers with 8-bit activations (int8_act.py, the default on CPU), or its
codes beside its float weights (dual.py), chosen per layer by QuantizationConfig (config.py)
when the model is built."""

from pagedllm.layers.quantization.base import LinearMethodBase
from pagedllm.layers.quantization.codes import (
    BLOCK,
    Int4Weight,
    Int8Weight,
    Int8xWeight,
    QuantWeight,
    pack_int4,
    unpack_int4,
)
from pagedllm.layers.quantization.config import (
    QuantizationConfig,
    code_layer_kinds,
    layers_with_codes,
)
from pagedllm.layers.quantization.dual import DualLinearMethod
from pagedllm.layers.quantization.int8_act import Int8ActLinearMethod
from pagedllm.layers.quantization.int_linear import (
    MAX_GEMV_ROWS,
    Int4LinearMethod,
    Int8LinearMethod,
)
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod, can_pack

__all__ = [
    "BLOCK",
    "DualLinearMethod",
    "Int8ActLinearMethod",
    "MAX_GEMV_ROWS",
    "Int4LinearMethod",
    "Int4Weight",
    "Int8LinearMethod",
    "Int8Weight",
    "Int8xWeight",
    "LinearMethodBase",
    "QuantWeight",
    "QuantizationConfig",
    "UnquantizedLinearMethod",
    "can_pack",
    "code_layer_kinds",
    "layers_with_codes",
    "pack_int4",
    "unpack_int4",
]
