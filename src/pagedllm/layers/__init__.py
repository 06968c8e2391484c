from pagedllm.layers.activation import GeluTanhAndMul, SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding

__all__ = [
    "Attention",
    "GeluTanhAndMul",
    "GemmaRMSNorm",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
]
