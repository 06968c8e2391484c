"""What one forward pass needs to read and write the paged KV cache.

Tokens of all scheduled requests are flattened into one batch (no padding). Request i owns
query rows query_start_loc[i]:query_start_loc[i+1]; those are the last q_len tokens of its
context of seq_lens[i] tokens, so one code path serves prefill, chunked prefill with cached
context, and decode (q_len == 1).
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]
