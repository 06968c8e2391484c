"""The proposers' common part: which sequences get drafts, and each one's token history."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from pagedllm.config import SpeculativeConfig
from pagedllm.sequence import Sequence

# Drafts accepted less often than this cost more than they save (a verified row costs about a
# quarter of a one-row step here); such a sequence drafts once every PROBE_EVERY steps.
MIN_ACCEPTANCE = 0.25
PROBE_EVERY = 8
INITIAL_ACCEPTANCE = 0.5  # two wholly rejected drafts in a row take a sequence below


class TokenHistory:
    """A sequence's tokens in a growing numpy buffer, appended to as it decodes (the prompt is
    copied once, not every step)."""

    __slots__ = ("buffer", "size")

    def __init__(self) -> None:
        self.buffer = np.empty(0, np.int64)
        self.size = 0

    @property
    def tokens(self) -> np.ndarray:
        return self.buffer[: self.size]

    def sync(self, known: list[int], new: list[int]) -> np.ndarray:
        """The sequence's tokens: `known` (its token list, which holds everything this history
        has seen but the last step's tokens) and then `new`."""
        if self.size > len(known):  # not a continuation (cannot happen while decoding)
            self.size = 0
        extra = known[self.size :] + new
        end = self.size + len(extra)
        if end > len(self.buffer):
            grown = np.empty(max(end, 2 * len(self.buffer), 64), np.int64)
            grown[: self.size] = self.buffer[: self.size]
            self.buffer = grown
        self.buffer[self.size : end] = extra
        self.size = end
        return self.buffer[:end]


class Proposer:
    """Drafts for the sequences a step sampled. Subclasses implement `_propose` (and may keep
    more per sequence, dropped in `_forget`).

    Each sequence's drafts follow how its last ones fared: a draft rejected after m accepted
    tokens caps the next at m + 1, one accepted whole doubles the cap (up to
    num_speculative_tokens), and a sequence whose drafts are accepted less than MIN_ACCEPTANCE
    of the time (a moving average) only drafts every PROBE_EVERY steps, to find out when its
    text turns predictable. A verified row costs about a quarter of a one-row step on the CPU
    measured (docs/speculative_decoding.md): below that, a draft token costs more than it
    saves."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.histories: dict[str, TokenHistory] = {}  # by seq id
        self._seq_ids: dict[str, set[str]] = {}  # request id -> its seq ids with a history
        # By seq id: the most drafts its next proposal gets, the moving average of its
        # acceptance and the steps it has not drafted in.
        self._caps: dict[str, int] = {}
        self._acceptance: dict[str, float] = {}
        self._idle: dict[str, int] = {}

    def propose(
        self,
        seqs: list[Sequence],
        new_token_ids: dict[str, list[int]],
        verified: dict[str, int],
        batch_size: int,
    ) -> dict[str, list[int]]:
        """Drafts by seq id for `seqs`, given the tokens this step sampled for each and the
        number of drafts it verified for each (the accepted ones are among the tokens); none
        for beam search, a sampling group's first token (it forks), or a batch larger than
        disable_by_batch_size (the step is compute-bound: verifying costs more than it saves)."""
        limit = self.config.disable_by_batch_size
        if limit is not None and batch_size > limit:
            return {}
        wanted = []  # (sequence, its tokens, its draft cap)
        for seq in seqs:
            new = new_token_ids.get(seq.seq_id)
            if not new or seq.group.is_beam_search or seq.num_samples > 1:
                continue
            history = self.histories.get(seq.seq_id)
            if history is None:
                history = self.histories[seq.seq_id] = TokenHistory()
                self._seq_ids.setdefault(seq.request_id, set()).add(seq.seq_id)
            tokens = history.sync(seq.all_token_ids, new)
            cap = self._cap(seq.seq_id, verified.get(seq.seq_id, 0), len(new) - 1)
            if cap:
                wanted.append((seq, tokens, cap))
        return {seq_id: d for seq_id, d in self._propose_many(wanted).items() if d}

    def _propose_many(self, wanted: list[tuple[Sequence, np.ndarray, int]]) -> dict[str, list[int]]:
        """Drafts by seq id for (sequence, tokens, cap) triples: at most `cap` tokens each."""
        return {seq.seq_id: self._propose(seq, tokens)[:cap] for seq, tokens, cap in wanted}

    def _cap(self, seq_id: str, num_verified: int, num_accepted: int) -> int:
        """The sequence's draft cap (0: no draft this step), after a step that verified
        `num_verified` of its drafts and accepted `num_accepted`."""
        cap = self._caps.get(seq_id, self.num_speculative_tokens)
        if num_verified:
            rate = self._acceptance.get(seq_id, INITIAL_ACCEPTANCE)
            self._acceptance[seq_id] = 0.7 * rate + 0.3 * num_accepted / num_verified
            full = num_accepted == num_verified
            cap = min(2 * cap, self.num_speculative_tokens) if full else num_accepted + 1
            self._caps[seq_id] = cap
        if self._acceptance.get(seq_id, INITIAL_ACCEPTANCE) >= MIN_ACCEPTANCE:
            return cap
        idle = self._idle.get(seq_id, 0) + 1
        self._idle[seq_id] = idle % PROBE_EVERY
        return cap if idle == PROBE_EVERY else 0

    def reset(self) -> None:
        """Forget every request (another engine takes the runner over)."""
        type(self).__init__(self, self.config)

    def finish(self, request_ids: Iterable[str]) -> None:
        """Forget the requests that ended."""
        for request_id in request_ids:
            for seq_id in self._seq_ids.pop(request_id, ()):
                for state in (self._caps, self._acceptance, self._idle):
                    state.pop(seq_id, None)
                self._forget(seq_id, self.histories.pop(seq_id))

    def _propose(self, seq: Sequence, tokens: np.ndarray) -> list[int]:
        raise NotImplementedError

    def _forget(self, seq_id: str, history: TokenHistory) -> None:
        """A sequence of a finished request leaves (its history already removed)."""
