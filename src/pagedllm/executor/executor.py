"""The executor: who runs the workers (the ranks of the model) and how a step reaches them. The
engine sees only this interface (pagedllm.executor.create_executor picks the kind)."""

from __future__ import annotations

from pagedllm.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedllm.core.kv_cache_spec import KVCacheSpec
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.worker.worker import Worker


class Executor:
    """Built with the model loaded and the KV cache sized and allocated on every rank."""

    driver_worker: Worker  # rank 0, in this process: it samples
    owner: object = None  # the engine whose KV cache the workers hold now

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def initialize_cache(self, cache: CacheConfig, scheduler: SchedulerConfig) -> None:
        """Size and allocate every rank's KV cache for these configs (kept if it already is)."""
        raise NotImplementedError

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def dead(self, wait: float = 0.0) -> str | None:
        """Why the group is broken (a rank exited), or None; waiting up to `wait` seconds for a
        rank that is exiting to be gone."""
        return None

    def check_health(self) -> None:
        """Raise RuntimeError if a rank is gone: the engine cannot step without it."""
        if (why := self.dead()) is not None:
            raise RuntimeError(f"{why}: the engine cannot step")

    def shutdown(self) -> None:
        """Stop the other ranks, if any (idempotent)."""

    # -- what the engine reads ------------------------------------------------------------------
    @property
    def num_gpu_blocks(self) -> int:
        return self.driver_worker.num_gpu_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.driver_worker.num_cpu_blocks

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Rank 0's (every rank has the same groups and block ids; heads may differ)."""
        return self.driver_worker.kv_cache_spec

    def block_move_counts(self) -> dict[str, int]:
        """Blocks copied (copy-on-write), swapped out and swapped in so far, on rank 0."""
        kv = self.driver_worker.model_runner.kv_cache
        return {
            "num_copied_blocks": kv.num_copied_blocks,
            "num_swapped_out_blocks": kv.num_swapped_out_blocks,
            "num_swapped_in_blocks": kv.num_swapped_in_blocks,
        }
