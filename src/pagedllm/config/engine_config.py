"""EngineConfig: the user's EngineArgs resolved once, before anything is built, into the parts
each layer reads (as vLLM's VllmConfig): the model, the KV cache, the scheduler, parallelism,
the device and loading. Every default that depends on the model or the machine ("auto" dtype and
device, max_model_len, the token budget, the CPU's KV pool size) is decided here, so that no
later part decides it again. Torch-free: the caller detects the device and its dtype."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagedllm.config.engine_args import EngineArgs, parse_bytes
from pagedllm.config.kv_events import KVEventsConfig
from pagedllm.config.model_arch import ModelArchConfig
from pagedllm.config.speculative import SpeculativeConfig

# Like vLLM's CPU backend: a 4 GiB KV pool unless told otherwise (a GPU's is profiled).
DEFAULT_CPU_KV_CACHE_MEMORY = 4 << 30
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class ModelConfig:
    model: str | None  # as given: a path, a short name, a hub id; None is the default model
    tokenizer: str | None  # another tokenizer, or None for the model's own
    name: str  # how the model is called in logs and (by default) in the API
    arch: ModelArchConfig
    dtype: str  # the weights' and the KV cache's: "float32", "bfloat16" or "float16"
    max_model_len: int
    seed: int
    quantization: str  # auto | none | int8 | int4 | int8_act (the integer default on CPU)
    enforce_eager: bool
    # Batch invariant: the CPU kernels' fixed-order products and attention (docs/determinism.md)
    deterministic: bool = False
    runner: str = "generate"  # or "pooling": embeddings only (--runner)
    pooling_type: str = "LAST"  # the pooling runner's: LAST | MEAN | CLS


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    # What the pool stores: a float dtype name, or int8 / fp8_e4m3 / fp8_e5m2 codes with scales
    # ("auto" resolved to the model's dtype, "fp8" to fp8_e4m3).
    cache_dtype: str
    # Bytes of the KV pool; None on a GPU without --kv-cache-memory: profiled at start-up.
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    num_gpu_blocks_override: int | None
    swap_space_bytes: int  # host memory for swapped-out blocks; 0 unless preemption swaps
    enable_prefix_caching: bool
    kv_allocation: str  # paged | max | pow2 | oracle
    # A hybrid model's prefix caching: checkpoints of the recurrent state at prompts' last full
    # block (core/state_checkpoints.py), up to max_num_seqs of them in a quarter of the KV
    # memory (_hybrid_states); 0 for other models or without prefix caching.
    num_state_checkpoints: int = 0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    # LoRA adapters a step may mix (their requests are admitted while slots allow); 0: no LoRA
    max_loras: int = 0
    # "fcfs", or "priority": requests ordered by (priority, arrival), lower priority values first
    policy: str = "fcfs"
    # Hybrid models, preemption by swap: the most sequences swapped out at once, each one's
    # recurrent state in the runner's host stash (worker/state_pool.py); a group past it is
    # preempted by recompute. None: no state to stash, the swap space alone bounds swapping.
    max_stashed_seqs: int | None = None


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int  # slots: adapters resident at once
    max_lora_rank: int
    max_cpu_loras: int  # adapters kept loaded in host memory (LRU), >= max_loras


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    nnodes: int = 1  # hosts, each with tensor_parallel_size // nnodes ranks
    node_rank: int = 0
    master_addr: str | None = None  # where the ranks meet (None: MASTER_ADDR or spawned here)
    master_port: int | None = None
    distributed_timeout: float = 300.0  # seconds a collective in a step may wait
    distributed_executor_backend: str = "mp"  # mp | ray: who starts ranks 1..N-1
    ray_address: str | None = None
    data_parallel_size: int = 1  # replicas of the engine (behind this server or a router)
    data_parallel_rank: int = 0  # this engine's replica number (metrics, KV events)
    data_parallel_size_local: int = 1  # replicas sharing this host's cores

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def processes_per_node(self) -> int:
        """Processes of this host that compute: its ranks of every local replica."""
        return self.ranks_per_node * self.data_parallel_size_local

    def node_ranks(self) -> range:
        """The ranks this host runs."""
        per = self.ranks_per_node
        return range(self.node_rank * per, (self.node_rank + 1) * per)


@dataclass(frozen=True)
class DeviceConfig:
    device: str  # "cpu" or "cuda" ("auto" resolved)
    attention_backend: str  # as asked for; the worker resolves "auto" for its device


@dataclass(frozen=True)
class LoadConfig:
    allow_pickle_checkpoints: bool = False


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    load: LoadConfig
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None
    kv_events: KVEventsConfig | None = None  # --kv-events-config, when enabled

    @classmethod
    def resolve(
        cls,
        args: EngineArgs,
        arch: ModelArchConfig,
        name: str,
        device: str,
        auto_dtype: str,
        native_bf16: bool = True,
    ) -> EngineConfig:
        """`args` (validated here) for a model of architecture `arch` called `name`, on
        `device` ("cpu" or "cuda"), where --dtype auto means `auto_dtype`; `native_bf16`:
        whether the CPU has bf16 instructions."""
        args.validate()
        if arch.is_encoder:
            _check_encoder(args)
        hybrid = arch.num_recurrent_layers > 0
        if hybrid:
            _check_hybrid(args)
        max_model_len = _max_model_len(args.max_model_len, arch.max_position_embeddings)
        budget = args.max_num_batched_tokens or max(2048, min(max_model_len, 8192))
        # An encoder's prompt runs whole in one step: no chunks, no cached prefix (its
        # attention reads this step's tokens only).
        chunked_prefill = args.enable_chunked_prefill and not arch.is_encoder
        # A hybrid model's cached prefix needs its recurrent state at the prefix's end: it
        # keeps checkpoints of it (counted in its memory below).
        prefix_caching = args.enable_prefix_caching and not arch.is_encoder
        if not chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than max_model_len "
                f"({max_model_len}) with chunked prefill disabled: raise "
                "--max-num-batched-tokens, lower --max-model-len, or enable chunked prefill"
            )
        kv_cache_memory = parse_bytes(args.kv_cache_memory)
        if kv_cache_memory is None and arch.is_encoder:
            # Blocks only bound a step's tokens (the encoder reads none back): one step's
            # worth, at float32's 4 bytes a value (no dtype takes more)
            per_token = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * 4
            kv_cache_memory = (budget + args.max_num_seqs * args.block_size) * per_token
        if kv_cache_memory is None and device == "cpu":
            kv_cache_memory = DEFAULT_CPU_KV_CACHE_MEMORY
        preemption_mode = args.preemption_mode
        swap = int(args.swap_space * 2**30) if preemption_mode == "swap" else 0
        integer = _integer_products(args, arch, device)
        dtype = auto_dtype if args.dtype == "auto" else _DTYPE_NAMES.get(args.dtype, args.dtype)
        if integer:  # the activations between the integer products: float32 (docs/numerics.md)
            dtype = "float32"
        max_num_seqs, num_checkpoints = args.max_num_seqs, 0
        if hybrid:
            max_num_seqs, num_checkpoints = _hybrid_states(
                args, arch, kv_cache_memory, dtype, prefix_caching
            )
        return cls(
            model=ModelConfig(
                args.model,
                args.tokenizer,
                name,
                arch,
                dtype,
                max_model_len,
                args.seed,
                "int8_act" if integer else args.quantization,
                args.enforce_eager,
                _deterministic(
                    args.deterministic, dtype, device, args.attention_backend, native_bf16
                ),
                _runner(args.runner, arch),
                args.pooling_type or arch.pooling_type or ("CLS" if arch.is_encoder else "LAST"),
            ),  # fmt: skip
            cache=CacheConfig(
                args.block_size,
                _cache_dtype(args.kv_cache_dtype, "float16" if integer else dtype),
                kv_cache_memory,
                args.gpu_memory_utilization,
                args.num_gpu_blocks_override,
                swap,
                prefix_caching,
                args.kv_allocation,
                num_checkpoints,
            ),  # fmt: skip
            scheduler=SchedulerConfig(
                max_num_seqs,
                budget,
                max_model_len,
                chunked_prefill,
                preemption_mode,
                args.max_loras if args.enable_lora else 0,
                args.scheduling_policy,
                # A swapped-out hybrid sequence's recurrent state waits in a host stash of its
                # own bound, max_num_seqs states (at most the device's state pool again), not
                # counted against --swap-space, which holds the K/V blocks only.
                max_num_seqs if hybrid and preemption_mode == "swap" else None,
            ),  # fmt: skip
            parallel=ParallelConfig(
                args.tensor_parallel_size,
                args.nnodes,
                args.node_rank,
                args.master_addr,
                args.master_port,
                args.distributed_timeout,
                args.distributed_executor_backend,
                args.ray_address,
                args.data_parallel_size,
                args.data_parallel_rank or 0,
                args.data_parallel_size_local or 1,
            ),
            device=DeviceConfig(device, args.attention_backend),
            load=LoadConfig(args.allow_pickle_checkpoints),
            speculative=_speculative(args),
            lora=_lora(args),
            kv_events=KVEventsConfig.parse(args.kv_events_config),
        )


def _integer_products(args: EngineArgs, arch: ModelArchConfig, device: str) -> bool:
    """The default for a GGUF's codes on CPU (--dtype auto, --quantization auto): multiplied on
    the codes with 8-bit activations in integers. An explicit --dtype keeps float products on
    the dequantized codes (float32: exact against transformers)."""
    return (
        args.dtype == "auto"
        and args.quantization == "auto"
        and device == "cpu"
        and arch.quantized_codes
        and not arch.is_encoder
    )


def _runner(runner: str, arch: ModelArchConfig) -> str:
    """--runner auto: pooling for an encoder or a model that declares its pooling, else
    generation."""
    if runner != "auto":
        return runner
    return "pooling" if arch.pooling_type is not None or arch.is_encoder else "generate"


def _check_encoder(args: EngineArgs) -> None:
    """What an encoder (BERT) cannot do here, refused with the reason."""
    refused = {
        "--runner generate (an encoder only embeds: use --runner pooling)":
            args.runner == "generate",
        "--tensor-parallel-size > 1": args.tensor_parallel_size > 1,
        "--enable-lora": args.enable_lora,
        "--speculative-config": args.speculative_config is not None,
        f"--kv-allocation {args.kv_allocation}": args.kv_allocation != "paged",
    }  # fmt: skip
    for what, asked in refused.items():
        if asked:
            raise ValueError(f"encoder models (BERT) run on one rank with paged blocks: {what}")


def _hybrid_states(
    args: EngineArgs, arch: ModelArchConfig, kv_cache_memory: int | None, dtype: str,
    prefix_caching: bool,
) -> tuple[int, int]:  # fmt: skip
    """(max_num_seqs, prefix-caching checkpoints) of a hybrid model, whose recurrent state per
    sequence is tens of MiB at 1B and up. By default (max_num_seqs left at 256) as many
    sequences as half the KV memory holds; an explicit --max-num-seqs is kept (and refused at
    start if it leaves no room for a request's blocks). Checkpoints, with prefix caching: up
    to max_num_seqs in a quarter of the KV memory (a quarter of max_num_seqs where the memory
    is profiled later, on a GPU), at least one, so that blocks keep the rest."""
    state = arch.recurrent_state_bytes(2 if dtype in ("bfloat16", "float16") else 4)
    default = EngineArgs.__dataclass_fields__["max_num_seqs"].default
    max_num_seqs = args.max_num_seqs
    if args.max_num_seqs == default and kv_cache_memory is not None:
        fit = max(1, kv_cache_memory // 2 // state)
        if fit < args.max_num_seqs:
            logging.getLogger("pagedllm").info(
                "max_num_seqs %d for this hybrid model: each sequence's %s state takes %.1f "
                "MiB, and %d of them fill half of the KV cache's memory (--kv-cache-memory, "
                "--max-num-seqs to change)", fit, arch.recurrent_kind, state / 2**20, fit,
            )  # fmt: skip
            max_num_seqs = fit
    if not prefix_caching:
        return max_num_seqs, 0
    if kv_cache_memory is None:
        return max_num_seqs, max(1, max_num_seqs // 4)
    return max_num_seqs, max(1, min(max_num_seqs, kv_cache_memory // 4 // state))


def _check_hybrid(args: EngineArgs) -> None:
    """What a hybrid model (recurrent layers: a state per sequence) cannot do yet:
    drafts that may be rejected (the state cannot step back), and its layers on several ranks."""
    refused = {
        "--speculative-config": args.speculative_config is not None,
        "--tensor-parallel-size > 1": args.tensor_parallel_size > 1,
        f"--kv-allocation {args.kv_allocation}": args.kv_allocation != "paged",
    }
    for what, asked in refused.items():
        if asked:
            raise ValueError(f"hybrid models (recurrent layers) do not support {what} yet")


def _lora(args: EngineArgs) -> LoRAConfig | None:
    if not args.enable_lora:
        return None
    if args.kv_allocation != "paged":
        raise ValueError(f"--enable-lora needs --kv-allocation paged, got {args.kv_allocation}")
    max_cpu = args.max_loras if args.max_cpu_loras is None else args.max_cpu_loras
    return LoRAConfig(args.max_loras, args.max_lora_rank, max_cpu)


def _deterministic(
    asked: bool | None, dtype: str, device: str, backend: str, native_bf16: bool
) -> bool:
    """--deterministic: asked, or by default where it was measured to cost little: float32 on
    CPU, and bfloat16 on CPUs without bf16 instructions (there the fast path's GEMMs are
    emulated: the fixed-order kernels are faster, docs/determinism.md). The batch-invariant
    kernels are the CPU ones, in float32 and bfloat16."""
    cpu_kernels = device == "cpu" and backend in ("auto", "cpu")
    if asked is None:
        emulated_bf16 = dtype == "bfloat16" and not native_bf16
        return cpu_kernels and (dtype == "float32" or emulated_bf16)
    if asked and not (cpu_kernels and dtype in ("float32", "bfloat16")):
        raise ValueError(
            "--deterministic needs the CPU attention kernels (device cpu, attention backend "
            f"auto or cpu) and float32 or bfloat16; got device {device}, attention backend "
            f"{backend}, dtype {dtype}"
        )
    return asked


def _speculative(args: EngineArgs) -> SpeculativeConfig | None:
    config = SpeculativeConfig.parse(args.speculative_config)
    if config is not None and args.kv_allocation != "paged":
        raise ValueError(
            f"--speculative-config needs --kv-allocation paged (rejected drafts give their "
            f"blocks back), got {args.kv_allocation}"
        )
    if config is not None and config.method == "draft_model" and args.tensor_parallel_size > 1:
        raise ValueError(
            "--speculative-config: draft_model runs its draft on rank 0 alone; it needs "
            f"--tensor-parallel-size 1, got {args.tensor_parallel_size}"
        )
    return config


def _cache_dtype(asked: str, default: str) -> str:
    """--kv-cache-dtype auto: the model's dtype, but float16 beside the integer products (as
    llama.cpp's default: half float32's bytes, far closer than the 8-bit activations)."""
    if asked == "auto":
        return default
    return {"fp8": "fp8_e4m3"}.get(asked, asked)


def _max_model_len(asked: int | None, limit: int) -> int:
    if asked is None:
        return limit
    if asked > limit:
        raise ValueError(
            f"max_model_len {asked} exceeds the model's context length {limit}: lower "
            "--max-model-len"
        )
    return asked
