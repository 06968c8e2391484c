"""Joining and leaving the tensor-parallel process group: torch.distributed (gloo on CPU, NCCL on
CUDA) connects the ranks at MASTER_ADDR:MASTER_PORT when those are set (torchrun sets them, with
RANK and WORLD_SIZE), else at a free port on 127.0.0.1. Who starts the ranks is the executor's
business (pagedllm.executor)."""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

from pagedllm.distributed.parallel import set_cpu_group, set_tp_group

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


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    set_tp_group(0, 1)
    set_cpu_group(None)
