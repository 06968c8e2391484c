"""What KV cache managers hand back from allocation and block moves. Torch-free.

Calls that move or copy blocks return the (source, destination) block id pairs they create; the
scheduler carries them to the runner in the step's SchedulerOutput, and the manager keeps no
list of moves pending.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.block_pool import KVCacheBlock

# (source block id, destination block id): a copy-on-write copy, or a swap between the device
# pool and the swap space.
BlockPair = tuple[int, int]


@dataclass(frozen=True)
class Allocation:
    """What one sequence's allocation took from the pool: per KV cache group, the new blocks
    appended to its block table (prefix-cache hits not included), and the copy-on-write pairs
    whose destination replaced a shared block the sequence is about to write into."""

    new_blocks: tuple[list[KVCacheBlock], ...]
    blocks_to_copy: list[BlockPair] = field(default_factory=list)
