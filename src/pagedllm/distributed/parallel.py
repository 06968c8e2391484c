"""This process's place in the tensor-parallel group, and how the model is split across it
(layers/linear.py and layers/vocab_parallel_embedding.py cut their weights by these).

Each process (rank) holds about 1/N of every projection, as Megatron-LM splits a transformer:
the KV heads with their query heads (as evenly as whole GQA groups split; each KV head on
N / kv_heads ranks when there are fewer KV heads than ranks); the MLP's gate/up rows and down
columns; the vocabulary rows of the embedding and the LM head. Attention's and the MLP's
outputs are partial sums, added across ranks by one all-reduce each; the embedding's rows of
other ranks' tokens are zeros, added the same way; the LM head's logits are gathered to rank
0, which samples.

A process is one rank for its lifetime: the group is process-wide state, set once before the
model is built (set_tp_group), as torch.distributed's own default group is.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedllm.config import ModelArchConfig


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1


_group = TPGroup()
# Bytes of the tensors this rank passed to each kind of collective (the communication volume
# `bench throughput -tp N` reports per step; what goes on the wire depends on the algorithm).
COMM_BYTES: Counter[str] = Counter()


def tp_group() -> TPGroup:
    return _group


_cpu_group = None  # gloo, for host-side control messages


def cpu_group():
    """The process group for host tensors (step messages, start-up agreements): gloo (NCCL's
    collectives take CUDA tensors only), apart from the model's group, as its operations wait
    without a time limit (an idle rank waits for the next step however long it takes)."""
    return _cpu_group


def set_cpu_group(group) -> None:
    global _cpu_group
    _cpu_group = group


def set_tp_group(rank: int, size: int) -> None:
    """This process is `rank` of `size` (torch.distributed initialised already when size > 1)."""
    global _group
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of {size}")
    _group = TPGroup(rank, size)


@dataclass(frozen=True)
class HeadShard:
    """This rank's attention heads: num_heads query heads from q_start, num_kv_heads KV heads
    from kv_start (global head indices)."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, tp: TPGroup) -> HeadShard:
        """Query heads go with their KV head (GQA), in whole groups: each rank takes a
        contiguous run of KV heads, as even as they split (the default model's 3 over 2 ranks:
        2 and 1); with fewer KV heads than ranks, each is replicated on N / kv_heads ranks,
        which split its query heads evenly."""
        n, group = tp.size, num_heads // num_kv_heads
        if num_kv_heads >= n:
            base, extra = divmod(num_kv_heads, n)
            kv_heads = base + (tp.rank < extra)
            kv_start = tp.rank * base + min(tp.rank, extra)
            return cls(kv_heads * group, kv_heads, kv_start * group, kv_start)
        if n % num_kv_heads or num_heads % n:
            raise ValueError(
                f"tensor parallel size {n} cannot split {num_heads} attention heads with "
                f"{num_kv_heads} KV heads: with more ranks than KV heads, the ranks must be a "
                "multiple of the KV heads and divide the attention heads"
            )
        heads = num_heads // n
        # This rank's query heads share one KV head, replicated.
        return cls(heads, 1, tp.rank * heads, tp.rank * heads // group)


def head_shard(config: ModelArchConfig) -> HeadShard:
    return HeadShard.of(config.num_attention_heads, config.num_key_value_heads, tp_group())


def split(n: int, what: str) -> tuple[int, int]:
    """(start, count) of this rank's equal share of n rows (or columns) of `what`."""
    tp = tp_group()
    if n % tp.size:
        raise ValueError(f"tensor parallel size {tp.size} does not divide {what} ({n})")
    count = n // tp.size
    return tp.rank * count, count


def vocab_shard(vocab_size: int) -> tuple[int, int]:
    """(start, rows) of this rank's vocabulary rows: the vocabulary padded to a multiple of the
    group's size (the padding rows are zeros, their logits cut before sampling)."""
    tp = tp_group()
    rows = -(-vocab_size // tp.size)
    return tp.rank * rows, rows


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks, in place (nothing to do with one rank)."""
    if tp_group().size > 1:
        dist.all_reduce(x)
        COMM_BYTES["all_reduce"] += x.numel() * x.element_size()
    return x


def gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Each rank's [rows, vocab shard] logits -> [rows, vocab_size] on rank 0, None elsewhere."""
    tp = tp_group()
    if tp.size == 1:
        return logits
    logits = logits.contiguous()
    parts = [torch.empty_like(logits) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(logits, parts, dst=0)
    COMM_BYTES["gather"] += logits.numel() * logits.element_size() * (tp.size - 1)
    return torch.cat(parts, dim=-1)[:, :vocab_size] if parts is not None else None


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's `value` (e.g. KV blocks: capacity is the least rank's)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_group())  # at start-up: not counted
    return int(t.item())
