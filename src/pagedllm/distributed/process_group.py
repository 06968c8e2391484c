"""Joining and leaving the tensor-parallel process group: torch.distributed (gloo on CPU, NCCL on
CUDA) connects the ranks at --master-addr:--master-port or MASTER_ADDR:MASTER_PORT when set
(torchrun sets them, with RANK and WORLD_SIZE), else at a free port on 127.0.0.1. Who starts the
ranks is the executor's business (pagedllm.executor)."""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable

import torch.distributed as dist

from pagedllm.config import ParallelConfig
from pagedllm.distributed.parallel import set_cpu_group, set_tp_group

# A worker waits in a broadcast for rank 0's next step, however long the server stays idle.
IDLE_TIMEOUT = datetime.timedelta(days=365)
CONNECT_TIMEOUT = datetime.timedelta(seconds=120)
JOINED = "pagedllm/joined"  # the store's count of ranks > 0 connected to it


class RankExited(RuntimeError):
    """A rank this process started exited before the group formed."""


def group_address(parallel: ParallelConfig) -> tuple[str, int]:
    """Where the ranks meet: --master-addr/--master-port, else MASTER_ADDR/MASTER_PORT, else
    127.0.0.1 and a free port (one host: rank 0 spawns the others and tells them)."""
    addr = parallel.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = parallel.master_port or os.environ.get("MASTER_PORT")
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


def init_process_group(
    rank: int,
    parallel: ParallelConfig,
    address: tuple[str, int] | None,
    device,
    dead: Callable[[], str | None] | None = None,
) -> None:
    """Join the group as `rank` (every rank calls this; it returns once all have): at
    `address`, or where the launcher's environment says (None). Connecting waits
    CONNECT_TIMEOUT; rank 0 meanwhile asks `dead` (why a rank it started has exited, or None),
    so that a rank that dies before joining fails the start at once, not after the timeout.
    The model's collectives run on the default group, whose operations fail after
    --distributed-timeout (a lost peer fails the step); the step messages and start-up
    agreements on a gloo group of their own (cpu_group), which waits as long as rank 0 stays
    idle."""
    size = parallel.tensor_parallel_size
    backend = "nccl" if device.type == "cuda" else "gloo"
    host, port = address or (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
    timeout = datetime.timedelta(seconds=parallel.distributed_timeout)
    try:
        if address is None:  # torchrun's rendezvous (its agent's store)
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        else:
            store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=CONNECT_TIMEOUT,
                                  wait_for_workers=False)  # fmt: skip
            if rank == 0:
                _wait_for_ranks(store, size, dead)
            else:
                store.add(JOINED, 1)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=size, timeout=timeout
            )
        set_cpu_group(dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))
    except RankExited:
        raise
    except Exception as e:  # noqa: BLE001 - name what to check, keep torch's message
        raise RuntimeError(
            f"tensor parallelism: torch.distributed ({backend}) could not connect rank {rank} of "
            f"{size} at {host}:{port}: {e}. Check MASTER_ADDR and MASTER_PORT (an address and "
            "a free port every rank can reach; unset: 127.0.0.1 and a free port) and that "
            f"the {backend} backend works here"
        ) from e
    set_tp_group(rank, size)


def _wait_for_ranks(store: dist.TCPStore, size: int, dead) -> None:
    """Rank 0: until every other rank has connected to the store, or one it started exited."""
    deadline = time.monotonic() + CONNECT_TIMEOUT.total_seconds()
    while (joined := store.add(JOINED, 0)) < size - 1:
        why = dead() if dead is not None else None
        if why:
            message = f"tensor parallelism: {why} before joining the group (its error is above)"
            raise RankExited(message)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{joined} of {size - 1} other ranks joined in {CONNECT_TIMEOUT}")
        time.sleep(0.02)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    set_tp_group(0, 1)
    set_cpu_group(None)
