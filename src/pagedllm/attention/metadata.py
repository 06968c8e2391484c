"""What one forward pass needs to read and write the paged KV cache.

Tokens of all scheduled requests are flattened into one batch (no padding). Request i owns
query rows query_start_loc[i]:query_start_loc[i+1]; those are the last q_len tokens of its
context of seq_lens[i] tokens, so one code path serves prefill, chunked prefill with cached
context, and decode (q_len == 1).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    block_size: int
    # [num_tokens] int64: cache slot (block_id * block_size + offset) to write each new K/V into.
    slot_mapping: torch.Tensor
    # [num_reqs, max_num_blocks] int32: physical block ids per logical block (padded with 0).
    block_tables: torch.Tensor
    # [num_reqs + 1] int32 cumulative query lengths, and [num_reqs] int32 context lengths
    # (cached tokens + this step's tokens).
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    # Host copies, so Python-side loops never synchronise with the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # With several KV cache groups (sliding-window models): every group's metadata (the same
    # but for block_tables and slot_mapping) and each layer's group.
    groups: list[AttentionMetadata] | None = None
    layer_group: list[int] | None = None
    # Hybrid models: each request's slot in the Mamba layers' state pools (layers/mamba2.py).
    state_slots: list[int] | None = None

    def for_layer(self, layer_idx: int) -> AttentionMetadata:
        return self if self.groups is None else self.groups[self.layer_group[layer_idx]]

    def with_tables(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor):
        """The same batch seen through another group's block tables."""
        return dataclasses.replace(self, slot_mapping=slot_mapping, block_tables=block_tables)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @functools.cached_property
    def fresh(self) -> list[bool]:
        """Per request: nothing computed before this step (a recurrent state starts at zero);
        once a step, for all the Mamba layers."""
        qsl = self.query_start_loc_cpu
        return [n == qsl[i + 1] - qsl[i] for i, n in enumerate(self.seq_lens_cpu)]

    @classmethod
    def build(
        cls,
        block_size: int,
        slot_mapping: Sequence[int] | np.ndarray,
        block_tables: Sequence[Sequence[int]] | np.ndarray,
        query_lens: Sequence[int] | np.ndarray,
        seq_lens: Sequence[int] | np.ndarray,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """From host-side values; ragged block tables are padded with block 0."""
        if not isinstance(block_tables, np.ndarray):
            width = max(len(t) for t in block_tables)
            padded = np.zeros((len(block_tables), width), np.int32)
            for i, table in enumerate(block_tables):
                padded[i, : len(table)] = table
            block_tables = padded
        query_start_loc = np.zeros(len(query_lens) + 1, np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        seq_lens = np.asarray(seq_lens, np.int64)

        def to_device(a, dtype):
            return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).to(device)

        return cls(
            block_size=block_size,
            slot_mapping=to_device(slot_mapping, np.int64),
            block_tables=to_device(block_tables, np.int32),
            query_start_loc=to_device(query_start_loc, np.int32),
            seq_lens=to_device(seq_lens, np.int32),
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(np.max(query_lens)),
            max_seq_len=int(seq_lens.max()),
        )
