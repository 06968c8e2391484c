"""The physical KV-cache blocks: reference counts, an O(1) LRU free queue and the prefix cache.

Torch-free. A block is *in use* while its `ref_cnt > 0` and *free* otherwise; a free block sits in
the free queue, least recently freed at the head. A full block whose tokens are all computed can be
given a `block_hash` (see `block_hash.hash_block_tokens`) and entered in the hash → block map.
Freeing it does not forget the hash (lazy eviction): a later request with the same prefix can
"touch" it back into use straight out of the middle of the free queue, and the hash only goes when
`allocate` hands the block out for new contents.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagedllm.core.kv_events import KVEventLog

BlockHash = bytes


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Hash of the block's tokens chained over its prefix; None unless the block is in the map.
    block_hash: BlockHash | None = None


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """Hands out blocks and takes them back the moment their reference count reaches zero.

    The free queue is an OrderedDict keyed by block id: popping the head, appending at the tail
    and removing a block from the middle (a prefix-cache hit on a free block) are all O(1).
    Blocks never handed out yet head the queue in id order without being in it: they are made
    as `allocate` first reaches them (a small model's 4 GiB pool is millions of blocks, which
    took seconds to set up).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._blocks: list[KVCacheBlock] = []  # blocks 0 .. len - 1; the rest never used
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict()  # made blocks only
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.events: KVEventLog | None = None  # what the prefix cache did (--kv-events-config)
        # Called with each hash the cache evicts (a hybrid model's state checkpoints go too).
        self.on_evict: Callable[[BlockHash], None] | None = None

    @property
    def blocks(self) -> list[KVCacheBlock]:
        """Every block, by id (making the ones never used: O(num_blocks) the first time)."""
        self._make(self.num_blocks - len(self._blocks))
        return self._blocks

    def _make(self, count: int) -> list[KVCacheBlock]:
        """The next `count` never-used blocks, made."""
        start = len(self._blocks)
        made = [KVCacheBlock(i) for i in range(start, start + count)]
        self._blocks += made
        for block in reversed(made):  # they stay ahead of the blocks freed so far
            self._free[block.block_id] = block
            self._free.move_to_end(block.block_id, last=False)
        return made

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` can hand out, cached (evictable) ones included."""
        return len(self._free) + self.num_blocks - len(self._blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free queue, evicting their cached hash if any."""
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        self._make(min(num_blocks, self.num_blocks - len(self._blocks)))
        blocks = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            assert block.ref_cnt == 0, block
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take another reference on cached blocks (a prefix hit); free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each, in the order given; blocks reaching zero join the tail of the
        free queue, so the first ones given are the first to be evicted later."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    # -- prefix cache ---------------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Enter a full, in-use block in the map; True if it was not there. If another block
        already holds the same tokens (two requests computed the same prefix before either was
        cached) the first one stays the cached copy and this one remains an ordinary, unhashed
        block."""
        assert block.ref_cnt > 0, f"caching free block {block.block_id}"
        if block.block_hash is not None:
            assert block.block_hash == block_hash, "a cached block's contents changed"
            return False
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
            if self.on_evict is not None:
                self.on_evict(block.block_hash)
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use, as in vLLM."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self._blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_block_hash_to_block)

    def snapshot(self) -> dict:
        """Every block's reference count and the ids of the blocks in the prefix cache (in use
        or free): what the dashboard draws. O(num_blocks), so only taken when asked."""
        return {
            "num_blocks": self.num_blocks,
            "ref_cnt": [b.ref_cnt for b in self._blocks]
            + [0] * (self.num_blocks - len(self._blocks)),
            "cached": sorted(b.block_id for b in self.cached_block_hash_to_block.values()),
        }

    # -- checks ---------------------------------------------------------------------------------
    def check_integrity(self, block_tables: Iterable[list[KVCacheBlock]]) -> None:
        """free + in use == total, every ref count equals the number of tables holding the
        block, no block in use is in the free queue, and the hash map and the blocks agree."""
        blocks = self._blocks  # the never-used rest: free, no references, no hash
        expected = [0] * len(blocks)
        for table in block_tables:
            for block in table:
                assert block is blocks[block.block_id], "a table holds a stray block"
                expected[block.block_id] += 1
        actual = [b.ref_cnt for b in blocks]
        assert actual == expected, "reference counts disagree with the block tables"
        for block_id, block in self._free.items():
            assert block is blocks[block_id], "the free queue holds a stray block"
            assert block.ref_cnt == 0, "a used block is in the free queue"
        num_used = sum(1 for c in expected if c > 0)
        assert num_used + self.num_free_blocks == self.num_blocks, (
            "blocks leaked: free + used != total"
        )
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, (
                "the hash map points at a block with another hash"
            )
        for block in blocks:
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, (
                    f"block {block.block_id} has a hash but is not the map's entry for it"
                )
