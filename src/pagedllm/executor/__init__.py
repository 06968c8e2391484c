"""Executors: who runs the workers, one in this process or a tensor-parallel group of
processes, behind one interface (executor.Executor)."""

from pagedllm.config import EngineConfig
from pagedllm.executor.executor import Executor


def create_executor(config: EngineConfig) -> Executor:
    """The executor the config asks for, with the model loaded and the KV cache allocated."""
    if config.parallel.tensor_parallel_size > 1:
        from pagedllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from pagedllm.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)


__all__ = ["Executor", "create_executor"]
