"""One KV cache group's block tables over the shared block pool (see kv_cache_spec.py). Torch-free.

Each group has its own block table per sequence (keyed by `Sequence.seq_id`), all over one pool.
A sliding-window group releases the blocks that no query of the sequence can see any more (they
stay in the prefix cache until evicted), leaving NULL_BLOCK in their table entries; its prefix
hits only need the blocks inside the window before the hit point.

Sharing and copy-on-write: a fork gives a new sequence the same block table, taking one more
reference on every block. Only the block a step writes into can diverge: when a sequence is about
to write into a partly filled block that others also hold, `allocate` gives it a fresh block and
returns a (source, destination) pair for the runner to copy before the forward pass. Full blocks
are never written again, so they stay shared for good.

Swapping: a swapped-out sequence's table moves to the swap space (`swapped_blocks`), one CPU
block per distinct device block, so blocks shared inside a group stay shared (and are copied
once); the device blocks are freed. On resume they move back to fresh device blocks.
"""

from __future__ import annotations

from pagedllm.core.block_hash import update_block_hashes
from pagedllm.core.block_pool import BlockHash, BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_interface import BlockPair
from pagedllm.core.kv_cache_spec import cdiv
from pagedllm.sequence import Sequence

# A released table entry of a sliding-window group: no block, never read (its id is a
# placeholder the attention backends skip, since it lies before every query's window).
NULL_BLOCK = KVCacheBlock(block_id=0, ref_cnt=-1)
_NO_BLOCKS: tuple[KVCacheBlock, ...] = ()  # what most decode steps allocate


def live_blocks(blocks) -> list[KVCacheBlock]:
    """The table's blocks, released entries left out."""
    return [b for b in blocks if b is not NULL_BLOCK]


class KVCacheGroup:
    """One KV cache group's block tables (keyed by `Sequence.seq_id`) over the shared pool."""

    def __init__(
        self,
        group_id: int,
        block_pool: BlockPool,
        block_size: int,
        sliding_window: int | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.group_id = group_id
        self.block_pool = block_pool
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.swapped_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each sequence are already in the hash map (or were skipped).
        self.num_cached_blocks: dict[str, int] = {}

    def _key(self, block_hash: BlockHash) -> BlockHash:
        # One hash map serves all groups: the same tokens in another group are other blocks.
        return block_hash + self.group_id.to_bytes(2, "little") if self.group_id else block_hash

    def num_released(self, num_computed_tokens: int) -> int:
        """Leading blocks that no query from position `num_computed_tokens` on can see."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    # -- prefix hits ----------------------------------------------------------------------------
    def longest_hit(self, hashes: list[BlockHash], max_blocks: int) -> int:
        """The most leading blocks (at most `max_blocks`) whose K/V this group has cached. A
        sliding group needs only the blocks inside the window before the hit point."""
        get = self.block_pool.get_cached_block
        if self.sliding_window is None:
            n = 0
            while n < max_blocks and get(self._key(hashes[n])) is not None:
                n += 1
            return n
        best = run = 0  # run: cached blocks ending at block k - 1
        for k in range(1, max_blocks + 1):
            run = run + 1 if get(self._key(hashes[k - 1])) is not None else 0
            if run >= k - self.num_released(k * self.block_size):
                best = k
        return best

    def hit_blocks(self, hashes: list[BlockHash], num_blocks: int) -> list[KVCacheBlock]:
        first = self.num_released(num_blocks * self.block_size)
        get = self.block_pool.get_cached_block
        return [NULL_BLOCK] * first + [get(self._key(h)) for h in hashes[first:num_blocks]]

    # -- allocation -----------------------------------------------------------------------------
    def _num_new_blocks(
        self, seq: Sequence, num_new_tokens: int, table, num_hit_blocks: int = 0
    ) -> int:
        num_computed = seq.num_computed_tokens + num_hit_blocks * self.block_size
        have = len(table) + num_hit_blocks
        return max(0, cdiv(num_computed + num_new_tokens, self.block_size) - have)

    def _shared_write_block(self, seq: Sequence, table: list[KVCacheBlock]):
        """The partly filled block the next token goes into, if other sequences hold it too."""
        offset = seq.num_computed_tokens % self.block_size
        if offset == 0 or not table:
            return None  # the next token starts a new block
        block = table[seq.num_computed_tokens // self.block_size]
        return block if block.ref_cnt > 1 else None

    def _releasable(self, seq: Sequence, table: list[KVCacheBlock]) -> range:
        """Table positions of blocks that slid out of the window and are not yet released
        (released entries are always a prefix of the table)."""
        end = min(self.num_released(seq.num_computed_tokens), len(table))
        start = end
        while start > 0 and table[start - 1] is not NULL_BLOCK:
            start -= 1
        return range(start, end)

    def allocation_cost(self, seq: Sequence, num_new_tokens: int, hits: list[KVCacheBlock]) -> int:
        """Net free blocks `release` + `allocate` take: new blocks, evictable hit blocks and a
        copy-on-write copy, minus released blocks that no one else holds."""
        table = self.req_to_blocks.get(seq.seq_id, [])
        cost = self._num_new_blocks(seq, num_new_tokens, table, len(hits))
        cost += sum(1 for b in live_blocks(hits) if b.ref_cnt == 0)
        if table:
            cost += self._shared_write_block(seq, table) is not None
            cost -= sum(1 for i in self._releasable(seq, table) if table[i].ref_cnt == 1)
        return cost

    def num_blocks_needed(self, seqs: list[tuple[Sequence, int]], swapped: bool) -> int:
        """See KVCacheManager.num_blocks_needed; released blocks held only by the sequences
        releasing them count as freed (not for swapped sequences: their swap-in comes first and
        needs room for every block they hold)."""
        tables = self.swapped_blocks if swapped else self.req_to_blocks
        total = 0
        writers: dict[int, list[int]] = {}  # shared block id -> [ref_cnt, sequences writing]
        releasers: dict[int, list[int]] = {}  # released block id -> [ref_cnt, sequences]
        for seq, num_new_tokens in seqs:
            table = tables.get(seq.seq_id, [])
            total += self._num_new_blocks(seq, num_new_tokens, table)
            block = self._shared_write_block(seq, table)
            if block is not None:
                writers.setdefault(block.block_id, [block.ref_cnt, 0])[1] += 1
            for i in () if swapped else self._releasable(seq, table):
                releasers.setdefault(table[i].block_id, [table[i].ref_cnt, 0])[1] += 1
        for ref_cnt, num_writers in writers.values():
            total += num_writers if ref_cnt > num_writers else num_writers - 1
        return total - sum(1 for ref_cnt, n in releasers.values() if n == ref_cnt)

    def release(self, seq: Sequence) -> None:
        """Free the blocks that slid out of the sequence's window (a no-op for full attention).
        They keep their hash, so a later sequence with the same prefix can still hit them."""
        table = self.req_to_blocks.get(seq.seq_id)
        if not table:
            return
        released = self._releasable(seq, table)
        self.block_pool.free(table[i] for i in reversed(released))
        for i in released:
            table[i] = NULL_BLOCK

    def allocate(
        self, seq: Sequence, num_new_tokens: int, hits: list[KVCacheBlock]
    ) -> tuple[list[KVCacheBlock], BlockPair | None]:
        """Grow the sequence's table for `num_new_tokens` (room checked by the caller): the new
        blocks appended to it, and the copy-on-write pair if it had to copy a shared block."""
        req_id = seq.seq_id
        blocks = self.req_to_blocks.setdefault(req_id, [])
        num_new_blocks = self._num_new_blocks(seq, num_new_tokens, blocks, len(hits))
        shared = self._shared_write_block(seq, blocks)
        copy_pair = None
        if shared is not None:
            # Copy-on-write: this sequence writes into its own copy; the others keep the block.
            (copy,) = self.block_pool.allocate(1)
            blocks[seq.num_computed_tokens // self.block_size] = copy
            self.block_pool.free([shared])
            copy_pair = (shared.block_id, copy.block_id)
        if hits:
            assert not blocks, "hit blocks are only taken by a sequence with an empty table"
            self.block_pool.touch(live_blocks(hits))
            blocks.extend(hits)
            self.num_cached_blocks[req_id] = len(hits)
        new_blocks = _NO_BLOCKS
        if num_new_blocks:
            new_blocks = self.block_pool.allocate(num_new_blocks)
            blocks.extend(new_blocks)
        if self.enable_prefix_caching:
            num_tokens = seq.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
            self._cache_full_blocks(seq, blocks, num_tokens // self.block_size)
        return new_blocks, copy_pair

    def _cache_full_blocks(
        self, seq: Sequence, blocks: list[KVCacheBlock], num_full_blocks: int
    ) -> None:
        """Register the blocks that are full once this step's tokens are written."""
        req_id = seq.seq_id
        start = self.num_cached_blocks.get(req_id, 0)
        # Only blocks whose tokens are all known can be named (callers may reserve ahead).
        num_full_blocks = min(num_full_blocks, seq.num_tokens // self.block_size)
        if num_full_blocks <= start:
            return
        hashes = update_block_hashes(seq, self.block_size)
        new = [i for i in range(start, num_full_blocks)
               if blocks[i] is not NULL_BLOCK
               and self.block_pool.cache_block(blocks[i], self._key(hashes[i]))]  # fmt: skip
        self.num_cached_blocks[req_id] = num_full_blocks
        if new and self.block_pool.events is not None:
            self._record_stored(seq, hashes, new)

    def _record_stored(self, seq: Sequence, hashes: list, new: list[int]) -> None:
        """A BlockStored event for each run of consecutive blocks newly entered in the cache."""
        bs, lora = self.block_size, seq.lora_request
        runs: list[list[int]] = []
        for i in new:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, end = run[0], run[-1] + 1
            self.block_pool.events.stored(
                [self._key(h) for h in hashes[first:end]],
                self._key(hashes[first - 1]) if first else None,
                seq.all_token_ids[first * bs : end * bs],
                bs,
                lora.lora_int_id if lora is not None else None,
            )

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` positions (slots of rejected draft
        tokens). They were never named in the prefix cache: only verified tokens are."""
        table = self.req_to_blocks.get(seq.seq_id)
        keep = cdiv(num_tokens, self.block_size)
        if not table or len(table) <= keep:
            return
        dropped = live_blocks(table[keep:])
        del table[keep:]
        self.block_pool.free(reversed(dropped))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        blocks = self.req_to_blocks.get(parent.seq_id, [])
        self.block_pool.touch(live_blocks(blocks))
        self.req_to_blocks[child.seq_id] = list(blocks)
        if parent.seq_id in self.num_cached_blocks:
            self.num_cached_blocks[child.seq_id] = self.num_cached_blocks[parent.seq_id]

    def free(self, seq: Sequence, cpu_block_pool: BlockPool | None) -> None:
        """Tail first, so tail blocks are evicted before head ones."""
        self.num_cached_blocks.pop(seq.seq_id, None)
        blocks = self.req_to_blocks.pop(seq.seq_id, None)
        if blocks:
            self.block_pool.free(reversed(live_blocks(blocks)))
        cpu_blocks = self.swapped_blocks.pop(seq.seq_id, None)
        if cpu_blocks:
            cpu_block_pool.free(reversed(live_blocks(cpu_blocks)))

    def num_distinct_blocks(self, seqs: list[Sequence], swapped: bool) -> int:
        tables = self.swapped_blocks if swapped else self.req_to_blocks
        return len({b.block_id for r in seqs for b in live_blocks(tables.get(r.seq_id, ()))})

    def swap_out(self, seqs: list[Sequence], cpu_block_pool: BlockPool) -> list[BlockPair]:
        """Move the sequences' tables to the swap space: the (device, cpu) pairs to copy."""
        moved, pairs = _move(seqs, self.req_to_blocks, self.block_pool, cpu_block_pool)
        self.swapped_blocks.update(moved)
        for seq in seqs:
            self.num_cached_blocks.pop(seq.seq_id, None)
        return pairs

    def swap_in(self, seqs: list[Sequence], cpu_block_pool: BlockPool) -> list[BlockPair]:
        """Move the sequences' tables back to device blocks: the (cpu, device) pairs to copy."""
        moved, pairs = _move(seqs, self.swapped_blocks, cpu_block_pool, self.block_pool)
        self.req_to_blocks.update(moved)
        return pairs


def _move(
    seqs: list[Sequence],
    tables: dict[str, list[KVCacheBlock]],
    src_pool: BlockPool,
    dst_pool: BlockPool,
) -> tuple[dict[str, list[KVCacheBlock]], list[BlockPair]]:
    """New tables in `dst_pool` for the sequences' tables in `src_pool`, and the (source,
    destination) pairs to copy: one destination block per distinct source block, referenced as
    often as the source was (released entries stay released)."""
    mapping: dict[int, KVCacheBlock] = {}
    moved = {}
    pairs: list[BlockPair] = []
    for seq in seqs:
        src_table = tables.pop(seq.seq_id)
        dst_table = []
        for block in src_table:
            if block is NULL_BLOCK:
                dst_table.append(NULL_BLOCK)
                continue
            dst = mapping.get(block.block_id)
            if dst is None:
                (dst,) = dst_pool.allocate(1)
                mapping[block.block_id] = dst
                pairs.append((block.block_id, dst.block_id))
            else:
                dst_pool.touch([dst])
            dst_table.append(dst)
        src_pool.free(reversed(live_blocks(src_table)))
        moved[seq.seq_id] = dst_table
    return moved, pairs
