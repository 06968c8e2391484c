"""Prompt lookup (vLLM's `ngram` method): the last n tokens of a sequence, for n from
prompt_lookup_max down to prompt_lookup_min, are looked up in its earlier tokens (prompt and
output); at the latest earlier occurrence, what followed is the draft. When that continuation
runs into the end of the sequence it repeats with the match's period (a loop keeps looping)."""

from __future__ import annotations

import numpy as np

from pagedllm.sequence import Sequence
from pagedllm.spec_decode.proposer import Proposer


def ngram_match(tokens: np.ndarray, min_n: int, max_n: int) -> int | None:
    """Where the continuation of the latest earlier occurrence of the sequence's last n tokens
    starts (the longest n that has one), or None. Vectorised over the history: one comparison
    per n and token of the n-gram, on the candidates left."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        # Occurrences starting at i < size - n, so that at least one token follows them.
        candidates = np.flatnonzero(tokens[: size - n] == suffix[0])
        for j in range(1, n):
            if not len(candidates):
                break
            candidates = candidates[tokens[candidates + j] == suffix[j]]
        if len(candidates):
            return int(candidates[-1]) + n
    return None


def continuation(tokens: np.ndarray, start: int, k: int) -> list[int]:
    """k tokens from `start` on, continuing periodically past the end (the drafts themselves
    extend the sequence the match was found in)."""
    return np.resize(tokens[start:], k).tolist()


class NgramProposer(Proposer):
    def _propose(self, seq: Sequence, tokens: np.ndarray) -> list[int]:
        config = self.config
        start = ngram_match(tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        if start is None:
            return []
        return continuation(tokens, start, self.num_speculative_tokens)
