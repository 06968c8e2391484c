"""How many tokens each sequence of a group gets in a step (the scheduler's plan). Torch-free."""

from __future__ import annotations

from pagedllm.core.state_checkpoints import StateCheckpoints
from pagedllm.sequence import Sequence


def plan_tokens(
    seqs: list[Sequence],
    budget: int,
    num_computed: list[int],
    chunked_prefill: bool,
    checkpoints: StateCheckpoints | None = None,
) -> list[tuple[Sequence, int]]:
    """Tokens to schedule for each sequence of a group within `budget`, from `num_computed`.

    A sequence needs `num_tokens - num_computed` tokens. If the group cannot have them all,
    each gets what the budget allows but stops one token short of its end, so that no
    sequence of the group reaches its end (and samples) without the others. A single
    sequence is chunked only with chunked prefill enabled, or to end a chunk where a hybrid
    model checkpoints its prompt's state (`checkpoints`: state_checkpoints.py; a group of one
    sequence: a larger one's chunks would leave the lockstep).
    """
    plan = _plan(seqs, budget, num_computed, chunked_prefill)
    if checkpoints is not None and len(plan) == 1 and len(seqs) == 1:
        ((seq, num_new),) = plan
        plan = [(seq, checkpoints.cap(seq, num_computed[0], num_new))]
    return plan


def _plan(
    seqs: list[Sequence], budget: int, num_computed: list[int], chunked_prefill: bool
) -> list[tuple[Sequence, int]]:
    remaining = [s.num_tokens - c for s, c in zip(seqs, num_computed, strict=True)]
    drafts = [len(s.spec_token_ids) for s in seqs]
    if sum(remaining) + sum(drafts) <= budget:
        return [(s, n + d) for s, n, d in zip(seqs, remaining, drafts, strict=True) if n + d]
    for seq in seqs:  # a short budget drops the drafts first
        seq.spec_token_ids = []
    if sum(remaining) <= budget:
        return [(s, n) for s, n in zip(seqs, remaining, strict=True) if n > 0]
    if len(seqs) == 1 and not chunked_prefill:
        return []
    plan = []
    for seq, need in zip(seqs, remaining, strict=True):
        num_new = min(need, budget) if len(seqs) == 1 else min(need - 1, budget)
        if num_new > 0:
            plan.append((seq, num_new))
            budget -= num_new
    return plan
