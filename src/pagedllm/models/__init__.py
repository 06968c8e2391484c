from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.registry import get_model_class, supported_architectures

__all__ = ["LlamaForCausalLM", "get_model_class", "supported_architectures"]
