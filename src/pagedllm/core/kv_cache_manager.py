"""Per-request block tables over the block pool, with automatic prefix caching. Torch-free.

Prefix caching (as vLLM V1 does it): a FULL block is named by a hash chained over its parent
block's hash and its token ids (the first block also mixes in the request's `cache_salt`), so equal
hashes mean equal prefixes and therefore equal K/V. A new (or preempted) request first looks up the
longest run of its leading full blocks that are cached, takes references on them and starts its
`num_computed_tokens` there; the runner then computes only the rest. Blocks become cacheable once
their tokens are written: `allocate_slots` registers every block that the tokens scheduled this
step fill up, since the runner writes exactly those tokens in the same step.

Sharing and copy-on-write: `fork` gives a new sequence the same block table, taking one more
reference on every block. Only the block a step writes into can diverge: when a sequence is about
to write into a partly filled block that others also hold, `allocate_slots` gives it a fresh block
and records a (source, destination) pair in `blocks_to_copy`; the runner copies all of a step's
pairs in one batched operation before the forward pass. Full blocks are never written again, so
they stay shared for good.

Swapping (preemption mode "swap"): a preempted group's blocks move to a separate pool of CPU
blocks, one CPU block per distinct device block, so blocks shared inside the group stay shared
(and are copied once); the device blocks are freed. On resume they move back to fresh device
blocks. The (device, cpu) / (cpu, device) pairs are copied by the runner in one batched operation
per direction, swap-outs first (their device blocks may be reused in the same step).

KV cache groups (see kv_cache_spec.py): each group has its own block table per sequence over the
one shared pool. A sliding-window group releases the blocks that no query of the sequence can
see any more (they stay in the prefix cache until evicted), leaving NULL_BLOCK in their table
entries; its prefix hits only need the blocks inside the window before the hit point.
"""

from __future__ import annotations

import hashlib
from array import array

from pagedllm.core.block_pool import BlockHash, BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_spec import cdiv
from pagedllm.request import Request

_NONE_HASH = b"\x00" * 32
# A released table entry of a sliding-window group: no block, never read (its id is a
# placeholder the attention backends skip, since it lies before every query's window).
NULL_BLOCK = KVCacheBlock(block_id=0, ref_cnt=-1)


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: list[int] | tuple[int, ...], extra: str | None = None
) -> BlockHash:
    """SHA-256 over (parent hash, token ids as int64, extra key).

    SHA-256 rather than the builtin `hash()`: it is 256 bits, so a collision (two different
    prefixes sharing blocks, i.e. silently wrong output) is out of reach even for a prompt crafted
    to poison another user's cache, and it is the same in every process (the builtin `hash` of a
    str salt is randomised per process). It costs about a microsecond per block, once per block.
    """
    h = hashlib.sha256(parent_hash or _NONE_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra is not None:
        h.update(b"\x01salt")
        h.update(extra.encode())
    return h.digest()


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend `request.block_hashes` to cover every full block of its tokens (incrementally)."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    for i in range(len(hashes), len(tokens) // block_size):
        parent = hashes[i - 1] if i else None
        extra = request.cache_salt if i == 0 else None
        hashes.append(
            hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size], extra)
        )
    return hashes


def _live(blocks) -> list[KVCacheBlock]:
    return [b for b in blocks if b is not NULL_BLOCK]


class KVCacheGroup:
    """One KV cache group's block tables (keyed by `Request.seq_id`) over the shared pool."""

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
        self, request: Request, num_new_tokens: int, table, num_hit_blocks: int = 0
    ) -> int:
        num_computed = request.num_computed_tokens + num_hit_blocks * self.block_size
        have = len(table) + num_hit_blocks
        return max(0, cdiv(num_computed + num_new_tokens, self.block_size) - have)

    def _shared_write_block(self, request: Request, table: list[KVCacheBlock]):
        """The partly filled block the next token goes into, if other sequences hold it too."""
        offset = request.num_computed_tokens % self.block_size
        if offset == 0 or not table:
            return None  # the next token starts a new block
        block = table[request.num_computed_tokens // self.block_size]
        return block if block.ref_cnt > 1 else None

    def _releasable(self, request: Request, table: list[KVCacheBlock]) -> range:
        """Table positions of blocks that slid out of the window and are not yet released
        (released entries are always a prefix of the table)."""
        end = min(self.num_released(request.num_computed_tokens), len(table))
        start = end
        while start > 0 and table[start - 1] is not NULL_BLOCK:
            start -= 1
        return range(start, end)

    def allocation_cost(
        self, request: Request, num_new_tokens: int, hits: list[KVCacheBlock]
    ) -> int:
        """Net free blocks `release` + `allocate` take: new blocks, evictable hit blocks and a
        copy-on-write copy, minus released blocks that no one else holds."""
        table = self.req_to_blocks.get(request.seq_id, [])
        cost = self._num_new_blocks(request, num_new_tokens, table, len(hits))
        cost += sum(1 for b in _live(hits) if b.ref_cnt == 0)
        if table:
            cost += self._shared_write_block(request, table) is not None
            cost -= sum(1 for i in self._releasable(request, table) if table[i].ref_cnt == 1)
        return cost

    def num_blocks_needed(self, requests: list[tuple[Request, int]], swapped: bool) -> int:
        """See KVCacheManager.num_blocks_needed; released blocks held only by the sequences
        releasing them count as freed (not for swapped sequences: their swap-in comes first and
        needs room for every block they hold)."""
        tables = self.swapped_blocks if swapped else self.req_to_blocks
        total = 0
        writers: dict[int, list[int]] = {}  # shared block id -> [ref_cnt, sequences writing]
        releasers: dict[int, list[int]] = {}  # released block id -> [ref_cnt, sequences]
        for request, num_new_tokens in requests:
            table = tables.get(request.seq_id, [])
            total += self._num_new_blocks(request, num_new_tokens, table)
            block = self._shared_write_block(request, table)
            if block is not None:
                writers.setdefault(block.block_id, [block.ref_cnt, 0])[1] += 1
            for i in () if swapped else self._releasable(request, table):
                releasers.setdefault(table[i].block_id, [table[i].ref_cnt, 0])[1] += 1
        for ref_cnt, num_writers in writers.values():
            total += num_writers if ref_cnt > num_writers else num_writers - 1
        return total - sum(1 for ref_cnt, n in releasers.values() if n == ref_cnt)

    def release(self, request: Request) -> None:
        """Free the blocks that slid out of the sequence's window (a no-op for full attention).
        They keep their hash, so a later request with the same prefix can still hit them."""
        table = self.req_to_blocks.get(request.seq_id)
        if not table:
            return
        released = self._releasable(request, table)
        self.block_pool.free(table[i] for i in reversed(released))
        for i in released:
            table[i] = NULL_BLOCK

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        hits: list[KVCacheBlock],
        blocks_to_copy: list[tuple[int, int]],
    ) -> None:
        """Grow the sequence's table for `num_new_tokens` (room checked by the caller)."""
        req_id = request.seq_id
        blocks = self.req_to_blocks.setdefault(req_id, [])
        num_new_blocks = self._num_new_blocks(request, num_new_tokens, blocks, len(hits))
        shared = self._shared_write_block(request, blocks)
        if shared is not None:
            # Copy-on-write: this sequence writes into its own copy; the others keep the block.
            (copy,) = self.block_pool.allocate(1)
            blocks[request.num_computed_tokens // self.block_size] = copy
            self.block_pool.free([shared])
            blocks_to_copy.append((shared.block_id, copy.block_id))
        if hits:
            assert not blocks, "hit blocks are only taken by a sequence with an empty table"
            self.block_pool.touch(_live(hits))
            blocks.extend(hits)
            self.num_cached_blocks[req_id] = len(hits)
        if num_new_blocks:
            blocks.extend(self.block_pool.allocate(num_new_blocks))
        if self.enable_prefix_caching:
            num_tokens = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
            self._cache_full_blocks(request, blocks, num_tokens // self.block_size)

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_full_blocks: int
    ) -> None:
        """Register the blocks that are full once this step's tokens are written."""
        req_id = request.seq_id
        start = self.num_cached_blocks.get(req_id, 0)
        # Only blocks whose tokens are all known can be named (callers may reserve ahead).
        num_full_blocks = min(num_full_blocks, request.num_tokens // self.block_size)
        if num_full_blocks <= start:
            return
        hashes = update_block_hashes(request, self.block_size)
        for i in range(start, num_full_blocks):
            if blocks[i] is not NULL_BLOCK:
                self.block_pool.cache_block(blocks[i], self._key(hashes[i]))
        self.num_cached_blocks[req_id] = num_full_blocks

    def fork(self, parent: Request, child: Request) -> None:
        blocks = self.req_to_blocks.get(parent.seq_id, [])
        self.block_pool.touch(_live(blocks))
        self.req_to_blocks[child.seq_id] = list(blocks)
        if parent.seq_id in self.num_cached_blocks:
            self.num_cached_blocks[child.seq_id] = self.num_cached_blocks[parent.seq_id]

    def free(self, request: Request, cpu_block_pool: BlockPool | None) -> None:
        """Tail first, so tail blocks are evicted before head ones."""
        self.num_cached_blocks.pop(request.seq_id, None)
        blocks = self.req_to_blocks.pop(request.seq_id, None)
        if blocks:
            self.block_pool.free(reversed(_live(blocks)))
        cpu_blocks = self.swapped_blocks.pop(request.seq_id, None)
        if cpu_blocks:
            cpu_block_pool.free(reversed(_live(cpu_blocks)))

    def num_distinct_blocks(self, requests: list[Request], swapped: bool) -> int:
        tables = self.swapped_blocks if swapped else self.req_to_blocks
        return len({b.block_id for r in requests for b in _live(tables.get(r.seq_id, ()))})

    def swap_out(self, requests, cpu_block_pool, pairs) -> None:
        self.swapped_blocks.update(
            _move(requests, self.req_to_blocks, self.block_pool, cpu_block_pool, pairs)
        )
        for request in requests:
            self.num_cached_blocks.pop(request.seq_id, None)

    def swap_in(self, requests, cpu_block_pool, pairs) -> None:
        self.req_to_blocks.update(
            _move(requests, self.swapped_blocks, cpu_block_pool, self.block_pool, pairs)
        )


def _move(requests, tables, src_pool, dst_pool, pairs) -> dict[str, list[KVCacheBlock]]:
    """New tables in `dst_pool` for the sequences' tables in `src_pool`: one destination block
    per distinct source block, referenced as often as the source was (released entries stay
    released)."""
    mapping: dict[int, KVCacheBlock] = {}
    moved = {}
    for request in requests:
        src_table = tables.pop(request.seq_id)
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
        src_pool.free(reversed(_live(src_table)))
        moved[request.seq_id] = dst_table
    return moved


class KVCacheManager:
    """Maps each sequence's logical blocks to physical ones, growing its tables on demand: one
    table per KV cache group (`sliding_windows[g]` is group g's window, None for full
    attention), all over one block pool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
        sliding_windows: list[int | None] | tuple = (None,),
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.groups = [
            KVCacheGroup(g, self.block_pool, block_size, window, enable_prefix_caching)
            for g, window in enumerate(sliding_windows)
        ]
        # The swap space: CPU blocks, the same layout as the device pool.
        self.cpu_block_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        self.blocks_to_swap_out: list[tuple[int, int]] = []  # (device block, cpu block)
        self.blocks_to_swap_in: list[tuple[int, int]] = []  # (cpu block, device block)
        # Copy-on-write pairs (source block id, destination block id) not yet handed to a step.
        self.blocks_to_copy: list[tuple[int, int]] = []
        self.num_copied_blocks = 0
        # Prefix-cache statistics, in tokens, counted once per admitted (or resumed) request.
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

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """The longest run of the request's leading full blocks that every group has cached
        (per group, the blocks to take), and the number of tokens they hold. At least the last
        token is always left to compute (its logits are needed), so a hit covering all tokens on
        a block boundary gives up its last block."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [[] for _ in self.groups], 0  # prompt logprobs need every position computed
        hashes = update_block_hashes(request, self.block_size)
        num_blocks = (request.num_tokens - 1) // self.block_size
        while True:  # shrink until every group agrees (a sliding group's answer can jump)
            agreed = min(group.longest_hit(hashes, num_blocks) for group in self.groups)
            if agreed == num_blocks:
                break
            num_blocks = agreed
        hits = [group.hit_blocks(hashes, num_blocks) for group in self.groups]
        return hits, num_blocks * self.block_size

    def num_blocks_needed(self, requests: list[tuple[Request, int]], swapped: bool = False) -> int:
        """Free blocks that allocating `num_new_tokens` for each (running) sequence takes, counting
        copy-on-write (of k sequences writing into one block held k times, k - 1 copy it) and
        the blocks sliding-window groups release.

        `swapped=True`: for swapped-out sequences, once swapped in (their sharing, and so the
        copies, come back as they were); the blocks the swap-in itself takes are not counted.
        """
        return sum(group.num_blocks_needed(requests, swapped) for group in self.groups)

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's block tables: every block gains a reference, none is
        copied."""
        for group in self.groups:
            group.fork(parent, child)

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        pairs, self.blocks_to_copy = self.blocks_to_copy, []
        return pairs

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[list[KVCacheBlock]] | None = None,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens; False, changing nothing, if short.

        `new_computed_blocks` (from `get_computed_blocks`, for a request being admitted) become the
        head of its tables; the caller then sets `num_computed_tokens` to the tokens they hold.
        Passing them (even empty) marks an admission and counts it in the hit statistics.
        """
        hits = new_computed_blocks or [[] for _ in self.groups]
        cost = sum(
            group.allocation_cost(request, num_new_tokens, group_hits)
            for group, group_hits in zip(self.groups, hits, strict=True)
        )
        if cost > self.block_pool.num_free_blocks:
            return False
        for group in self.groups:  # released blocks first: the others may need them
            group.release(request)
        num_copies = len(self.blocks_to_copy)
        for group, group_hits in zip(self.groups, hits, strict=True):
            group.allocate(request, num_new_tokens, group_hits, self.blocks_to_copy)
        self.num_copied_blocks += len(self.blocks_to_copy) - num_copies
        if new_computed_blocks is not None and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(hits[0]) * self.block_size
        return True

    def allocate_group(self, entries: list[tuple[Request, int, list[list[KVCacheBlock]]]]) -> bool:
        """Admit several sequences at once, all or none: (sequence, new tokens, prefix-hit blocks
        per group) each. The hit blocks are pinned first so that one sequence's allocation
        cannot evict a cached block another one is about to reuse."""
        hit_blocks = list(
            {id(b): b for _, _, hits in entries for h in hits for b in _live(h)}.values()
        )
        need = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        for seq, num_new_tokens, hits in entries:
            for group, group_hits in zip(self.groups, hits, strict=True):
                need += group.allocation_cost(seq, num_new_tokens, group_hits)
                need -= sum(1 for b in _live(group_hits) if b.ref_cnt == 0)  # counted above
        if need > self.block_pool.num_free_blocks:
            return False
        self.block_pool.touch(hit_blocks)
        for seq, num_new_tokens, hits in entries:
            allocated = self.allocate_slots(seq, num_new_tokens, hits)
            assert allocated, "counted above"
        self.block_pool.free(hit_blocks)
        return True

    def free(self, request: Request) -> None:
        """Return the sequence's blocks (its swap-space blocks too, if it is swapped out)."""
        for group in self.groups:
            group.free(request, self.cpu_block_pool)

    # -- swapping -------------------------------------------------------------------------------
    def can_swap_out(self, requests: list[Request]) -> bool:
        if self.cpu_block_pool is None:
            return False
        need = sum(group.num_distinct_blocks(requests, swapped=False) for group in self.groups)
        return need <= self.cpu_block_pool.num_free_blocks

    def num_swap_in_blocks(self, requests: list[Request]) -> int:
        return sum(group.num_distinct_blocks(requests, swapped=True) for group in self.groups)

    def swap_out(self, requests: list[Request]) -> None:
        """Move the sequences' blocks to the swap space (check `can_swap_out` first)."""
        for group in self.groups:
            group.swap_out(requests, self.cpu_block_pool, self.blocks_to_swap_out)

    def swap_in(self, requests: list[Request]) -> None:
        """Move swapped sequences back to device blocks (check `num_swap_in_blocks` first). The
        new blocks are entered in the prefix cache again as the sequences grow."""
        for group in self.groups:
            group.swap_in(requests, self.cpu_block_pool, self.blocks_to_swap_in)

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        out, self.blocks_to_swap_out = self.blocks_to_swap_out, []
        in_, self.blocks_to_swap_in = self.blocks_to_swap_in, []
        return out, in_

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_block_pool.num_free_blocks if self.cpu_block_pool else 0

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_block_pool.num_blocks if self.cpu_block_pool else 0

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

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
        return sum(len(_live(t)) for g in self.groups for t in g.req_to_blocks.values())

    def check_integrity(self) -> None:
        self.block_pool.check_integrity(
            _live(t) for g in self.groups for t in g.req_to_blocks.values()
        )
        if self.cpu_block_pool is not None:
            self.cpu_block_pool.check_integrity(
                _live(t) for g in self.groups for t in g.swapped_blocks.values()
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
