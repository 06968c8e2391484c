"""EngineArgs: every engine flag as the user gives it (to `LLM(...)` or the command line), and
the choice lists those flags take. `engine.arg_utils.create_engine_config` resolves them once
into an EngineConfig (engine_config.py) before anything is built."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass, field

from pagedllm.config.kv_events import KVEventsConfig
from pagedllm.config.speculative import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
# What the engine serves: generation, or embeddings (prefill-only requests, pooled);
# auto: pooling for a model that declares its pooling (a sentence-transformers directory).
RUNNERS = ("auto", "generate", "pooling")
QUANTIZATION_METHODS = ("auto", "none", "int8", "int4")
# vLLM's --kv-cache-dtype names; fp8 is e4m3. int8/fp8: one byte per value + a scale per row.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
ATTENTION_BACKENDS = ("auto", "cpu", "sdpa", "torch", "triton")
# The pre-paging contiguous reservations (core/contiguous_kv_cache_manager.py), for benchmarks.
CONTIGUOUS_POLICIES = ("max", "pow2", "oracle")
KV_ALLOCATIONS = ("paged", *CONTIGUOUS_POLICIES)
# How contiguous regions are placed: binary buddies, or the first free extent that fits.
KV_ALLOCATORS = ("buddy", "first-fit")
# Who starts the tensor-parallel ranks: processes spawned here (or by torchrun), or Ray actors.
EXECUTOR_BACKENDS = ("mp", "ray")


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


def _flag(default, help: str, **cli):
    """A field with its command-line flag (`--` + the name with dashes). Metadata: `help`;
    `choices`, the values validate() accepts; `short`, a second flag; `action`, how a boolean
    is spelled (argparse's). The CLI builds its engine group from it (entrypoints/cli.py);
    `to_cli_args` goes back."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineArgs:
    """Every engine flag; `LLM(**kwargs)` and the CLI both fill this (names follow vLLM)."""

    model: str | None = _flag(
        None,
        "GGUF file, Hugging Face directory, or a packaged model's short name "
        "(default: SmolLM2-135M-Instruct)",
    )
    tokenizer: str | None = _flag(None, "tokenizer directory if not the model's own")
    dtype: str = _flag(
        "auto",
        "float32 | bfloat16 | float16 | auto (bfloat16 on CUDA and on CPUs with bf16 "
        "instructions, else float32)",
        choices=DTYPES,
    )
    # Not checked here: torch.device() takes "cuda:1" too.
    device: str = _flag("auto", "cpu | cuda | auto")
    seed: int = _flag(0, "seed for random sampling")
    max_model_len: int | None = _flag(
        None, "context length (prompt + output); default: the model's"
    )
    block_size: int = _flag(16, "tokens per KV-cache block")
    kv_cache_dtype: str = _flag(
        "auto",
        "what the KV cache stores: auto (float16 beside integer products, else the model's "
        "dtype) | float32 | bfloat16 | float16 | int8 | fp8 (= fp8_e4m3) | fp8_e5m2; int8 and fp8 "
        "keep one byte per value and a float32 scale per token and KV head",
        choices=KV_CACHE_DTYPES,
    )
    # str first: the CLI keeps the text ("4GiB"), parse_bytes reads it
    kv_cache_memory: str | int | None = _flag(
        None, "KV cache size, in bytes or with a unit (e.g. 2GiB); default 4GiB on CPU"
    )
    gpu_memory_utilization: float = _flag(0.9, "share of GPU memory to use")
    num_gpu_blocks_override: int | None = _flag(
        None, "number of KV-cache blocks, overriding the memory budget"
    )
    max_num_seqs: int = _flag(256, "most requests in one batch")
    # default: max(2048, min(max_model_len, 8192))
    max_num_batched_tokens: int | None = _flag(
        None, "token budget of one step (prefill chunks + decodes)"
    )
    enable_chunked_prefill: bool = _flag(
        True, "split long prompts across steps", action=argparse.BooleanOptionalAction
    )
    enable_prefix_caching: bool = _flag(
        True,
        "reuse the KV blocks of prompt prefixes seen before",
        action=argparse.BooleanOptionalAction,
    )
    preemption_mode: str = _flag(
        "recompute",
        "recompute | swap: what happens to a preempted request's KV cache",
        choices=PREEMPTION_MODES,
    )
    scheduling_policy: str = _flag(
        "fcfs",
        "fcfs | priority: with priority, requests run by their priority (lower values first; "
        "vLLM's), arrival order within a level, and preemption takes the lowest first",
        choices=SCHEDULING_POLICIES,
    )
    runner: str = _flag(
        "auto",
        "auto | generate | pooling: pooling serves embeddings (/v1/embeddings, LLM.embed): each "
        "prompt is computed once and its hidden states pooled; auto picks pooling for a model "
        "that declares its pooling (a sentence-transformers directory)",
        choices=RUNNERS,
    )
    pooling_type: str | None = _flag(
        None,
        "LAST | MEAN | CLS: how the pooling runner turns a prompt's hidden states into one "
        "vector (default: the model's own pooling config, else LAST)",
        choices=("LAST", "MEAN", "CLS"),
    )
    swap_space: float = _flag(
        4.0,
        "GiB of CPU memory for swapped-out KV blocks (swap mode; at most the KV cache's size)",
    )
    # Not checked here: the attention selector does, after "auto" is resolved
    attention_backend: str = _flag("auto", "auto | cpu | sdpa | torch | triton")
    # No engine flag: `serve` has --disable-log-stats (there the stats are logged by default);
    # the CLI's engine_args_from picks it up from there.
    disable_log_stats: bool = True
    # Weight-only quantized projections (CPU; kernels/csrc/quant_linear.cpp)
    quantization: str = _flag(
        "auto",
        "auto | none | int8 | int4: int8 / int4 keep the projection weights quantized in memory "
        "(CPU kernels; GGUF Q4 / Q8_0 blocks taken as they are); auto (CPU) keeps a GGUF's "
        "Q4 / Q8_0 blocks beside the float weights for steps of a few rows; none: float only",
        choices=QUANTIZATION_METHODS,
        short="-q",
    )
    allow_pickle_checkpoints: bool = _flag(
        False,
        "load a directory's pytorch_model.bin / *.pt weights when it has no safetensors, with "
        "torch.load(weights_only=True) (refused by default: a pickle can carry code)",
        action="store_true",
    )
    # None: on where it is measured to cost little (docs/determinism.md)
    deterministic: bool | None = _flag(
        None,
        "batch-invariant inference: a request's tokens and logprobs do not depend on what else "
        "runs (the CPU kernels' fixed-order products and attention). Default: on in float32 on "
        "CPU and in bfloat16 on CPUs without bf16 instructions; off where bfloat16 is native "
        "(not measured there yet)",
        action=argparse.BooleanOptionalAction,
        short="--enable-deterministic-inference",
    )
    enforce_eager: bool = _flag(
        False,
        "always run the model's PyTorch modules: no fused C++ decoder for decode steps on CPU "
        "(it gives the same tokens, faster)",
        action="store_true",
    )
    # This process and N - 1 it spawns (distributed/)
    tensor_parallel_size: int = _flag(
        1,
        "split the model across this many processes (torch.distributed: gloo on CPU, NCCL on CUDA)",
        short="-tp",
    )
    # Several hosts (docs/distributed.md): each runs the same command with its --node-rank
    nnodes: int = _flag(1, "hosts the --tensor-parallel-size ranks are spread over (equally)")
    node_rank: int = _flag(
        0,
        "this host's number among --nnodes: 0 runs the engine (and the server); the others "
        "run their ranks only, and exit when the group ends",
    )
    master_addr: str | None = _flag(
        None,
        "where the ranks meet: node 0's address, reachable from every host (default: "
        "MASTER_ADDR, else 127.0.0.1)",
    )
    master_port: int | None = _flag(
        None, "node 0's port for the meeting (default: MASTER_PORT; required with --nnodes > 1)"
    )
    distributed_timeout: float = _flag(
        300.0,
        "seconds a collective inside a step (an all-reduce, the logits' gather) may wait for "
        "the other ranks before the step fails: a lost link or host fails the engine instead "
        "of hanging it (idle ranks wait for the next step without limit)",
    )
    distributed_executor_backend: str = _flag(
        "mp",
        "who starts ranks 1..N-1 of --tensor-parallel-size: mp (processes spawned here, or "
        "torchrun's) or ray (Ray actors in a placement group; pip install pagedllm[ray])",
        choices=EXECUTOR_BACKENDS,
    )
    ray_address: str | None = _flag(
        None,
        "the Ray cluster to join with --distributed-executor-backend ray (default: RAY_ADDRESS, "
        "else a running local cluster, else a new one in this process)",
    )
    # Replicas of the whole engine behind one server (engine/dp_client.py)
    data_parallel_size: int = _flag(
        1,
        "engine replicas (each its own process and KV cache) behind this server, requests "
        "spread by load with prefix-cache affinity; with --data-parallel-rank: the size of the "
        "group this server is one replica of",
        short="-dp",
    )
    data_parallel_rank: int | None = _flag(
        None,
        "external load balancing: this server is replica K of --data-parallel-size, alone "
        "behind its endpoint (a router spreads the load); metrics and KV events say K",
    )
    data_parallel_size_local: int | None = _flag(
        None,
        "replicas on this host, which share its CPU cores (default: --data-parallel-size "
        "behind one server, 1 with --data-parallel-rank)",
    )
    # JSON text on the command line, a dict from LLM(...) (config/speculative.py)
    speculative_config: str | dict | None = _flag(
        None,
        'speculative decoding, as JSON: {"method": "ngram" | "suffix" | "draft_model", '
        '"num_speculative_tokens": k, ...} (docs/speculative_decoding.md)',
    )
    # JSON text on the command line, a dict from LLM(...) (config/kv_events.py)
    kv_events_config: str | dict | None = _flag(
        None,
        "publish the prefix cache's changes for KV-aware routers, as JSON: "
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", ...} (docs/distributed.md)',
    )
    # Multi-LoRA (docs/lora.md): adapters in slots beside the base weights
    enable_lora: bool = _flag(
        False, "serve LoRA adapters (PEFT directories, GGUF LoRA files)", action="store_true"
    )
    max_loras: int = _flag(1, "LoRA adapters resident at once (slots; one step mixes them)")
    max_lora_rank: int = _flag(16, "the largest LoRA rank an adapter may have")
    max_cpu_loras: int | None = _flag(
        None, "LoRA adapters kept loaded in host memory (an LRU; default: --max-loras)"
    )
    kv_allocation: str = _flag(
        "paged",
        "paged | max | pow2 | oracle: paged blocks, or one contiguous region per request sized "
        "as pre-paging systems did (benchmarks only)",
        choices=KV_ALLOCATIONS,
    )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def to_cli_args(self) -> list[str]:
        """The command-line flags that rebuild these args: those whose values differ from the
        defaults, in field order (fields without a flag left out)."""
        defaults = EngineArgs()
        argv: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if "help" not in f.metadata or value is None or value == getattr(defaults, f.name):
                continue
            flag = "--" + f.name.replace("_", "-")
            action = f.metadata.get("action")
            if action is None:
                argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
            elif value:
                argv.append(flag)
            elif action is argparse.BooleanOptionalAction:
                argv.append("--no-" + flag[2:])
        return argv

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
        if self.pooling_type is not None:
            self.pooling_type = self.pooling_type.upper()
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices is not None and value is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}, got {value!r}")
        parse_bytes(self.kv_cache_memory)
        SpeculativeConfig.parse(self.speculative_config)
        KVEventsConfig.parse(self.kv_events_config)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}"
            )
        if self.nnodes > 1:
            if self.tensor_parallel_size % self.nnodes:
                raise ValueError(
                    f"--nnodes {self.nnodes} must divide --tensor-parallel-size "
                    f"{self.tensor_parallel_size} (each host runs the same number of ranks)"
                )
            if self.master_port is None and "MASTER_PORT" not in os.environ:
                raise ValueError(
                    "--nnodes > 1 needs --master-port (or MASTER_PORT): a port on node 0 that "
                    "every host can reach"
                )
        if not self.distributed_timeout > 0:
            raise ValueError(
                f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout}"
            )
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        rank = self.data_parallel_rank
        if rank is not None and not 0 <= rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank must be in [0, data_parallel_size={self.data_parallel_size}), "
                f"got {rank}"
            )
        if self.data_parallel_size_local is not None and self.data_parallel_size_local < 1:
            raise ValueError(
                f"data_parallel_size_local must be >= 1, got {self.data_parallel_size_local}"
            )
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(
                f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and "
                f"{self.max_lora_rank}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if not self.swap_space >= 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
