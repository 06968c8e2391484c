from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding

__all__ = ["Attention", "RMSNorm", "RotaryEmbedding", "SiluAndMul"]
