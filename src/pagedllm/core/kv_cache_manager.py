"""Per-request block tables over the block pool. Torch-free."""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each request's logical blocks to physical ones, growing the table on demand."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int) -> int:
        have = len(self.req_to_blocks.get(request.request_id, ()))
        need = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, need - have)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens; False, changing nothing, if short."""
        num_new_blocks = self.num_blocks_to_allocate(request, num_new_tokens)
        if num_new_blocks > self.block_pool.num_free_blocks:
            return False
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if num_new_blocks:
            blocks.extend(self.block_pool.allocate(num_new_blocks))
        return True

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def check_integrity(self) -> None:
        self.block_pool.check_integrity(self.req_to_blocks.values())
