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
"""

from __future__ import annotations

import hashlib
from array import array

from pagedllm.core.block_pool import BlockHash, BlockPool, KVCacheBlock
from pagedllm.request import Request

_NONE_HASH = b"\x00" * 32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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


class KVCacheManager:
    """Maps each request's logical blocks to physical ones, growing the table on demand."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        # The swap space: CPU blocks, and the block tables of swapped-out sequences.
        self.cpu_block_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        self.swapped_blocks: dict[str, list[KVCacheBlock]] = {}
        self.blocks_to_swap_out: list[tuple[int, int]] = []  # (device block, cpu block)
        self.blocks_to_swap_in: list[tuple[int, int]] = []  # (cpu block, device block)
        # Block tables, keyed by sequence id (`Request.seq_id`).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Copy-on-write pairs (source block id, destination block id) not yet handed to a step.
        self.blocks_to_copy: list[tuple[int, int]] = []
        self.num_copied_blocks = 0
        # How many leading blocks of each request are already in the hash map (or were skipped).
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics, in tokens, counted once per admitted (or resumed) request.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

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

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of the request's leading full blocks that are cached, and the number of
        tokens they hold. At least the last token is always left to compute (its logits are
        needed), so a hit covering all tokens on a block boundary gives up its last block."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        hashes = update_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def num_blocks_to_allocate(
        self, request: Request, num_new_tokens: int, num_computed_blocks: int = 0
    ) -> int:
        have = len(self.req_to_blocks.get(request.seq_id, ())) + num_computed_blocks
        num_computed = request.num_computed_tokens + num_computed_blocks * self.block_size
        need = cdiv(num_computed + num_new_tokens, self.block_size)
        return max(0, need - have)

    def _shared_write_block(
        self, request: Request, table: list[KVCacheBlock] | None = None
    ) -> KVCacheBlock | None:
        """The partly filled block the next token goes into, if other sequences hold it too."""
        offset = request.num_computed_tokens % self.block_size
        if offset == 0:
            return None  # the next token starts a new block
        if table is None:
            table = self.req_to_blocks[request.seq_id]
        block = table[request.num_computed_tokens // self.block_size]
        return block if block.ref_cnt > 1 else None

    def num_blocks_needed(self, requests: list[tuple[Request, int]], swapped: bool = False) -> int:
        """Free blocks that allocating `num_new_tokens` for each (running) sequence takes, counting
        copy-on-write: of k sequences writing into one block held k times, k - 1 copy it.

        `swapped=True`: for swapped-out sequences, once swapped in (their sharing, and so the
        copies, come back as they were); the blocks the swap-in itself takes are not counted.
        """
        tables = self.swapped_blocks if swapped else self.req_to_blocks
        total = 0
        writers: dict[int, list[int]] = {}  # shared block id -> [ref_cnt, sequences writing]
        for request, num_new_tokens in requests:
            table = tables.get(request.seq_id, [])
            need = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
            total += max(0, need - len(table))
            block = self._shared_write_block(request, table) if table else None
            if block is not None:
                writers.setdefault(block.block_id, [block.ref_cnt, 0])[1] += 1
        for ref_cnt, num_writers in writers.values():
            total += num_writers if ref_cnt > num_writers else num_writers - 1
        return total

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's block table: every block gains a reference, none is copied."""
        blocks = self.req_to_blocks.get(parent.seq_id, [])
        self.block_pool.touch(blocks)
        self.req_to_blocks[child.seq_id] = list(blocks)
        if parent.seq_id in self.num_cached_blocks:
            self.num_cached_blocks[child.seq_id] = self.num_cached_blocks[parent.seq_id]

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        pairs, self.blocks_to_copy = self.blocks_to_copy, []
        return pairs

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens; False, changing nothing, if short.

        `new_computed_blocks` (from `get_computed_blocks`, for a request being admitted) become the
        head of its table; the caller then sets `num_computed_tokens` to the tokens they hold.
        Passing a list (even empty) marks an admission and counts it in the hit statistics.
        """
        computed = new_computed_blocks or []
        num_new_blocks = self.num_blocks_to_allocate(request, num_new_tokens, len(computed))
        # Touching a cached block that sits in the free queue takes it out of the free count.
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        req_id = request.seq_id
        shared = self._shared_write_block(request) if req_id in self.req_to_blocks else None
        num_copies = 1 if shared is not None else 0
        if num_new_blocks + num_evictable_hits + num_copies > self.block_pool.num_free_blocks:
            return False
        blocks = self.req_to_blocks.setdefault(req_id, [])
        if shared is not None:
            # Copy-on-write: this sequence writes into its own copy; the others keep the block.
            (copy,) = self.block_pool.allocate(1)
            blocks[request.num_computed_tokens // self.block_size] = copy
            self.block_pool.free([shared])
            self.blocks_to_copy.append((shared.block_id, copy.block_id))
            self.num_copied_blocks += 1
        if computed:
            assert not blocks, "computed blocks are only taken by a request with an empty table"
            self.block_pool.touch(computed)
            blocks.extend(computed)
            self.num_cached_blocks[req_id] = len(computed)
        if num_new_blocks:
            blocks.extend(self.block_pool.allocate(num_new_blocks))
        if new_computed_blocks is not None and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(computed) * self.block_size
        if self.enable_prefix_caching:
            num_tokens_after = (
                request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
            )
            self._cache_full_blocks(request, blocks, num_tokens_after // self.block_size)
        return True

    def allocate_group(self, entries: list[tuple[Request, int, list[KVCacheBlock]]]) -> bool:
        """Admit several sequences at once, all or none: (sequence, new tokens, prefix-hit blocks)
        each. The hit blocks are pinned first so that one sequence's allocation cannot evict a
        cached block another one is about to reuse."""
        hit_blocks = list({id(b): b for _, _, blocks in entries for b in blocks}.values())
        need = sum(self.num_blocks_to_allocate(seq, n, len(blocks)) for seq, n, blocks in entries)
        need += sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if need > self.block_pool.num_free_blocks:
            return False
        self.block_pool.touch(hit_blocks)
        for seq, num_new_tokens, blocks in entries:
            allocated = self.allocate_slots(seq, num_new_tokens, blocks)
            assert allocated, "counted above"
        self.block_pool.free(hit_blocks)
        return True

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
            self.block_pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[req_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first, so tail blocks are evicted before head ones
        (its swap-space blocks too, if it is swapped out)."""
        self.num_cached_blocks.pop(request.seq_id, None)
        blocks = self.req_to_blocks.pop(request.seq_id, None)
        if blocks:
            self.block_pool.free(reversed(blocks))
        cpu_blocks = self.swapped_blocks.pop(request.seq_id, None)
        if cpu_blocks:
            self.cpu_block_pool.free(cpu_blocks)

    # -- swapping -------------------------------------------------------------------------------
    @staticmethod
    def _num_distinct(tables: list[list[KVCacheBlock]]) -> int:
        return len({b.block_id for table in tables for b in table})

    def can_swap_out(self, requests: list[Request]) -> bool:
        if self.cpu_block_pool is None:
            return False
        tables = [self.req_to_blocks.get(r.seq_id, []) for r in requests]
        return self._num_distinct(tables) <= self.cpu_block_pool.num_free_blocks

    def num_swap_in_blocks(self, requests: list[Request]) -> int:
        return self._num_distinct([self.swapped_blocks[r.seq_id] for r in requests])

    def swap_out(self, requests: list[Request]) -> None:
        """Move the sequences' blocks to the swap space (check `can_swap_out` first)."""
        self.swapped_blocks.update(
            self._move(requests, self.req_to_blocks, self.block_pool, self.cpu_block_pool,
                       self.blocks_to_swap_out)
        )  # fmt: skip
        for request in requests:
            self.num_cached_blocks.pop(request.seq_id, None)

    def swap_in(self, requests: list[Request]) -> None:
        """Move swapped sequences back to device blocks (check `num_swap_in_blocks` first). The
        new blocks are entered in the prefix cache again as the sequences grow."""
        self.req_to_blocks.update(
            self._move(requests, self.swapped_blocks, self.cpu_block_pool, self.block_pool,
                       self.blocks_to_swap_in)
        )  # fmt: skip

    @staticmethod
    def _move(requests, tables, src_pool, dst_pool, pairs) -> dict[str, list[KVCacheBlock]]:
        """New tables in `dst_pool` for the sequences' tables in `src_pool`: one destination
        block per distinct source block, referenced as often as the source was."""
        mapping: dict[int, KVCacheBlock] = {}
        moved = {}
        for request in requests:
            src_table = tables.pop(request.seq_id)
            dst_table = []
            for block in src_table:
                dst = mapping.get(block.block_id)
                if dst is None:
                    (dst,) = dst_pool.allocate(1)
                    mapping[block.block_id] = dst
                    pairs.append((block.block_id, dst.block_id))
                else:
                    dst_pool.touch([dst])
                dst_table.append(dst)
            src_pool.free(reversed(src_table))
            moved[request.seq_id] = dst_table
        return moved

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
        return [b.block_id for b in self.req_to_blocks.get(seq_id, ())]

    @property
    def num_logical_blocks(self) -> int:
        """Blocks the sequences would hold without any sharing (sum of block table lengths)."""
        return sum(len(blocks) for blocks in self.req_to_blocks.values())

    def check_integrity(self) -> None:
        self.block_pool.check_integrity(self.req_to_blocks.values())
        if self.cpu_block_pool is not None:
            self.cpu_block_pool.check_integrity(self.swapped_blocks.values())
        assert not self.req_to_blocks.keys() & self.swapped_blocks.keys(), (
            "a sequence holds device and swap blocks at once"
        )
