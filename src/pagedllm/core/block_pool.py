"""The physical KV-cache blocks: reference counts and an O(1) free queue. Torch-free."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """Hands out blocks and takes them back the moment their reference count reaches zero."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: deque[KVCacheBlock] = deque(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block in blocks:
            assert block.ref_cnt == 0, block
            block.ref_cnt = 1
        return blocks

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free.append(block)

    def check_integrity(self, block_tables: Iterable[list[KVCacheBlock]]) -> None:
        """free + in use == total, and every ref count equals the number of tables holding it."""
        expected = [0] * self.num_blocks
        for table in block_tables:
            for block in table:
                expected[block.block_id] += 1
        actual = [b.ref_cnt for b in self.blocks]
        assert actual == expected, "reference counts disagree with the block tables"
        free_ids = [b.block_id for b in self._free]
        assert len(free_ids) == len(set(free_ids)), "a block is in the free queue twice"
        assert all(self.blocks[i].ref_cnt == 0 for i in free_ids), (
            "a used block is in the free queue"
        )
        num_used = sum(1 for c in expected if c > 0)
        assert num_used + len(free_ids) == self.num_blocks, "blocks leaked: free + used != total"
