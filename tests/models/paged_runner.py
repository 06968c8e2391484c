"""A minimal paged model runner for tests: shuffled physical blocks, per-request block tables,
AttentionMetadata built step by step, greedy decoding. Not the engine's runner: just enough
scheduling (chunked prefill, decode rows batched with prefill rows) to exercise the model."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed import head_shard
from pagedllm.layers.recurrent import RecurrentState


@dataclass
class Req:
    token_ids: list[int]
    chunk_size: int  # prompt tokens scheduled per step while prefilling
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # one per sampled token
    num_prompt_tokens: int = 0


class PagedRunner:
    def __init__(
        self, model, block_size: int = 4, num_blocks: int = 128, seed: int = 0, fused=None
    ):
        """`fused`: the model's fused decoder, taken where it applies (as ModelRunner does)."""
        c = model.config
        self.model, self.block_size, self.fused = model, block_size, fused
        shape = (num_blocks, block_size, head_shard(c).num_kv_heads, c.head_dim)
        # NaN-filled: reading a slot nobody wrote turns the logits into NaN. A Mamba layer's
        # "cache" is its state pool, a slot per request (NaN too: a fresh one is zeroed).
        conv, ssm = c.recurrent_state_shapes
        self.kv_caches = [
            RecurrentState(
                torch.full((8, *conv), float("nan"), dtype=model.dtype),
                torch.full((8, *ssm), float("nan")),
            )
            if c.is_recurrent_layer(i)
            else (
                torch.full(shape, float("nan"), dtype=model.dtype),
                torch.full(shape, float("nan"), dtype=model.dtype),
            )
            for i in range(c.num_hidden_layers)
        ]
        self.state_slots: dict[int, int] = {}  # id(Req) -> its slot
        g = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(num_blocks, generator=g).tolist()

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, chunk_sizes: list[int] | None = None
    ) -> list[Req]:
        """Greedy decoding of all prompts together; every step schedules each unfinished request
        (a prompt chunk of chunk_size tokens, or one decode token)."""
        chunk_sizes = chunk_sizes or [len(p) for p in prompts]
        reqs = [
            Req(list(p), cs, num_prompt_tokens=len(p))
            for p, cs in zip(prompts, chunk_sizes, strict=True)
        ]
        while True:
            active = [r for r in reqs if len(r.token_ids) - r.num_prompt_tokens < max_new_tokens]
            if not active:
                return reqs
            sched = [
                (r, min(r.chunk_size, len(r.token_ids) - r.num_computed_tokens)) for r in active
            ]
            hidden = self.step(sched)
            last_rows = torch.tensor(list(itertools.accumulate(n for _, n in sched))) - 1
            logits = self.model.compute_logits(hidden[last_rows])
            tokens = self.greedy(logits, len(sched))
            for i, (r, _) in enumerate(sched):
                if r.num_computed_tokens == len(r.token_ids):  # prompt done: sample
                    if logits is not None:
                        r.logits.append(logits[i])
                    r.token_ids.append(tokens[i])

    def greedy(self, logits: torch.Tensor | None, rows: int) -> list[int]:
        """The argmax of each row (tests/distributed/tp_rank.py: rank 0's, to every rank)."""
        return logits.argmax(-1).tolist()

    def step(self, sched: list[tuple[Req, int]]) -> torch.Tensor:
        """Run the model on num_tokens new tokens of each request; returns hidden [T, hidden]."""
        bs = self.block_size
        input_ids, positions, slot_mapping, seq_lens = [], [], [], []
        for r, n in sched:
            start = r.num_computed_tokens
            while len(r.block_table) < math.ceil((start + n) / bs):
                r.block_table.append(self.free_blocks.pop())
            for p in range(start, start + n):
                input_ids.append(r.token_ids[p])
                positions.append(p)
                slot_mapping.append(r.block_table[p // bs] * bs + p % bs)
            seq_lens.append(start + n)
        meta = AttentionMetadata.build(
            bs, slot_mapping, [r.block_table for r, _ in sched], [n for _, n in sched], seq_lens
        )
        meta.state_slots = [
            self.state_slots.setdefault(id(r), 7 - len(self.state_slots)) for r, _ in sched
        ]
        input_ids, positions = torch.tensor(input_ids), torch.tensor(positions)
        with torch.inference_mode():
            if self.fused is not None and self.fused.applies(len(input_ids), meta):
                embedded = self.model.model.embed(input_ids)
                hidden = self.fused(embedded, positions, self.kv_caches, meta)
            else:
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
        for r, n in sched:
            r.num_computed_tokens += n
        return hidden
