"""Rank 0 tells the other ranks what to run, one broadcast of a fixed header and one of an int64
payload per message: the step's block moves and the model's inputs as host arrays (token ids,
positions, block tables, lengths), or the rows whose logits to compute, or shutdown. The
scheduler and the KV block manager run on rank 0 only; the other ranks replay its decisions
on their shards of the model and of the KV pool (the same block ids everywhere). Host tensors,
on the gloo group (distributed.parallel.cpu_group) also when the model's collectives use NCCL."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from pagedllm.distributed.parallel import COMM_BYTES, cpu_group

STEP, LOGITS, SHUTDOWN = 1, 2, 3
HEADER = 16  # kind, 7 sizes, up to 8 KV cache groups' table widths


@dataclass
class StepInputs:
    """One step as host arrays: the block moves, then the forward's inputs (num tokens 0: none)."""

    swap_out: np.ndarray  # [n, 2] (device block, cpu block)
    swap_in: np.ndarray  # [n, 2] (cpu block, device block)
    copies: np.ndarray  # [n, 2] (source, destination)
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    req_index: np.ndarray  # [T] the request of each token
    query_lens: np.ndarray  # [R]
    seq_lens: np.ndarray  # [R]
    block_tables: list[np.ndarray]  # per KV cache group, [R, max blocks]


def pairs(moves) -> np.ndarray:
    """Block moves [(a, b), ...] as an int64 array [n, 2]."""
    return np.asarray(moves, dtype=np.int64).reshape(-1, 2)


def _broadcast(header: list[int], payload: np.ndarray) -> None:
    head = torch.zeros(HEADER, dtype=torch.int64)
    head[: len(header)] = torch.tensor(header)
    dist.broadcast(head, src=0, group=cpu_group())
    COMM_BYTES["broadcast"] += head.nbytes + payload.size * 8
    if payload.size:
        payload_t = torch.from_numpy(np.ascontiguousarray(payload, dtype=np.int64))
        dist.broadcast(payload_t, src=0, group=cpu_group())


def send_step(s: StepInputs) -> None:
    tables = s.block_tables
    if len(tables) > HEADER - 8:
        raise ValueError(f"at most {HEADER - 8} KV cache groups with tensor parallelism")
    sizes = [len(s.swap_out), len(s.swap_in), len(s.copies), len(s.input_ids), len(s.query_lens)]
    widths = [t.shape[1] for t in tables] if len(s.input_ids) else []
    parts = [s.swap_out, s.swap_in, s.copies, s.input_ids, s.positions, s.req_index,
             s.query_lens, s.seq_lens, *tables]  # fmt: skip
    payload = np.concatenate([np.asarray(p, np.int64).ravel() for p in parts])
    _broadcast([STEP, *sizes, len(widths), *widths], payload)


def send_logits(rows: np.ndarray) -> None:
    _broadcast([LOGITS, len(rows)], np.asarray(rows, np.int64))


def send_shutdown() -> None:
    _broadcast([SHUTDOWN], np.empty(0, np.int64))


def receive() -> tuple[int, StepInputs | np.ndarray | None]:
    """(kind, what): STEP and its StepInputs, LOGITS and its rows, SHUTDOWN and None."""
    head = torch.empty(HEADER, dtype=torch.int64)
    dist.broadcast(head, src=0, group=cpu_group())
    h = head.tolist()
    kind = h[0]
    if kind == SHUTDOWN:
        return kind, None
    if kind == LOGITS:
        return kind, _payload(h[1])
    n_out, n_in, n_copy, tokens, reqs, groups = h[1:7]
    widths = h[7 : 7 + groups]
    sizes = [2 * n_out, 2 * n_in, 2 * n_copy, tokens, tokens, tokens, reqs, reqs,
             *(reqs * w for w in widths)]  # fmt: skip
    parts = np.split(_payload(sum(sizes)), np.cumsum(sizes)[:-1])
    return kind, StepInputs(
        parts[0].reshape(-1, 2), parts[1].reshape(-1, 2), parts[2].reshape(-1, 2),
        parts[3], parts[4], parts[5], parts[6], parts[7],
        [p.reshape(reqs, w).astype(np.int32) for p, w in zip(parts[8:], widths, strict=True)],
    )  # fmt: skip


def _payload(n: int) -> np.ndarray:
    if n == 0:
        return np.empty(0, np.int64)
    t = torch.empty(n, dtype=torch.int64)
    dist.broadcast(t, src=0, group=cpu_group())
    return t.numpy()
