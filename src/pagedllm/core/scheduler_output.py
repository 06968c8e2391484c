"""What the scheduler hands the model runner for one step. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.kv_cache_interface import BlockPair
from pagedllm.sequence import Sequence


@dataclass
class SchedulerOutput:
    """What the model runner needs for one step; the scheduler never touches tensors."""

    scheduled_requests: list[Sequence]  # sequences; dicts below are keyed by their seq_id
    num_scheduled_tokens: dict[str, int]
    # Per sequence, one block table per KV cache group.
    block_ids: dict[str, list[list[int]]]
    total_num_scheduled_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that left since the previous step, so the runner can drop their state.
    finished_request_ids: set[str] = field(default_factory=set)
    # Copy-on-write (source block id, destination block id) pairs, copied before the forward.
    blocks_to_copy: list[BlockPair] = field(default_factory=list)
    # Swap (device block, cpu block) pairs out and (cpu block, device block) pairs in; the
    # runner swaps out, then in, then copies, all before the forward.
    blocks_to_swap_out: list[BlockPair] = field(default_factory=list)
    blocks_to_swap_in: list[BlockPair] = field(default_factory=list)
    # Speculative decoding: the draft tokens each sequence verifies this step; they follow its
    # known tokens and are counted in num_scheduled_tokens.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # (parent, child) seq ids forked since the previous step (n > 1, beam search): the runner
    # copies a hybrid model's recurrent state from parent to child before the forward.
    forked_seqs: list[tuple[str, str]] = field(default_factory=list)
    # The seq ids of the groups swapped out / back in this step (with blocks_to_swap_*): the
    # runner stashes a hybrid model's recurrent state in host memory, then restores it.
    swapped_out_seqs: list[str] = field(default_factory=list)
    swapped_in_seqs: list[str] = field(default_factory=list)
    # The seq ids whose blocks were freed since the previous step (pruned beams, finished or
    # preempted sequences): a hybrid model's runner frees their state slots first, before the
    # forks take theirs (a fork's stopped parent after it).
    freed_seqs: list[str] = field(default_factory=list)
    # Prefix caching for hybrid models (core/state_checkpoints.py): (seq id, checkpoint slot)
    # pairs; the checkpoint restored into the sequence's state slot before the forward (a
    # prefix hit), and the sequence's state saved into the checkpoint slot after it.
    state_checkpoint_loads: list[tuple[str, int]] = field(default_factory=list)
    state_checkpoint_saves: list[tuple[str, int]] = field(default_factory=list)

    def needs_sample(self, request: Sequence) -> bool:
        """True when this step reaches the end of the sequence's known tokens."""
        n = self.num_scheduled_tokens[request.seq_id]
        return request.num_computed_tokens + n >= request.num_tokens

    @property
    def is_empty(self) -> bool:
        """Nothing to run and no block or state to move."""
        return not (
            self.scheduled_requests
            or self.blocks_to_swap_out
            or self.blocks_to_swap_in
            or self.swapped_out_seqs
            or self.swapped_in_seqs
        )


@dataclass
class SpecDecodeStats:
    """Speculative decoding so far (vLLM's counters): verification rounds, draft tokens
    verified, those accepted, and acceptances by position in the draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for pos in range(num_accepted):
            per_pos[pos] += 1
