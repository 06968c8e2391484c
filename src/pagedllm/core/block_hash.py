"""The names of full blocks for prefix caching, as vLLM V1 does it. Torch-free.

A FULL block is named by a hash chained over its parent block's hash and its token ids (the first
block also mixes in the sequence's `cache_salt` and its LoRA adapter's id), so equal hashes mean
equal prefixes under the same weights and therefore equal K/V.
"""

from __future__ import annotations

import hashlib
from array import array

from pagedllm.core.block_pool import BlockHash
from pagedllm.sequence import Sequence

_NONE_HASH = b"\x00" * 32


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: list[int] | tuple[int, ...],
    extra: str | None = None,
    lora_id: int | None = None,
) -> BlockHash:
    """SHA-256 over (parent hash, token ids as int64, extra key, LoRA adapter id).

    SHA-256 rather than the builtin `hash()`: it is 256 bits, so a collision (two different
    prefixes sharing blocks, i.e. silently wrong output) is out of reach even for a prompt crafted
    to poison another user's cache, and it is the same in every process (the builtin `hash` of a
    str salt is randomised per process). It costs about a microsecond per block, once per block.
    """
    h = hashlib.sha256(parent_hash or _NONE_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra is not None:  # length first: a salt cannot spell the adapter's bytes after it
        raw = extra.encode()
        h.update(b"\x01salt")
        h.update(array("q", [len(raw)]).tobytes())
        h.update(raw)
    if lora_id is not None:
        h.update(b"\x02lora")
        h.update(array("q", [lora_id]).tobytes())
    return h.digest()


def update_block_hashes(seq: Sequence, block_size: int) -> list[BlockHash]:
    """Extend `seq.block_hashes` to cover every full block of its tokens (incrementally)."""
    hashes = seq.block_hashes
    tokens = seq.all_token_ids
    for i in range(len(hashes), len(tokens) // block_size):
        parent = hashes[i - 1] if i else None
        salt, lora = (seq.cache_salt, seq.lora_request) if i == 0 else (None, None)
        block = tokens[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block_tokens(parent, block, salt, lora and lora.lora_int_id))
    return hashes
