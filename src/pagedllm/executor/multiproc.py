"""A tensor-parallel group of processes on torch.distributed: rank 0 is the engine's own
process (the scheduler, the KV block manager, sampling, the server); ranks 1..N-1 are processes
it spawns, or that torchrun started beside it. Every rank runs a Worker (never an engine): it
builds its shard of the model, sizes its KV pool (the group keeps the smallest rank's count, so
that every rank holds the same block ids), then runs rank 0's step messages.

A worker that dies takes the engine down: rank 0 checks them before every step (and while idle),
and a collective with a dead peer fails.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import os
import sys
import time

import torch
import torch.distributed as dist

from pagedllm.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.distributed import HeadShard, TPGroup, step_channel
from pagedllm.distributed.parallel import min_over_ranks
from pagedllm.distributed.process_group import (
    group_address,
    init_process_group,
    launched_rank,
    leave_group,
)
from pagedllm.executor.executor import Executor
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.procs import die_with_parent
from pagedllm.worker.worker import Worker, same_pool

logger = logging.getLogger("pagedllm")


def _start(worker: Worker) -> Worker:
    """Every rank, in step with the others: build the shard, agree on the pool's size."""
    config = worker.config
    worker.load_model()
    worker.prepare_cache(config.cache, config.scheduler)
    num_blocks = min_over_ranks(worker.num_kv_blocks())
    worker.initialize_cache(num_blocks, min_over_ranks(worker.num_swap_blocks(num_blocks)))
    return worker


def run_worker(
    config: EngineConfig,
    rank: int,
    address: tuple[str, int] | None = None,
    parent_pid: int | None = None,
) -> None:
    """Ranks 1..N-1: the target of the processes rank 0 spawns (`address`: where to connect;
    `parent_pid`: rank 0's process, which this one does not outlive), and what `pagedllm` runs
    on a rank > 0 that torchrun started (None: its environment)."""
    if parent_pid is not None:
        die_with_parent(parent_pid)
    logging.getLogger("pagedllm").setLevel(logging.WARNING)  # rank 0 logs for all
    worker = Worker(config, rank)
    worker.init_device()
    init_process_group(rank, config.parallel, address, worker.device)
    try:
        _start(worker).run_steps()
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _main_script_left_behind():
    """A spawned process first runs the main script again from its file; a script read from
    standard input (`python - <<EOF`) has none, so its ranks would die at once. They need
    nothing from it (their target and arguments are pagedllm's): while they start, its name is
    hidden, as for an interactive interpreter's."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or os.path.exists(path) or getattr(main, "__spec__", None) is not None:
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def spawn_ranks(config: EngineConfig, ranks, address: tuple[str, int]) -> list[mp.Process]:
    """Start `ranks` as processes of this host that do not outlive this one."""
    ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch thread pools
    procs = [
        ctx.Process(target=run_worker, args=(config, rank, address, os.getpid()),
                    name=f"pagedllm-tp{rank}", daemon=True)
        for rank in ranks
    ]  # fmt: skip
    with _main_script_left_behind():
        for p in procs:
            p.start()
    return procs


def run_node(config: EngineConfig) -> int:
    """A host other than node 0 of --nnodes: run its ranks (the first in this process) until the
    group ends; the exit status is 0 when rank 0 said shutdown, else 1 (a supervisor restarts
    the host's ranks, to join rank 0's next group)."""
    parallel = config.parallel
    first, *others = parallel.node_ranks()
    address = group_address(parallel)
    procs = spawn_ranks(config, others, address)
    status = 0
    try:
        run_worker(config, first, address)
    except Exception as e:  # noqa: BLE001 - the group is gone: say why, leave with a status
        logger.error("tensor-parallel rank %d: %s", first, e)
        status = 1
    for p in procs:
        p.join()
    return status if all(p.exitcode == 0 for p in procs) else 1


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        size = config.parallel.tensor_parallel_size
        arch = config.model.arch
        # Before any process starts: can the heads be split so?
        HeadShard.of(arch.num_attention_heads, arch.num_key_value_heads, TPGroup(0, size))
        self.procs: list[mp.Process] = []
        self._closed = False
        self._threads_before = torch.get_num_threads()  # shutdown() gives the share back
        address = self._launch(size)
        atexit.register(self.shutdown)
        try:
            self.driver_worker = Worker(config, 0)
            self.driver_worker.init_device()
            init_process_group(0, config.parallel, address, self.driver_worker.device, self.dead)
            logger.info("tensor parallelism: %d ranks", size)
            _start(self.driver_worker)
        except BaseException:
            self.shutdown()
            raise

    def _launch(self, size: int) -> tuple[str, int] | None:
        """Spawn ranks 1..N-1 and return where they meet; None when torchrun started them."""
        launched = launched_rank()
        if launched:
            raise ValueError(
                f"this process is rank {launched} of a launcher's group: only rank 0 builds an "
                "engine, the others run pagedllm.executor.multiproc.run_worker (as the pagedllm "
                "command does)"
            )
        if launched is not None:
            world = int(os.environ["WORLD_SIZE"])
            if world != size:
                raise ValueError(
                    f"--tensor-parallel-size {size}, but the launcher started {world} ranks "
                    "(WORLD_SIZE): they must be equal"
                )
            return None
        if self.config.parallel.node_rank:
            raise ValueError(
                "only node 0 of --nnodes builds an engine; the others run their ranks "
                "(pagedllm.executor.multiproc.run_node, as the pagedllm command does)"
            )
        address = group_address(self.config.parallel)
        self.procs = spawn_ranks(self.config, self.config.parallel.node_ranks()[1:], address)
        return address

    def initialize_cache(self, cache: CacheConfig, scheduler: SchedulerConfig) -> None:
        if not same_pool((cache, scheduler), (self.config.cache, self.config.scheduler)):
            raise ValueError(
                "a tensor-parallel executor keeps the KV cache it started with: build a new "
                "engine for other cache settings"
            )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(scheduler_output, step_channel.send_step)

    def dead(self, wait: float = 0.0) -> str | None:
        """Why the group is broken (a worker exited), or None. A collective fails as soon as a
        killed peer's sockets close, a moment before that peer can be reaped: `wait` covers it."""
        deadline = time.monotonic() + wait
        while True:
            for rank, p in enumerate(self.procs, start=1):
                if not p.is_alive():
                    return f"tensor-parallel worker rank {rank} exited (code {p.exitcode})"
            if not self.procs or time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the workers to stop, wait for them, kill what is left: no process stays behind."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if not dist.is_initialized():
            timeout = 0  # the group never formed: nothing to tell them
        elif self.dead() is None:
            try:
                step_channel.send_shutdown()
            except RuntimeError as e:  # a worker died meanwhile
                logger.warning("tensor parallelism: shutdown message failed: %s", e)
        self._stop_ranks(timeout)
        leave_group()
        torch.set_num_threads(self._threads_before)

    def _stop_ranks(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for each worker to exit, then kill those left (a
        subclass that starts its ranks otherwise stops them its own way)."""
        for p in self.procs:
            p.join(timeout)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
