"""What the prefix cache publishes when it changes: vLLM's KV cache events, in the same msgpack
shapes (msgspec array-like structs, each event tagged with its class name), so that a router
that reads vLLM's events reads these. Torch-free.

- BlockStored: full blocks entered in the prefix cache, one run of consecutive blocks of one
  sequence: their hashes in chain order, the hash of the block before the first (None for a
  sequence's first block), their token ids, the block size, the LoRA adapter's id.
- BlockRemoved: hashes that left the cache (their block was handed out for new contents).
- AllBlocksCleared: the cache forgotten (a prefix-cache reset; a new engine starts with it).

A hash is the 32-byte SHA-256 of core/block_hash.py (a block of a KV cache group other than the
first carries the group's id in two more bytes): a subscriber can check a BlockStored's hashes
against its token ids. The block pool and the KV cache groups record events while an
`KVEventLog` is attached; the engine takes them after each step and publishes them
(engine/kv_events.py)."""

from __future__ import annotations

import msgspec


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events, as published."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class KVEventLog:
    """The events since the engine last took them. `medium`: where the blocks live, as vLLM
    names it ("GPU" for a CUDA pool; "CPU" for this machine's)."""

    def __init__(self, medium: str) -> None:
        self.medium = medium
        self.events: list[KVCacheEvent] = [AllBlocksCleared()]  # a new cache is empty

    def stored(self, hashes: list[bytes], parent: bytes | None, token_ids: list[int],
               block_size: int, lora_id: int | None) -> None:  # fmt: skip
        self.events.append(BlockStored(hashes, parent, token_ids, block_size, lora_id, self.medium))

    def removed(self, block_hash: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)  # one event for a step's evictions in a row
        else:
            self.events.append(BlockRemoved([block_hash], self.medium))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events
