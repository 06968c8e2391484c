"""A worker: one rank of the model. It takes its device and its share of the cores, builds its
shard of the model through the loader, sizes its KV cache from the memory budget and allocates
it, and runs steps through its model runner. Rank 0's worker lives in the engine's process;
the others replay rank 0's step messages (`run_steps`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from pagedllm.attention import kv_quant
from pagedllm.attention.selector import resolve_backend_name
from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedllm.core.kv_cache_spec import KVCacheSpec
from pagedllm.cpu_info import available_cpus
from pagedllm.distributed import step_channel
from pagedllm.layers.linear import warm_packed_products
from pagedllm.model_loader.build import build_model
from pagedllm.model_loader.loader import load_draft_model_config
from pagedllm.models.fused_decoder import fuse
from pagedllm.spec_decode import Proposer, make_proposer
from pagedllm.worker.drafter import DraftModelProposer
from pagedllm.worker.lora_manager import LoRAManager
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")


def same_pool(a: tuple[CacheConfig, SchedulerConfig], b: tuple[CacheConfig, SchedulerConfig]):
    """Whether two (cache, scheduler) configs size the same KV pool (the block manager's
    policy and prefix caching do not change it)."""
    (cache_a, sched_a), (cache_b, sched_b) = a, b
    neutral = {"kv_allocation": "paged", "enable_prefix_caching": True}
    return (
        dataclasses.replace(cache_a, **neutral) == dataclasses.replace(cache_b, **neutral)
        and sched_a == sched_b
    )


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = torch.device(config.device.device)
        self.dtype = kv_quant.FLOAT_DTYPES[config.model.dtype]
        self.model: torch.nn.Module | None = None
        self.model_runner: ModelRunner | None = None
        self.weight_bytes = 0
        self.attention_backend = config.device.attention_backend
        self.num_gpu_blocks = self.num_cpu_blocks = 0
        self._cache_configs: tuple[CacheConfig, SchedulerConfig] | None = None
        self.draft_model: torch.nn.Module | None = None  # speculative decoding's draft_model
        self.draft_model_config: ModelConfig | None = None
        self.lora: LoRAManager | None = None  # --enable-lora: the adapters' slots
        # The decoder stacks as one C++ call (models/fused_decoder.py), where they fuse.
        self.fused = self.draft_fused = None

    def init_device(self) -> None:
        """The seed, this rank's share of the CPU cores, and its GPU (one per rank)."""
        torch.manual_seed(self.config.model.seed)
        tp_size = self.config.parallel.tensor_parallel_size
        if self.device.type == "cpu":
            ranks_here = self.config.parallel.processes_per_node
            ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", ranks_here))  # torchrun's
            cores = max(1, available_cpus() // ranks_here)  # each rank its share of the cores
            if torch.get_num_threads() > cores:
                # More compute threads than cores: OpenMP's barriers wait on descheduled threads.
                torch.set_num_threads(cores)
            logger.info("torch threads: %d (cores available: %d)", torch.get_num_threads(), cores)
        elif self.device.type == "cuda" and tp_size > 1:
            local_rank = self.rank % self.config.parallel.ranks_per_node
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", local_rank)))
            torch.cuda.set_device(self.device)

    def load_model(self) -> None:
        self.attention_backend = resolve_backend_name(
            self.config.device.attention_backend, self.device
        )
        built = build_model(
            self.config.model, self.config.load, self.device, self.attention_backend
        )
        self.model, self.weight_bytes = built.model, built.weight_bytes
        if self.config.lora is not None:
            self.lora = LoRAManager(
                self.model, self.config.lora, self.config.model.arch, self.dtype, self.device
            )
            self.weight_bytes += self.lora.slot_bytes
            logger.info("LoRA: %d slots of rank %d, %.0f MiB",
                        self.config.lora.max_loras, self.config.lora.max_lora_rank,
                        self.lora.slot_bytes / 2**20)  # fmt: skip
        self.fused = self._fuse(self.model)  # after the LoRA slots: it takes theirs too
        spec = self.config.speculative
        if spec is not None and spec.method == "draft_model" and self.rank == 0:
            self.draft_model_config = self._draft_model_config(spec)
            draft = build_model(
                self.draft_model_config, self.config.load, self.device, self.attention_backend
            )
            self.draft_model = draft.model
            self.draft_fused = self._fuse(draft.model)
            self.weight_bytes += draft.weight_bytes
            logger.info("draft model: %s (%s), %.0f MiB of weights",
                        self.draft_model_config.name, self.draft_model_config.quantization,
                        draft.weight_bytes / 2**20)  # fmt: skip

    def _fuse(self, model):
        """Decode steps through the fused C++ decoder where the model allows it (CPU)."""
        if self.config.model.enforce_eager or self.device.type != "cpu":
            return None
        return fuse(model)

    def _draft_model_config(self, spec) -> ModelConfig:
        """The draft's model config: the target's, with the draft's weights."""
        m = self.config.model
        if spec.model is None:
            arch, name = m.arch, m.name
        else:
            arch, name = load_draft_model_config(spec.model, m.arch), spec.model
        return dataclasses.replace(m, model=spec.model or m.model, tokenizer=None, name=name,
                                   arch=arch, quantization=spec.draft_quantization)  # fmt: skip

    # -- the KV cache ---------------------------------------------------------------------------
    def prepare_cache(self, cache: CacheConfig, scheduler: SchedulerConfig) -> bool:
        """A runner for `cache`'s block size, then `num_kv_blocks` and `initialize_cache`; or
        False if the pool it has already fits these configs (another engine takes it over: the
        runner forgets the requests of the one before)."""
        if self._cache_configs is not None and same_pool(self._cache_configs, (cache, scheduler)):
            self._cache_configs = (cache, scheduler)
            self.model_runner.forget_requests()
            return False
        self._cache_configs = (cache, scheduler)
        if self.model_runner is not None:
            self.model_runner.kv_cache = None  # free the old pool before sizing the new one
        m = self.config.model
        cache_dtype = kv_quant.storage_dtype(cache.cache_dtype)
        if self.attention_backend == "triton" and cache_dtype != self.dtype:
            raise ValueError(
                f"--kv-cache-dtype {cache.cache_dtype} is not supported by the 'triton' attention "
                f"backend (its caches hold the model's dtype, {m.dtype}): use --attention-backend "
                "sdpa, or --kv-cache-dtype auto"
            )
        self.model_runner = ModelRunner(
            self.model, m.arch, cache.block_size, self.device, cache_dtype, seed=m.seed,
            attention_backend=self.attention_backend, proposer=self._proposer(cache, cache_dtype),
            lora=self.lora, fused=self.fused,
        )  # fmt: skip
        self._warm_packed_products(scheduler)
        return True

    def _warm_packed_products(self, scheduler: SchedulerConfig) -> None:
        """oneDNN's primitives for every step size this pool's steps can have (bfloat16 on CPU):
        made now, not as new sizes come under load (layers/linear.py)."""
        spec = self.config.speculative
        logits_rows = scheduler.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
        start, n, max_rows = time.perf_counter(), 0, scheduler.max_num_batched_tokens
        for model in (self.model, self.draft_model):
            if model is not None:
                n += warm_packed_products(model, max_rows, getattr(model, "lm_head", None),
                                          logits_rows)  # fmt: skip
        if n:
            logger.info("packed products: %d shapes made ready in %.1f s", n,
                        time.perf_counter() - start)  # fmt: skip

    def _proposer(self, cache: CacheConfig, cache_dtype: torch.dtype) -> Proposer | None:
        """Speculative decoding's proposer (rank 0 proposes, every rank verifies)."""
        spec = self.config.speculative
        if self.rank != 0 or spec is None:
            return None
        if spec.method != "draft_model":
            return make_proposer(spec)
        runner = ModelRunner(
            self.draft_model, self.draft_model_config.arch, cache.block_size, self.device,
            cache_dtype, attention_backend=self.attention_backend, fused=self.draft_fused,
        )  # fmt: skip
        return DraftModelProposer(spec, runner, self.config.model.max_model_len)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return self.model_runner.kv_cache_spec

    @property
    def state_bytes(self) -> int:
        """A hybrid model's recurrent state, a slot per sequence the scheduler may run and the
        prefix cache's checkpoints of it: taken from the KV cache's memory budget first."""
        config = self.model_runner.config
        if not config.num_recurrent_layers:
            return 0
        cache, sched = self._cache_configs
        return (sched.max_num_seqs + cache.num_state_checkpoints) * config.recurrent_state_bytes(
            self.model_runner.model.dtype.itemsize
        )

    def num_kv_blocks(self) -> int:
        """Blocks of this rank's pool: the memory budget (profiled on a GPU) or the override;
        a ValueError if it cannot hold one request of max_model_len at its peak."""
        cache, sched = self._cache_configs
        spec = self.kv_cache_spec
        bytes_per_block = spec.bytes_per_block
        proposer = self.model_runner.proposer
        if isinstance(proposer, DraftModelProposer):  # as many blocks again, for the draft
            bytes_per_block += proposer.bytes_per_block
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
        else:
            budget = cache.kv_cache_memory
            budget = self._profile_cuda_kv_budget() if budget is None else budget
            num_blocks = max(0, budget - self.state_bytes) // bytes_per_block
        # A request's blocks while decoding, and at its peak (a prefill chunk on top of a
        # sliding window): the pool must hold one request at its peak.
        max_len = sched.max_model_len
        blocks_per_request = spec.max_num_blocks(max_len)
        peak = spec.max_num_blocks(max_len, chunk=sched.max_num_batched_tokens)
        stored = cache.cache_dtype + (" + a scale per row" if spec.scale_bytes else "")
        logger.info(
            "KV cache: %d blocks of %d tokens x %d layers, %.2f GiB of %s (%s); "
            "a %d-token request holds %d blocks (%.1f MiB): maximum concurrency %.2fx",
            num_blocks, cache.block_size, spec.group_size, num_blocks * bytes_per_block / 2**30,
            stored, spec.describe(), max_len, blocks_per_request,
            blocks_per_request * bytes_per_block / 2**20, num_blocks / blocks_per_request,
        )  # fmt: skip
        arch = self.model_runner.config
        if self.state_bytes:
            logger.info(
                "%s state: %d slots (max_num_seqs) + %d prefix-caching checkpoints x %d layers, "
                "%.1f MiB of the KV cache's memory", arch.recurrent_kind, sched.max_num_seqs,
                cache.num_state_checkpoints, arch.num_recurrent_layers, self.state_bytes / 2**20,
            )  # fmt: skip
        if num_blocks < peak:
            raise_to = (
                f"--num-gpu-blocks-override to at least {peak}"
                if cache.num_gpu_blocks_override is not None
                else "--kv-cache-memory to at least "
                f"{-(-(peak * bytes_per_block + self.state_bytes) // 2**20)}MiB"
            )
            checkpoints = cache.num_state_checkpoints > 0
            saved = f" and {cache.num_state_checkpoints} prefix-caching checkpoints" * checkpoints
            state = (
                f" (the {arch.recurrent_kind} state of --max-num-seqs {sched.max_num_seqs} "
                f"sequences{saved} takes "
                f"{self.state_bytes / 2**20:.1f} MiB of it: or lower --max-num-seqs"
                f"{' or --no-enable-prefix-caching' * checkpoints})"
                if self.state_bytes and cache.num_gpu_blocks_override is None
                else ""
            )
            raise ValueError(
                f"the KV cache has {num_blocks} blocks, less than one request of max_model_len "
                f"{max_len} needs ({peak}): raise {raise_to} or lower --max-model-len{state}"
            )
        return num_blocks

    def num_swap_blocks(self, num_blocks: int) -> int:
        """Blocks of swap space: --swap-space GiB, never more than the KV cache itself (a
        preempted group never holds more than the whole pool); none unless preemption swaps."""
        cache, sched = self._cache_configs
        if sched.preemption_mode != "swap":
            return 0
        bytes_per_block = self.kv_cache_spec.bytes_per_block
        num_cpu_blocks = min(cache.swap_space_bytes // bytes_per_block, num_blocks)
        logger.info(
            "swap space: %d blocks, %.2f GiB of CPU memory (preemption mode: swap)",
            num_cpu_blocks, num_cpu_blocks * bytes_per_block / 2**30,
        )  # fmt: skip
        if num_cpu_blocks == 0:
            logger.warning("swap space is empty: every preemption will recompute")
        elif self.state_bytes:  # besides --swap-space: a bound of its own (state_pool.py)
            per_seq = self.state_bytes // (sched.max_num_seqs + cache.num_state_checkpoints)
            logger.info(
                "recurrent state stash: up to %d swapped-out sequences, %.1f MiB of CPU memory "
                "at most", sched.max_stashed_seqs, sched.max_stashed_seqs * per_seq / 2**20,
            )  # fmt: skip
        return num_cpu_blocks

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.num_gpu_blocks, self.num_cpu_blocks = num_blocks, num_cpu_blocks
        cache, sched = self._cache_configs
        self.model_runner.initialize_kv_cache(
            num_blocks, num_cpu_blocks, sched.max_num_seqs, cache.num_state_checkpoints
        )
        if isinstance(self.model_runner.proposer, DraftModelProposer):
            self.model_runner.proposer.initialize_kv_cache(num_blocks)

    def _profile_cuda_kv_budget(self) -> int:
        """What gpu_memory_utilization x total leaves after the peak of a forward pass over a
        full token budget (weights + activations) and memory held outside torch."""
        cache, sched = self._cache_configs
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.model_runner.profile_run(sched.max_num_batched_tokens, sched.max_num_seqs)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        return max(0, int(total * cache.gpu_memory_utilization) - peak - used_outside_torch)

    # -- steps ------------------------------------------------------------------------------
    def execute_model(self, scheduler_output, send=None):
        return self.model_runner.execute_model(scheduler_output, send)

    def run_steps(self) -> None:
        """Ranks other than 0: run rank 0's step messages until it says shutdown."""
        while (step := step_channel.receive()) is not None:
            self.model_runner.execute(step)
