"""What the scheduler, the engine, the KV snapshot and the benchmarks may ask of a KV cache
manager. Torch-free.

Two managers implement it: the paged `KVCacheManager` and the benchmarks' pre-paging
`ContiguousKVCacheManager`; tests/core/test_kv_cache_interface.py holds both to these names and
signatures. Calls that move or copy blocks return the (source, destination) block id pairs they
create; the scheduler carries them to the runner in the step's SchedulerOutput, and the manager
keeps no list of moves pending.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol, runtime_checkable

from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.core.kv_events import KVEventLog
from pagedllm.sequence import Sequence

# (source block id, destination block id): a copy-on-write copy, or a swap between the device
# pool and the swap space.
BlockPair = tuple[int, int]


class Allocation(NamedTuple):
    """What one sequence's allocation took from the pool: per KV cache group, the new blocks
    appended to its block table (prefix-cache hits not included), and the copy-on-write pairs
    whose destination replaced a shared block the sequence is about to write into. (A named
    tuple: the scheduler makes one per scheduled sequence every step.)"""

    new_blocks: tuple[list[KVCacheBlock], ...]
    blocks_to_copy: list[BlockPair]


@runtime_checkable
class KVCacheInterface(Protocol):
    """A KV cache manager as its users see it. Sequences are named by `Sequence.seq_id`."""

    @property
    def block_size(self) -> int: ...

    @property
    def enable_prefix_caching(self) -> bool: ...

    @property
    def num_kv_cache_groups(self) -> int: ...

    # -- pools ----------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def usage(self) -> float:
        """The share of the device pool in use."""
        ...

    @property
    def num_cpu_blocks(self) -> int:
        """The swap space's size (0: none)."""
        ...

    @property
    def num_free_cpu_blocks(self) -> int: ...

    # -- counters -------------------------------------------------------------------------------
    @property
    def num_copied_blocks(self) -> int: ...

    @property
    def prefix_cache_queries(self) -> int: ...

    @property
    def prefix_cache_hits(self) -> int: ...

    @property
    def num_logical_blocks(self) -> int:
        """Blocks the sequences would hold without any sharing."""
        ...

    # -- block tables ---------------------------------------------------------------------------
    @property
    def req_to_blocks(self) -> Mapping[str, list[KVCacheBlock]]:
        """The first group's block table of every sequence holding device blocks."""
        ...

    @property
    def swapped_blocks(self) -> Mapping[str, list[KVCacheBlock]]:
        """The first group's block table of every swapped-out sequence (swap-space blocks)."""
        ...

    def get_block_ids(self, seq_id: str) -> list[int]: ...

    def get_group_block_ids(self, seq_id: str) -> list[list[int]]: ...

    def block_tables(self, seq_id: str) -> tuple[list[list[int]], bool]: ...

    # -- allocation -----------------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> tuple[list[list[KVCacheBlock]], int]: ...

    def num_blocks_needed(self, seqs: list[tuple[Sequence, int]], swapped: bool = False) -> int: ...

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        new_computed_blocks: list[list[KVCacheBlock]] | None = None,
    ) -> Allocation | None:
        """None, changing nothing, when the pool is short."""
        ...

    def allocate_group(
        self, entries: list[tuple[Sequence, int, list[list[KVCacheBlock]]]]
    ) -> list[Allocation] | None:
        """All or none: one Allocation per entry, in order, or None changing nothing."""
        ...

    def fork(self, parent: Sequence, child: Sequence) -> None: ...

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` positions (rejected draft tokens)."""
        ...

    def free(self, seq: Sequence) -> None: ...

    # -- swapping -------------------------------------------------------------------------------
    def can_swap_out(self, seqs: list[Sequence]) -> bool: ...

    def num_swap_in_blocks(self, seqs: list[Sequence]) -> int: ...

    def swap_out(self, seqs: list[Sequence]) -> list[BlockPair]:
        """(device block, cpu block) pairs."""
        ...

    def swap_in(self, seqs: list[Sequence]) -> list[BlockPair]:
        """(cpu block, device block) pairs."""
        ...

    # -- whole cache ----------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool: ...

    def record_events(self, medium: str) -> KVEventLog:
        """Record the prefix cache's changes from now on (--kv-events-config)."""
        ...

    def snapshot(self) -> dict: ...

    def check_integrity(self) -> None: ...
