"""Per-sequence block tables over the block pool, with automatic prefix caching. Torch-free.

Prefix caching (as vLLM V1 does it): full blocks are named by chained hashes (block_hash.py). A
new (or preempted) sequence first looks up the longest run of its leading full blocks that are
cached, takes references on them and starts its `num_computed_tokens` there; the runner then
computes only the rest. Blocks become cacheable once their tokens are written: `allocate_slots`
registers every block that the tokens scheduled this step fill up, since the runner writes
exactly those tokens in the same step. A hybrid model's hit must also end at a block whose
recurrent state was checkpointed (state_checkpoints.py, whose index this manager keeps).

Sharing, copy-on-write and swapping happen per KV cache group (kv_cache_group.py); the calls
that need blocks copied return the (source, destination) pairs, and the scheduler hands a
step's pairs to the runner, which copies each kind in one batched operation before the forward:
swap-outs first (their device blocks may be reused in the same step), then swap-ins, then
copy-on-write copies. Swapping (preemption mode "swap") moves a group's blocks to a separate
pool of CPU blocks, the swap space.
"""

from __future__ import annotations

from pagedllm.core.block_hash import update_block_hashes
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_group import NULL_BLOCK, KVCacheGroup, live_blocks
from pagedllm.core.kv_cache_interface import Allocation, BlockPair
from pagedllm.core.kv_events import KVEventLog
from pagedllm.core.state_checkpoints import StateCheckpoints
from pagedllm.sequence import Sequence


class KVCacheManager:
    """Maps each sequence's logical blocks to physical ones, growing its tables on demand: one
    table per KV cache group (`sliding_windows[g]` is group g's window, None for full
    attention), all over one block pool. A hybrid model's prefix caching needs
    `num_state_checkpoints` > 0: its hits end where a recurrent-state checkpoint does
    (state_checkpoints.py)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
        sliding_windows: list[int | None] | tuple = (None,),
        num_state_checkpoints: int = 0,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.groups = [
            KVCacheGroup(g, self.block_pool, block_size, window, enable_prefix_caching)
            for g, window in enumerate(sliding_windows)
        ]
        self._no_hits = tuple(() for _ in self.groups)  # a running sequence's: no prefix hits
        # The swap space: CPU blocks, the same layout as the device pool.
        self.cpu_block_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        self.num_copied_blocks = 0  # copy-on-write copies handed out
        self.forks: list[tuple[str, str]] = []  # (parent, child) seq ids since the last step
        # The seq ids whose blocks were freed since `take_freed` last collected them (recorded
        # once something collects them: the scheduler, every step; a draft model's never).
        self.freed: list[str] | None = None
        self.state_checkpoints: StateCheckpoints | None = None
        if num_state_checkpoints and enable_prefix_caching:
            self.state_checkpoints = StateCheckpoints(
                num_state_checkpoints, block_size, self.block_pool.cached_block_hash_to_block
            )
            self.block_pool.on_evict = self.state_checkpoints.drop
        # Prefix-cache statistics, in tokens, counted once per admitted (or resumed) sequence.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """The first group's block tables (the only group of a model without sliding windows)."""
        return self.groups[0].req_to_blocks

    @property
    def swapped_blocks(self) -> dict[str, list[KVCacheBlock]]:
        return self.groups[0].swapped_blocks

    @property
    def num_kv_cache_groups(self) -> int:
        return len(self.groups)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[list[KVCacheBlock]], int]:
        """The longest run of the sequence's leading full blocks that every group has cached
        (per group, the blocks to take), and the number of tokens they hold. At least the last
        token is always left to compute (its logits are needed), so a hit covering all tokens on
        a block boundary gives up its last block. A hybrid model's hit ends at a block with a
        state checkpoint."""
        if not self.enable_prefix_caching or seq.needs_every_position:
            return [[] for _ in self.groups], 0
        hashes = update_block_hashes(seq, self.block_size)
        num_blocks = (seq.num_tokens - 1) // self.block_size
        checkpoints = self.state_checkpoints
        while True:  # shrink until every group agrees (a sliding group's answer can jump)
            agreed = min(group.longest_hit(hashes, num_blocks) for group in self.groups)
            if checkpoints is not None:
                agreed = checkpoints.longest_hit(hashes, agreed)
            if agreed == num_blocks:
                break
            num_blocks = agreed
        hits = [group.hit_blocks(hashes, num_blocks) for group in self.groups]
        return hits, num_blocks * self.block_size

    def num_blocks_needed(self, seqs: list[tuple[Sequence, int]], swapped: bool = False) -> int:
        """Free blocks that allocating `num_new_tokens` for each (running) sequence takes, counting
        copy-on-write (of k sequences writing into one block held k times, k - 1 copy it) and
        the blocks sliding-window groups release.

        `swapped=True`: for swapped-out sequences, once swapped in (their sharing, and so the
        copies, come back as they were); the blocks the swap-in itself takes are not counted.
        """
        return sum(group.num_blocks_needed(seqs, swapped) for group in self.groups)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's block tables: every block gains a reference, none is
        copied. The fork is recorded for the runner (`forks`: a hybrid model's recurrent state
        is copied, not shared)."""
        for group in self.groups:
            group.fork(parent, child)
        self.forks.append((parent.seq_id, child.seq_id))

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        new_computed_blocks: list[list[KVCacheBlock]] | None = None,
    ) -> Allocation | None:
        """Make room for `num_new_tokens` more tokens: the new blocks and copy-on-write pairs,
        or None, changing nothing, if short.

        `new_computed_blocks` (from `get_computed_blocks`, for a sequence being admitted) become the
        head of its tables; the caller then sets `num_computed_tokens` to the tokens they hold.
        Passing them (even empty) marks an admission and counts it in the hit statistics.
        """
        # Once per scheduled sequence every step: plain loops, no temporaries beyond the result.
        groups = self.groups
        hits = new_computed_blocks or self._no_hits
        cost = 0
        for group, group_hits in zip(groups, hits, strict=True):
            cost += group.allocation_cost(seq, num_new_tokens, group_hits)
        if cost > self.block_pool.num_free_blocks:
            return None
        for group in groups:  # released blocks first: the others may need them
            group.release(seq)
        new_blocks, blocks_to_copy = [], []
        for group, group_hits in zip(groups, hits, strict=True):
            blocks, copy_pair = group.allocate(seq, num_new_tokens, group_hits)
            new_blocks.append(blocks)
            if copy_pair is not None:
                blocks_to_copy.append(copy_pair)
                self.num_copied_blocks += 1
        if new_computed_blocks is not None and self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(hits[0]) * self.block_size
            if hits[0] and self.state_checkpoints is not None:
                self.state_checkpoints.restore(seq, len(hits[0]))
        return Allocation(tuple(new_blocks), blocks_to_copy)

    def allocate_group(
        self, entries: list[tuple[Sequence, int, list[list[KVCacheBlock]]]]
    ) -> list[Allocation] | None:
        """Admit several sequences at once, all or none: (sequence, new tokens, prefix-hit blocks
        per group) each; one Allocation per entry, or None, changing nothing. The hit blocks are
        pinned first so that one sequence's allocation cannot evict a cached block another one
        is about to reuse."""
        hit_blocks = list(
            {id(b): b for _, _, hits in entries for h in hits for b in live_blocks(h)}.values()
        )
        need = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        for seq, num_new_tokens, hits in entries:
            for group, group_hits in zip(self.groups, hits, strict=True):
                need += group.allocation_cost(seq, num_new_tokens, group_hits)
                need -= sum(1 for b in live_blocks(group_hits) if b.ref_cnt == 0)  # counted above
        if need > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(hit_blocks)
        allocations = [self.allocate_slots(seq, n, hits) for seq, n, hits in entries]
        assert None not in allocations, "counted above"
        self.block_pool.free(hit_blocks)
        return allocations

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the sequence's blocks past its first `num_tokens` positions (rejected drafts)."""
        for group in self.groups:
            group.trim(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks (its swap-space blocks too, if it is swapped out)."""
        for group in self.groups:
            group.free(seq, self.cpu_block_pool)
        if self.freed is not None:
            self.freed.append(seq.seq_id)

    def take_freed(self) -> list[str]:
        """The seq ids freed since the last call (for the runner: a hybrid model's state slots
        go with them), and record them from now on."""
        freed, self.freed = self.freed or [], []
        return freed

    # -- swapping -------------------------------------------------------------------------------
    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        if self.cpu_block_pool is None:
            return False
        need = sum(group.num_distinct_blocks(seqs, swapped=False) for group in self.groups)
        return need <= self.cpu_block_pool.num_free_blocks

    def num_swap_in_blocks(self, seqs: list[Sequence]) -> int:
        return sum(group.num_distinct_blocks(seqs, swapped=True) for group in self.groups)

    def swap_out(self, seqs: list[Sequence]) -> list[BlockPair]:
        """Move the sequences' blocks to the swap space (check `can_swap_out` first): the
        (device block, cpu block) pairs to copy."""
        return [p for group in self.groups for p in group.swap_out(seqs, self.cpu_block_pool)]

    def swap_in(self, seqs: list[Sequence]) -> list[BlockPair]:
        """Move swapped sequences back to device blocks (check `num_swap_in_blocks` first): the
        (cpu block, device block) pairs to copy. The new blocks are entered in the prefix cache
        again as the sequences grow."""
        return [p for group in self.groups for p in group.swap_in(seqs, self.cpu_block_pool)]

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_block_pool.num_free_blocks if self.cpu_block_pool else 0

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_block_pool.num_blocks if self.cpu_block_pool else 0

    def reset_prefix_cache(self) -> bool:
        done = self.block_pool.reset_prefix_cache()
        if done and self.state_checkpoints is not None:
            self.state_checkpoints.clear()
        return done

    def record_events(self, medium: str) -> KVEventLog:
        """Record what the prefix cache does from now on (core/kv_events.py)."""
        self.block_pool.events = KVEventLog(medium)
        return self.block_pool.events

    def get_block_ids(self, seq_id: str) -> list[int]:
        """The first group's block table (the only one of a model without sliding windows)."""
        return [b.block_id for b in self.groups[0].req_to_blocks.get(seq_id, ())]

    def get_group_block_ids(self, seq_id: str) -> list[list[int]]:
        """One block table per group; released entries read as block 0 (never attended to)."""
        return [[b.block_id for b in g.req_to_blocks.get(seq_id, ())] for g in self.groups]

    def block_tables(self, seq_id: str) -> tuple[list[list[int]], bool]:
        """The sequence's block ids, one table per group (-1: an entry released by a sliding
        window), and True when they are swap-space blocks (the sequence is swapped out)."""
        swapped = seq_id in self.groups[0].swapped_blocks
        tables = [g.swapped_blocks if swapped else g.req_to_blocks for g in self.groups]
        return [
            [-1 if b is NULL_BLOCK else b.block_id for b in t.get(seq_id, ())] for t in tables
        ], swapped

    def snapshot(self) -> dict:
        """The device pool and the swap space block by block (see BlockPool.snapshot)."""
        return {
            "device": self.block_pool.snapshot(),
            "swap": self.cpu_block_pool.snapshot() if self.cpu_block_pool else None,
            "reserved": [],
        }

    @property
    def num_logical_blocks(self) -> int:
        """Blocks the sequences would hold without any sharing (live table entries)."""
        return sum(len(live_blocks(t)) for g in self.groups for t in g.req_to_blocks.values())

    def check_integrity(self) -> None:
        self.block_pool.check_integrity(
            live_blocks(t) for g in self.groups for t in g.req_to_blocks.values()
        )
        if self.cpu_block_pool is not None:
            self.cpu_block_pool.check_integrity(
                live_blocks(t) for g in self.groups for t in g.swapped_blocks.values()
            )
        for g in self.groups:
            assert not g.req_to_blocks.keys() & g.swapped_blocks.keys(), (
                "a sequence holds device and swap blocks at once"
            )
            for table in g.req_to_blocks.values():
                num_released = sum(1 for b in table if b is NULL_BLOCK)
                assert all(b is NULL_BLOCK for b in table[:num_released]), (
                    "released entries must be a prefix of the table"
                )
        if self.state_checkpoints is not None:
            self.state_checkpoints.check_integrity()
