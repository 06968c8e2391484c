"""Executors: who runs the workers, one in this process or a tensor-parallel group of
processes, behind one interface (executor.Executor)."""

from pagedllm.config import EngineConfig
from pagedllm.executor.executor import Executor


def create_executor(config: EngineConfig) -> Executor:
    """The executor the config asks for, with the model loaded and the KV cache allocated.

    With one rank there is nothing to start, whatever --distributed-executor-backend says: the
    worker runs in this process (ray too, which would only add a cluster to start)."""
    parallel = config.parallel
    if parallel.tensor_parallel_size > 1 and parallel.distributed_executor_backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    if parallel.tensor_parallel_size > 1:
        from pagedllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from pagedllm.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)


__all__ = ["Executor", "create_executor"]
