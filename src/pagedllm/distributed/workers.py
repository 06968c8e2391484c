"""The ranks of a tensor-parallel engine on one machine: rank 0 is the engine's own process (the
scheduler, the KV block manager, sampling, the server); ranks 1..N-1 are processes it spawns,
each building the same engine on its shard and replaying rank 0's steps (ModelRunner.run_worker).

torch.distributed connects them (gloo on CPU, NCCL on CUDA) at MASTER_ADDR:MASTER_PORT when
those are set, else at a free port on 127.0.0.1. A worker that dies takes the engine down:
rank 0 checks them before every step, and a collective with a dead peer fails.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import multiprocessing as mp
import os
import socket

import torch.distributed as dist

from pagedllm.distributed.parallel import set_tp_group

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


def init_process_group(rank: int, size: int, address: tuple[str, int], device) -> None:
    """Join the group as `rank` (every rank calls this; it returns once all have). Connecting
    waits CONNECT_TIMEOUT; the collectives after it wait as long as rank 0 stays idle."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    host, port = address
    try:
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
    set_tp_group(rank, size)


def _worker_main(rank: int, size: int, args, address: tuple[str, int]) -> None:
    from pagedllm.engine.llm_engine import LLMEngine

    logging.getLogger("pagedllm").setLevel(logging.WARNING)  # rank 0 logs for all
    engine = LLMEngine(args, tp_rank=rank, tp_address=address)
    engine.runner.run_worker()
    dist.destroy_process_group()


class TPWorkers:
    """Ranks 1..N-1, spawned by rank 0's engine."""

    def __init__(self, args, size: int) -> None:
        self.address = address_from_env()
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch thread pools
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(rank, size, args, self.address),
                name=f"pagedllm-tp{rank}",
                daemon=True,
            )  # fmt: skip
            for rank in range(1, size)
        ]
        for p in self.procs:
            p.start()
        self._closed = False
        atexit.register(self.shutdown)

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
        if dist.is_initialized() and self.dead() is None:
            from pagedllm.distributed import step_channel

            try:
                step_channel.send_shutdown()
            except RuntimeError as e:  # a worker died meanwhile
                logger.warning("tensor parallelism: shutdown message failed: %s", e)
        for p in self.procs:
            p.join(timeout)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        set_tp_group(0, 1)
        atexit.unregister(self.shutdown)
