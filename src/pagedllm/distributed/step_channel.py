"""The step message: what every rank runs in one engine step, as host arrays. Rank 0 (the
scheduler and the KV block manager run there only) builds it from the SchedulerOutput, sends it
to the other ranks, and runs it itself; so every rank replays the same decisions on its shards of
the model and of the KV pool (the same block ids everywhere).

On the wire, one broadcast of a fixed int64 header and one of an int64 payload per message (host
tensors, on the gloo group, distributed.parallel.cpu_group, also when the model's collectives
use NCCL): a step, or shutdown."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from pagedllm.distributed.parallel import COMM_BYTES, cpu_group

STEP, SHUTDOWN = 1, 2
# swap out, swap in, copies, tokens, requests, two logits row sets, groups, LoRA rows, LoRA loads
_NUM_SIZES = 10
MAX_KV_CACHE_GROUPS = 16
HEADER = 1 + _NUM_SIZES + MAX_KV_CACHE_GROUPS  # kind, sizes, each group's table width

_EMPTY = np.empty(0, np.int64)


@dataclass
class StepInputs:
    """One step: the block moves, then the forward's inputs (no tokens: moves only), then the
    rows of the hidden states whose logits are computed: for prompt logprobs, then to sample
    (two separate LM-head calls, as a matmul's rounding may depend on its row count)."""

    swap_out: np.ndarray  # [n, 2] (device block, cpu block)
    swap_in: np.ndarray  # [n, 2] (cpu block, device block)
    copies: np.ndarray  # [n, 2] (source, destination)
    input_ids: np.ndarray = field(default_factory=lambda: _EMPTY)  # [T]
    positions: np.ndarray = field(default_factory=lambda: _EMPTY)  # [T]
    req_index: np.ndarray = field(default_factory=lambda: _EMPTY)  # [T] the request of each token
    query_lens: np.ndarray = field(default_factory=lambda: _EMPTY)  # [R]
    seq_lens: np.ndarray = field(default_factory=lambda: _EMPTY)  # [R]
    block_tables: list[np.ndarray] = field(default_factory=list)  # per KV cache group, [R, B]
    prompt_logits_rows: np.ndarray = field(default_factory=lambda: _EMPTY)  # [P]
    sample_logits_rows: np.ndarray = field(default_factory=lambda: _EMPTY)  # [S]
    # LoRA: each token's adapter slot (-1: none; empty: no adapter this step), and the
    # (slot, LoRARequest) loads to make first (sent pickled: they carry paths)
    lora_slots: np.ndarray = field(default_factory=lambda: _EMPTY)  # [T] or [0]
    lora_loads: list = field(default_factory=list)
    # Embedding requests: the rows whose hidden states rank 0 pools (not sent: the other ranks
    # have nothing to do with them)
    pooling_rows: np.ndarray = field(default_factory=lambda: _EMPTY)  # [H]
    # Hybrid models: each request's state slot (not sent: Mamba layers run on one rank)
    state_slots: np.ndarray = field(default_factory=lambda: _EMPTY)  # [R] or [0]


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
    if len(tables) > MAX_KV_CACHE_GROUPS:
        raise ValueError(f"at most {MAX_KV_CACHE_GROUPS} KV cache groups with tensor parallelism")
    sizes = [len(s.swap_out), len(s.swap_in), len(s.copies), len(s.input_ids), len(s.query_lens),
             len(s.prompt_logits_rows), len(s.sample_logits_rows), len(tables),
             len(s.lora_slots), len(s.lora_loads)]  # fmt: skip
    parts = [s.swap_out, s.swap_in, s.copies, s.input_ids, s.positions, s.req_index,
             s.query_lens, s.seq_lens, s.prompt_logits_rows, s.sample_logits_rows,
             s.lora_slots, *tables]  # fmt: skip
    payload = np.concatenate([np.asarray(p, np.int64).ravel() for p in parts])
    _broadcast([STEP, *sizes, *(t.shape[1] for t in tables)], payload)
    if s.lora_loads:
        dist.broadcast_object_list([s.lora_loads], src=0, group=cpu_group())


def send_shutdown() -> None:
    _broadcast([SHUTDOWN], _EMPTY)


def receive() -> StepInputs | None:
    """The next step rank 0 sends, or None when it says shutdown."""
    head = torch.empty(HEADER, dtype=torch.int64)
    dist.broadcast(head, src=0, group=cpu_group())
    h = head.tolist()
    if h[0] == SHUTDOWN:
        return None
    n_out, n_in, n_copy, tokens, reqs, n_prompt, n_sample, groups, n_lora, n_loads = h[
        1 : 1 + _NUM_SIZES
    ]
    widths = h[1 + _NUM_SIZES : 1 + _NUM_SIZES + groups]
    sizes = [2 * n_out, 2 * n_in, 2 * n_copy, tokens, tokens, tokens, reqs, reqs, n_prompt,
             n_sample, n_lora, *(reqs * w for w in widths)]  # fmt: skip
    parts = np.split(_payload(sum(sizes)), np.cumsum(sizes)[:-1])
    loads = [None]
    if n_loads:
        dist.broadcast_object_list(loads, src=0, group=cpu_group())
    return StepInputs(
        parts[0].reshape(-1, 2), parts[1].reshape(-1, 2), parts[2].reshape(-1, 2),
        parts[3], parts[4], parts[5], parts[6], parts[7],
        [p.reshape(reqs, w).astype(np.int32) for p, w in zip(parts[11:], widths, strict=True)],
        parts[8], parts[9], parts[10], loads[0] or [],
    )  # fmt: skip


def _payload(n: int) -> np.ndarray:
    if n == 0:
        return _EMPTY
    t = torch.empty(n, dtype=torch.int64)
    dist.broadcast(t, src=0, group=cpu_group())
    return t.numpy()
