"""One worker, in this process."""

from __future__ import annotations

from pagedllm.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.executor.executor import Executor
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.driver_worker = Worker(config)
        self.driver_worker.init_device()
        self.driver_worker.load_model()
        self.initialize_cache(config.cache, config.scheduler)

    def initialize_cache(self, cache: CacheConfig, scheduler: SchedulerConfig) -> None:
        """Another engine may reuse this executor's model with other cache settings (a
        benchmark's block sizes): the pool is rebuilt for them, the model stays."""
        worker = self.driver_worker
        if worker.prepare_cache(cache, scheduler):
            num_blocks = worker.num_kv_blocks()
            worker.initialize_cache(num_blocks, worker.num_swap_blocks(num_blocks))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(scheduler_output)
