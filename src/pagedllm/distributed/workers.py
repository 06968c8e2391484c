"""The ranks of a tensor-parallel engine on one machine: rank 0 is the engine's own process (the
scheduler, the KV block manager, sampling, the server); ranks 1..N-1 are processes it spawns,
each building the same engine on its shard and replaying rank 0's steps (ModelRunner.run_worker).

torch.distributed connects them (gloo on CPU, NCCL on CUDA) at MASTER_ADDR:MASTER_PORT when
those are set, else at a free port on 127.0.0.1. A worker that dies takes the engine down:
rank 0 checks them before every step, and a collective with a dead peer fails.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import socket

import torch.distributed as dist

from pagedllm.distributed.parallel import set_cpu_group, set_tp_group

logger = logging.getLogger(__name__)

# A worker waits in a broadcast for rank 0's next step, however long the server stays idle.
IDLE_TIMEOUT = datetime.timedelta(days=365)
CONNECT_TIMEOUT = datetime.timedelta(seconds=120)


def address_from_env() -> tuple[str, int]:
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT")
    if port is None:
        with socket.socket() as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
    return addr, int(port)


def launched_rank() -> int | None:
    """This process's rank when a launcher started every rank (torchrun sets RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT), else None (rank 0 spawns the others)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None


def init_process_group(rank: int, size: int, address: tuple[str, int] | None, device) -> None:
    """Join the group as `rank` (every rank calls this; it returns once all have): at
    `address`, or where the launcher's environment says (None). Connecting to an address waits
    CONNECT_TIMEOUT; the collectives after it wait as long as rank 0 stays idle."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    host, port = address or (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
    try:
        if address is None:  # torchrun's rendezvous (its agent's store)
            dist.init_process_group(backend, init_method="env://", timeout=IDLE_TIMEOUT)
        else:
            store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=CONNECT_TIMEOUT)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=size, timeout=IDLE_TIMEOUT
            )
    except Exception as e:  # noqa: BLE001 - name what to check, keep torch's message
        raise RuntimeError(
            f"tensor parallelism: torch.distributed ({backend}) could not connect rank {rank} of "
            f"{size} at {host}:{port}: {e}. Check MASTER_ADDR and MASTER_PORT (an address and "
            "a free port every rank can reach; unset: 127.0.0.1 and a free port) and that "
            f"the {backend} backend works here"
        ) from e
    if backend == "nccl":  # the step messages are host tensors: a gloo group beside NCCL
        set_cpu_group(dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))
    set_tp_group(rank, size)


def run_worker(args, rank: int, address: tuple[str, int] | None = None) -> None:
    """Ranks 1..N-1: build this rank's engine, replay rank 0's steps until it says shutdown.
    The target of the processes rank 0 spawns, and what `pagedllm` runs on a rank > 0 that
    torchrun started."""
    from pagedllm.engine.llm_engine import LLMEngine

    logging.getLogger("pagedllm").setLevel(logging.WARNING)  # rank 0 logs for all
    engine = LLMEngine(args, tp_rank=rank, tp_address=address)
    try:
        engine.runner.run_worker()
    finally:
        dist.destroy_process_group()


class TPWorkers:
    """Ranks 1..N-1, spawned by rank 0's engine."""

    def __init__(self, args, size: int) -> None:
        self.address = address_from_env()
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch thread pools
        self.procs = [
            ctx.Process(
                target=run_worker,
                args=(args, rank, self.address),
                name=f"pagedllm-tp{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for p in self.procs:
            p.start()
        self._closed = False

    def dead(self) -> str | None:
        """Why the group is broken (a worker exited), or None."""
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                return f"tensor-parallel worker rank {rank} exited (code {p.exitcode})"
        return None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the workers to stop, wait for them, kill what is left: no process stays behind."""
        if self._closed:
            return
        self._closed = True
        if not dist.is_initialized():
            timeout = 0  # the group never formed: nothing to tell them
        elif self.dead() is None:
            stop_workers()
        for p in self.procs:
            p.join(timeout)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        leave_group()


def stop_workers() -> None:
    """Rank 0: tell the other ranks to stop (they leave the group and exit)."""
    from pagedllm.distributed import step_channel

    if dist.is_initialized():
        try:
            step_channel.send_shutdown()
        except RuntimeError as e:  # a worker died meanwhile
            logger.warning("tensor parallelism: shutdown message failed: %s", e)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    set_tp_group(0, 1)
    set_cpu_group(None)
