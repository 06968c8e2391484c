"""Speculative decoding's `draft_model` method: a second model drafts, by default the target's
own weights as int4 codes (self-drafting; or any model with the target's vocabulary).

The draft runs on rank 0 over its own paged KV cache: a pool with as many blocks of the same
size as the target's (the worker splits the KV budget between the two), its own block tables
from core's KVCacheManager, one per sequence. After a step, each sequence that drafts catches
up (one forward over its tokens the draft has not seen: the whole prompt at first, then the
step's accepted tokens and its next one) and then drafts greedily, one token per forward, all
such sequences batched in each forward. Greedy drafts are a point mass, so verification by
sampling each position (model_runner.py) keeps the target's distribution exactly.

The draft's K/V for its own draft tokens stays valid while they are accepted: at the next
proposal the draft's computed positions are those whose tokens turned out as drafted, and the
blocks past them go back to its pool (KVCacheManager.trim): the rollback of rejected drafts.
No prefix caching in the draft's pool: a new request's prompt is prefilled by the draft once."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.config import SpeculativeConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.distributed.step_channel import StepInputs, pairs
from pagedllm.sequence import Sequence
from pagedllm.spec_decode.proposer import Proposer, TokenHistory
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")


@dataclass
class DraftSeq:
    """A sequence as the draft's KV cache manager sees it."""

    seq_id: str
    num_computed_tokens: int = 0  # leading positions whose draft K/V holds the known tokens
    drafted: tuple[int, list[int]] = (0, [])  # (first position, tokens) fed as drafts last time


class DraftModelProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, max_model_len: int) -> None:
        self.runner = runner  # the draft model's; only its forward pass is used
        self.max_model_len = max_model_len
        self.kv: KVCacheManager | None = None
        super().__init__(config)
        self.seqs: dict[str, DraftSeq] = {}

    @property
    def bytes_per_block(self) -> int:
        return self.runner.kv_cache_spec.bytes_per_block

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        self.reset()

    def reset(self) -> None:
        """Forget every sequence: all the draft's blocks free."""
        Proposer.__init__(self, self.config)
        self.seqs = {}
        spec = self.runner.kv_cache_spec
        num_blocks = self.runner.kv_cache.pool.shape[2] if self.runner.kv_cache else 0
        self.kv = KVCacheManager(max(num_blocks, 1), spec.block_size,
                                 enable_prefix_caching=False,
                                 sliding_windows=spec.sliding_windows)  # fmt: skip

    def _forget(self, seq_id: str, history: TokenHistory) -> None:
        state = self.seqs.pop(seq_id, None)
        if state is not None:
            self.kv.free(state)

    def _propose_many(self, wanted: list[tuple[Sequence, np.ndarray, int]]) -> dict[str, list[int]]:
        """Catch up, then draft each sequence's tokens, one batched forward per draft token."""
        feeds = []  # per drafting sequence: (state, tokens to feed, cap)
        for seq, tokens, cap in wanted:
            # No more drafts than the step could keep (Sequence.usable_drafts cuts the rest).
            room = self.max_model_len - len(tokens)
            if seq.max_tokens is not None:
                room = min(room, seq.max_tokens - (len(tokens) - seq.num_prompt_tokens))
            cap = min(cap, room - 1)
            if cap < 1:
                continue
            state = self.seqs.setdefault(seq.seq_id, DraftSeq(seq.seq_id))
            self._roll_back(state, tokens)
            # Room for the tokens to feed and the cap - 1 drafts fed after them.
            feed = tokens[state.num_computed_tokens :].tolist()
            if self.kv.allocate_slots(state, len(feed) + cap - 1) is None:
                continue  # the draft's pool is full (its requests preempted): no draft now
            feeds.append((state, feed, cap))
        drafts = {state.seq_id: [] for state, _, _ in feeds}
        for j in range(max((cap for _, _, cap in feeds), default=0)):
            active = [(s, f) for s, f, cap in feeds if j < cap]
            next_tokens = self._forward(active)
            for (state, feed), token in zip(active, next_tokens, strict=True):
                state.num_computed_tokens += len(feed)
                drafts[state.seq_id].append(token)
            feeds = [(s, [drafts[s.seq_id][-1]], cap) for s, _, cap in feeds]
        for seq_id, tokens in drafts.items():
            state = self.seqs[seq_id]
            # The last draft was never fed: its K/V is not in the draft's cache.
            fed = tokens[:-1]
            state.num_computed_tokens -= len(fed)
            state.drafted = (state.num_computed_tokens, fed)
        return drafts

    def _roll_back(self, state: DraftSeq, tokens: np.ndarray) -> None:
        """Keep the K/V of the drafts fed last time while they are what the sequence holds
        (a draft the target never verified may still equal what it sampled there); the blocks
        past the positions kept go back to the pool."""
        start, fed = state.drafted
        kept = 0
        while kept < len(fed) and start + kept < len(tokens) and tokens[start + kept] == fed[kept]:
            kept += 1
        # The last token is fed again even if its K/V is there: its logits give the draft.
        state.num_computed_tokens = min(start + kept, len(tokens) - 1)
        state.drafted = (state.num_computed_tokens, [])
        self.kv.trim(state, state.num_computed_tokens)

    def _forward(self, feeds: list[tuple[DraftSeq, list[int]]]) -> list[int]:
        """The draft model over each sequence's fed tokens (at its computed positions on):
        the greedy next token after each sequence's last one."""
        query_lens = np.array([len(f) for _, f in feeds], np.int64)
        num_computed = np.array([s.num_computed_tokens for s, _ in feeds], np.int64)
        starts = np.zeros(len(feeds) + 1, np.int64)
        np.cumsum(query_lens, out=starts[1:])
        req_index = np.repeat(np.arange(len(feeds)), query_lens)
        positions = np.arange(starts[-1]) - starts[req_index] + num_computed[req_index]
        tables = []
        for g in range(self.kv.num_kv_cache_groups):
            ids = [self.kv.get_group_block_ids(s.seq_id)[g] for s, _ in feeds]
            table = np.zeros((len(feeds), max(map(len, ids))), np.int32)
            for i, row in enumerate(ids):
                table[i, : len(row)] = row
            tables.append(table)
        none = pairs([])
        step = StepInputs(
            none, none, none, input_ids=np.concatenate([f for _, f in feeds]).astype(np.int64),
            positions=positions, req_index=req_index, query_lens=query_lens,
            seq_lens=num_computed + query_lens, block_tables=tables,
            sample_logits_rows=starts[1:] - 1,
        )  # fmt: skip
        logits = self.runner.execute(step).sample
        return torch.argmax(logits, dim=-1).tolist()
