"""Tensor parallelism on torch.distributed: which shard of each weight this process holds, and
the collectives the sharded model calls (gloo on CPU, NCCL on CUDA)."""

from pagedllm.distributed.parallel import (
    HeadShard,
    TPGroup,
    all_reduce,
    gather_vocab,
    head_shard,
    set_tp_group,
    tp_group,
    vocab_shard,
)

__all__ = [
    "HeadShard",
    "TPGroup",
    "all_reduce",
    "gather_vocab",
    "head_shard",
    "set_tp_group",
    "tp_group",
    "vocab_shard",
]
