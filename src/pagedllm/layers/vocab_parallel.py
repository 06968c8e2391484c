"""The embedding over this rank's rows of the vocabulary (distributed/parallel.py): tokens of
other ranks' rows embed as zeros, and the all-reduce adds the one rank's row that holds each.
With one rank it is nn.Embedding exactly."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed import all_reduce, tp_group, vocab_shard


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None):
        self.vocab_start, rows = vocab_shard(vocab_size)
        super().__init__(rows, hidden_size, dtype=dtype)
        self.tp_size = tp_group().size

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = super().forward(torch.where(mine, local, 0))
        return all_reduce(out.masked_fill_(~mine[:, None], 0))
