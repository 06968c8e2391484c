"""Configuration: the user's flags (EngineArgs), a model's architecture (ModelArchConfig), and
the resolved EngineConfig of parts. The lowest layer: it imports nothing else of pagedllm."""

from pagedllm.config.engine_args import (
    ATTENTION_BACKENDS,
    CONTIGUOUS_POLICIES,
    DEVICES,
    DTYPES,
    KV_ALLOCATIONS,
    KV_ALLOCATORS,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATION_METHODS,
    EngineArgs,
    parse_bytes,
)
from pagedllm.config.engine_config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedllm.config.kv_events import KVEventsConfig
from pagedllm.config.model_arch import ModelArchConfig
from pagedllm.config.speculative import SpeculativeConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "CONTIGUOUS_POLICIES",
    "DEVICES",
    "DTYPES",
    "KV_ALLOCATIONS",
    "KV_ALLOCATORS",
    "KV_CACHE_DTYPES",
    "PREEMPTION_MODES",
    "QUANTIZATION_METHODS",
    "CacheConfig",
    "DeviceConfig",
    "EngineArgs",
    "EngineConfig",
    "KVEventsConfig",
    "LoRAConfig",
    "LoadConfig",
    "ModelArchConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "parse_bytes",
]
