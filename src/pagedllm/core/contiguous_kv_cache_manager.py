"""Contiguous KV reservations, as serving systems did before paging: for benchmarks only.

The PagedAttention paper (§6) compares paging against three ways of giving each sequence one
contiguous region of KV memory, sized when the sequence is admitted:
- "max": `max_model_len` slots, whatever the sequence;
- "pow2": the prompt plus the output length rounded up to a power of two (at most 2x too much);
- "oracle": exactly prompt + output.
"pow2" and "oracle" take the output length from the sequence's `max_tokens` (capped by
`max_model_len`): the actual length when the benchmark sets `ignore_eos`, as ours do.

A region never grows, so a running sequence never needs memory and nothing is ever preempted; it
is freed when the sequence ends. Regions are placed by one of two allocators, and freed holes too
small for the next sequence are lost to external fragmentation:
- "buddy" (the default, as the paper's Orca baselines): regions are rounded up to a power of two
  of blocks and split from, and merged back into, aligned power-of-two chunks;
- "first-fit": a region takes the head of the lowest free extent long enough; neighbours merge.

The pool is the paged engine's (num_blocks x block_size slots) and a region is a run of
consecutive blocks, so the model runner and attention kernels are the very same: a region's
block table is [first, first + 1, ...], cut to the tokens placed so far. Only memory management
differs. With block_size 1 regions are exact to the slot; with larger blocks a region is rounded
up to whole blocks (the rounding is counted as internal fragmentation).

Sequence groups (n > 1, beam search), prefix caching, swapping and sliding windows are paging
features and are refused or off here.
"""

from __future__ import annotations

import bisect
import itertools

from pagedllm.config import CONTIGUOUS_POLICIES, KV_ALLOCATORS
from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.core.kv_cache_interface import Allocation, BlockPair
from pagedllm.core.kv_events import KVEventLog
from pagedllm.sequence import Sequence


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class FirstFitAllocator:
    """Free extents (first block, length), sorted and never adjacent (neighbours merge)."""

    def __init__(self, num_blocks: int) -> None:
        self.free_extents: list[tuple[int, int]] = [(0, num_blocks)]

    def allocate(self, num_blocks: int) -> tuple[int, int] | None:
        """The head of the lowest free extent with room: (first block, length), or None."""
        for i, (start, length) in enumerate(self.free_extents):
            if length >= num_blocks:
                if length == num_blocks:
                    del self.free_extents[i]
                else:
                    self.free_extents[i] = (start + num_blocks, length - num_blocks)
                return start, num_blocks
        return None

    def free(self, start: int, num_blocks: int) -> None:
        extents = self.free_extents
        i = bisect.bisect(extents, (start, num_blocks))
        if i < len(extents) and start + num_blocks == extents[i][0]:  # merge the next one
            num_blocks += extents.pop(i)[1]
        if i > 0 and extents[i - 1][0] + extents[i - 1][1] == start:  # and the previous one
            start, length = extents.pop(i - 1)
            num_blocks += length
            i -= 1
        extents.insert(i, (start, num_blocks))

    def extents(self) -> list[tuple[int, int]]:
        return list(self.free_extents)

    def check(self) -> None:
        for (a_start, a_len), (b_start, _) in itertools.pairwise(self.free_extents):
            assert a_start + a_len < b_start, "adjacent free extents were not merged"


class BuddyAllocator:
    """Binary buddy allocation over the blocks: chunks of 2^k blocks aligned to 2^k. A pool that
    is not a power of two starts as its largest aligned power-of-two chunks."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_chunks: dict[int, set[int]] = {}  # order k -> first blocks of free 2^k chunks
        start = 0
        while start < num_blocks:
            order = (start & -start).bit_length() - 1 if start else num_blocks.bit_length() - 1
            while start + (1 << order) > num_blocks:
                order -= 1
            self.free_chunks.setdefault(order, set()).add(start)
            start += 1 << order

    def allocate(self, num_blocks: int) -> tuple[int, int] | None:
        """The lowest free chunk of the smallest order that fits, split down to size."""
        want = max(num_blocks - 1, 0).bit_length()
        orders = [k for k, chunks in self.free_chunks.items() if k >= want and chunks]
        if not orders:
            return None
        order = min(orders)
        start = min(self.free_chunks[order])
        self.free_chunks[order].remove(start)
        while order > want:  # keep the lower half, free the upper one
            order -= 1
            self.free_chunks.setdefault(order, set()).add(start + (1 << order))
        return start, 1 << want

    def free(self, start: int, num_blocks: int) -> None:
        order = num_blocks.bit_length() - 1
        while True:
            buddy = start ^ (1 << order)
            merged = min(start, buddy)
            chunks = self.free_chunks.get(order, set())
            if buddy not in chunks or merged + (2 << order) > self.num_blocks:
                break
            chunks.remove(buddy)
            start, order = merged, order + 1
        self.free_chunks.setdefault(order, set()).add(start)

    def extents(self) -> list[tuple[int, int]]:
        return sorted((s, 1 << k) for k, chunks in self.free_chunks.items() for s in chunks)

    def check(self) -> None:
        for order, chunks in self.free_chunks.items():
            for start in chunks:
                assert start % (1 << order) == 0, "a free chunk is misaligned"
                buddy = start ^ (1 << order)
                fits = min(start, buddy) + (2 << order) <= self.num_blocks
                assert not (fits and buddy in chunks), "free buddies were not merged"


class ContiguousKVCacheManager:
    """The KV cache interface (kv_cache_interface.py) over contiguous regions."""

    enable_prefix_caching = False
    num_kv_cache_groups = 1
    prefix_cache_queries = prefix_cache_hits = 0
    num_copied_blocks = 0
    num_cpu_blocks = num_free_cpu_blocks = 0

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        policy: str,
        max_model_len: int,
        allocator: str = "buddy",
    ) -> None:
        if policy not in CONTIGUOUS_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(CONTIGUOUS_POLICIES)}: {policy!r}")
        if allocator not in KV_ALLOCATORS:
            raise ValueError(f"allocator must be one of {', '.join(KV_ALLOCATORS)}: {allocator!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.policy = policy
        self.max_model_len = max_model_len
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.allocator = (
            BuddyAllocator(num_blocks) if allocator == "buddy" else FirstFitAllocator(num_blocks)
        )
        self.regions: dict[str, tuple[int, int]] = {}  # seq_id -> (first block, num blocks)
        self.reserved_tokens: dict[str, int] = {}  # seq_id -> slots the policy asked for
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}  # the placed tokens' blocks
        self.swapped_blocks: dict[str, list[KVCacheBlock]] = {}  # always empty

    # -- sizing ---------------------------------------------------------------------------------
    def reservation(self, seq: Sequence) -> int:
        """Slots the policy reserves for `seq` (before rounding to whole blocks)."""
        prompt_len = seq.num_prompt_tokens
        output_len = min(seq.max_tokens or self.max_model_len, self.max_model_len - prompt_len)
        if self.policy == "max":
            return self.max_model_len
        if self.policy == "pow2":
            return min(prompt_len + next_power_of_two(output_len), self.max_model_len)
        return prompt_len + output_len

    def _region_blocks(self, seq: Sequence) -> int:
        return -(-self.reservation(seq) // self.block_size)

    def fits(self, seq: Sequence) -> bool:
        """Whether the allocator could place `seq`'s region now."""
        need = self._region_blocks(seq)
        need = next_power_of_two(need) if isinstance(self.allocator, BuddyAllocator) else need
        return max((n for _, n in self.allocator.extents()), default=0) >= need

    @property
    def num_free_blocks(self) -> int:
        return sum(n for _, n in self.allocator.extents())

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    # -- the scheduler's interface --------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> tuple[list[list[KVCacheBlock]], int]:
        return [[]], 0

    def num_blocks_needed(self, seqs: list[tuple[Sequence, int]], swapped: bool = False) -> int:
        return 0  # a running sequence's region already holds every token it will have

    def allocate_group(
        self, entries: list[tuple[Sequence, int, list[list[KVCacheBlock]]]]
    ) -> list[Allocation] | None:
        """Admit a sequence: place its region and its first tokens; None if no free extent is
        long enough."""
        if len(entries) != 1:
            raise ValueError("contiguous KV reservations serve one sequence per request (n=1)")
        seq, num_new_tokens, _ = entries[0]
        region = self.allocator.allocate(self._region_blocks(seq))
        if region is None:
            return None
        self.regions[seq.seq_id] = region
        self.reserved_tokens[seq.seq_id] = self.reservation(seq)
        self.req_to_blocks[seq.seq_id] = []
        return [self.allocate_slots(seq, num_new_tokens)]

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        new_computed_blocks: list[list[KVCacheBlock]] | None = None,
    ) -> Allocation | None:
        """Place `num_new_tokens` more tokens: the next blocks of the region, never new memory
        (so never None)."""
        start, num_blocks = self.regions[seq.seq_id]
        num_tokens = seq.num_computed_tokens + num_new_tokens
        needed = -(-num_tokens // self.block_size)
        assert needed <= num_blocks, "a sequence outgrew its reservation"
        table = self.req_to_blocks[seq.seq_id]
        new_blocks = self.blocks[start + len(table) : start + needed]
        table.extend(new_blocks)
        return Allocation((new_blocks,), [])

    def free(self, seq: Sequence) -> None:
        region = self.regions.pop(seq.seq_id, None)
        if region is None:
            return
        del self.req_to_blocks[seq.seq_id], self.reserved_tokens[seq.seq_id]
        self.allocator.free(*region)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        raise ValueError("contiguous KV reservations cannot share blocks (n=1 only)")

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        raise ValueError("contiguous KV reservations take no speculative decoding")

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return False  # no swap space: preemption never happens anyway

    def num_swap_in_blocks(self, seqs: list[Sequence]) -> int:
        return 0  # nothing is ever swapped out

    def swap_out(self, seqs: list[Sequence]) -> list[BlockPair]:
        raise ValueError("contiguous KV reservations have no swap space")

    def swap_in(self, seqs: list[Sequence]) -> list[BlockPair]:
        raise ValueError("contiguous KV reservations have no swap space")

    def reset_prefix_cache(self) -> bool:
        return True

    def record_events(self, medium: str) -> KVEventLog:
        raise ValueError("--kv-events-config needs --kv-allocation paged (a prefix cache)")

    def get_block_ids(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(seq_id, ())]

    def get_group_block_ids(self, seq_id: str) -> list[list[int]]:
        return [self.get_block_ids(seq_id)]

    def block_tables(self, seq_id: str) -> tuple[list[list[int]], bool]:
        return [self.get_block_ids(seq_id)], False

    def snapshot(self) -> dict:
        """As KVCacheManager.snapshot; the blocks of a region that hold no token yet are
        "reserved": taken from everyone else, used by no one (what paging does away with)."""
        ref_cnt = [0] * self.num_blocks
        reserved = []
        for seq_id, (start, num_blocks) in self.regions.items():
            used = len(self.req_to_blocks[seq_id])
            ref_cnt[start : start + used] = [1] * used
            reserved.extend(range(start + used, start + num_blocks))
        device = {"num_blocks": self.num_blocks, "ref_cnt": ref_cnt, "cached": []}
        return {"device": device, "swap": None, "reserved": sorted(reserved)}

    @property
    def num_logical_blocks(self) -> int:
        return sum(len(t) for t in self.req_to_blocks.values())

    def check_integrity(self) -> None:
        """Regions and free extents tile the pool exactly, and every table lies in its region."""
        free = self.allocator.extents()
        spans = sorted([*self.regions.values(), *free])
        position = 0
        for start, length in spans:
            assert start == position and length > 0, f"pool not tiled at block {position}"
            position += length
        assert position == self.num_blocks, "regions and free extents do not cover the pool"
        self.allocator.check()
        for seq_id, table in self.req_to_blocks.items():
            start, length = self.regions[seq_id]
            assert [b.block_id for b in table] == list(range(start, start + len(table)))
            assert len(table) <= length
