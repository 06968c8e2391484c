from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.registry import get_model_class, supported_architectures

__all__ = ["Gemma3ForCausalLM", "LlamaForCausalLM", "get_model_class", "supported_architectures"]
