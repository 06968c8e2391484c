from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.sdpa import paged_attention_sdpa
from pagedllm.attention.selector import AttentionBackend, get_attention_backend
from pagedllm.attention.torch_ref import paged_attention_ref, write_kv_cache

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "get_attention_backend",
    "paged_attention_ref",
    "paged_attention_sdpa",
    "write_kv_cache",
]
