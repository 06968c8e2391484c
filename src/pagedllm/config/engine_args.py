"""EngineArgs: every engine flag as the user gives it (to `LLM(...)` or the command line), and
the choice lists those flags take. `engine.arg_utils.create_engine_config` resolves them once
into an EngineConfig (engine_config.py) before anything is built."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
PREEMPTION_MODES = ("recompute", "swap")
QUANTIZATION_METHODS = ("none", "int8", "int4")
ATTENTION_BACKENDS = ("auto", "cpu", "sdpa", "torch", "triton")
# The pre-paging contiguous reservations (core/contiguous_kv_cache_manager.py), for benchmarks.
CONTIGUOUS_POLICIES = ("max", "pow2", "oracle")
KV_ALLOCATIONS = ("paged", *CONTIGUOUS_POLICIES)
# How contiguous regions are placed: binary buddies, or the first free extent that fits.
KV_ALLOCATORS = ("buddy", "first-fit")


def parse_bytes(value: str | int | float | None) -> int | None:
    """'4GiB', '512MiB', '2G', '1e9' or a plain number of bytes → bytes."""
    if value is None or isinstance(value, int | float):
        return None if value is None else int(value)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?)B?\s*", value, flags=re.IGNORECASE)
    if not m:
        raise ValueError(
            f"cannot parse a memory size from {value!r}: use e.g. '2GiB', '512MiB' or bytes"
        )
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary or unit else 1
    power = " KMGT".index(unit) if unit else 0
    return int(number * base**power)


@dataclass
class EngineArgs:
    """Every engine flag; `LLM(**kwargs)` and the CLI both fill this (names follow vLLM)."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: str | int | None = None  # bytes, or "4GiB"; default: a share of free memory
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: max(max_model_len, 2048)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"  # recompute | swap
    swap_space: float = 4.0  # GiB of host memory for swapped-out blocks (swap mode)
    attention_backend: str = "auto"
    disable_log_stats: bool = True
    # none | int8 | int4: weight-only quantized projections (CPU; kernels/csrc/quant_linear.cpp)
    quantization: str = "none"
    # Load a HF directory's pickle weights (pytorch_model.bin, *.pt) when it has no safetensors,
    # with torch.load(weights_only=True); refused by default, as a pickle can carry code.
    allow_pickle_checkpoints: bool = False
    # Run every step through the model's PyTorch modules: no fused C++ decoder (CPU decode steps)
    enforce_eager: bool = False
    # Ranks the model is split across (distributed/): this process and N - 1 it spawns
    tensor_parallel_size: int = 1
    # paged | max | pow2 | oracle: the pre-paging contiguous reservations, for benchmarks only
    kv_allocation: str = "paged"

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        parse_bytes(self.kv_cache_memory)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}"
            )
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                f"got {self.quantization!r}"
            )
        if self.kv_allocation not in KV_ALLOCATIONS:
            raise ValueError(
                f"kv_allocation must be one of {', '.join(KV_ALLOCATIONS)}, "
                f"got {self.kv_allocation!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not self.swap_space >= 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
