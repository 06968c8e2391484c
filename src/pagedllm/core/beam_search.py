"""Beam search bookkeeping for one sequence group, the way HF transformers does it. Torch-free.

Each step every live beam proposes its top K = max(2, 1 + number of EOS ids) x beam_width next
tokens (from the runner). Over all beams the K best by cumulative logprob are ranked; of those,
candidates that end a sequence (EOS / stop token, or max_tokens reached) and rank among the first
beam_width become finished hypotheses, scored by cumulative logprob / generated_length **
length_penalty (the generated length counts the EOS); the best beam_width others continue. The
search ends when beam_width hypotheses are finished and, per `early_stopping`, no running beam can
beat the worst of them (False: judged at the current length, HF's heuristic; "never": at
max_tokens when the length penalty is positive; True: at once), or when no candidate can continue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.outputs import TokenLogprobs


@dataclass
class BeamHypothesis:
    """A finished beam: its output tokens and how it scored."""

    output_token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop" (EOS / stop token) or "length"
    stop_reason: int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # when logprobs were asked for


@dataclass
class BeamCandidate:
    """Beam `parent` (an index into the live beams) extended by `token_id`."""

    parent: int
    token_id: int
    logprob: float  # of the token alone
    cumulative_logprob: float
    rank: int  # of the token among its parent's candidates, 1 = most likely
    record: TokenLogprobs | None = None  # for the output, when logprobs were asked for


class BeamSearchState:
    def __init__(
        self,
        beam_width: int,
        max_tokens: int,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        stop_token_ids: list[int] | tuple[int, ...] = (),
        num_logprobs: int | None = None,
    ) -> None:
        self.beam_width = beam_width
        self.max_tokens = max_tokens
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.stop_token_ids = set(stop_token_ids)
        self.num_logprobs = num_logprobs
        self.num_candidates = max(2, 1 + len(self.stop_token_ids)) * beam_width
        self.finished: list[BeamHypothesis] = []  # best first, at most beam_width
        self.done = False
        self._improvement_possible = True

    @classmethod
    def for_request(cls, request, max_model_len: int) -> BeamSearchState:
        """The search of a beam-search request (a `Sequence`) under `max_model_len`."""
        params = request.sampling_params
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += [t for t in request.eos_token_ids if t not in stop_ids]
        max_tokens = min(
            request.max_tokens or max_model_len, max_model_len - request.num_prompt_tokens
        )
        return cls(
            request.group.num_samples, max_tokens, params.length_penalty, params.early_stopping,
            stop_ids, params.logprobs,
        )  # fmt: skip

    def score(self, cumulative_logprob: float, length: int) -> float:
        return cumulative_logprob / (length**self.length_penalty)

    def step(
        self,
        beams: list[Any],
        candidates: list[tuple[list[int], list[float]]],
        num_generated: int,
    ) -> list[BeamCandidate]:
        """One step. `beams` are the live beam sequences (with `.cumulative_logprob`,
        `.output_token_ids` and `.output_logprobs`), `candidates[i]` beam i's proposed (token ids,
        logprobs), best first; `num_generated` the tokens each beam has generated so far.

        Returns the beams to continue, best first (empty once `done`); finished hypotheses are
        recorded here. The caller forks, extends and frees sequences accordingly.
        """
        assert not self.done
        ranked = [
            BeamCandidate(b, token, lp, beams[b].cumulative_logprob + lp, rank)
            for b, (tokens, lps) in enumerate(candidates)
            for rank, (token, lp) in enumerate(zip(tokens, lps, strict=True), start=1)
        ]
        if self.num_logprobs is not None:
            k = self.num_logprobs
            for c in ranked:
                tokens, lps = candidates[c.parent]
                top = list(zip(tokens[:k], lps[:k], strict=True))
                c.record = TokenLogprobs(c.token_id, c.logprob, c.rank, top)
        # Stable sort: equal scores keep beam order, then token-rank order.
        ranked.sort(key=lambda c: -c.cumulative_logprob)
        ranked = ranked[: self.num_candidates]
        length = num_generated + 1
        at_max = length >= self.max_tokens
        ends = [at_max or c.token_id in self.stop_token_ids for c in ranked]

        # Finished hypotheses come only from the first beam_width ranks; the rest are backups so
        # that beam_width beams can always continue. (HF also masks additions once the search
        # may stop; here a step never runs after that: `done` is set first.)
        for i, c in enumerate(ranked[: self.beam_width]):
            if ends[i]:
                self._add(beams[c.parent], c, length)

        running = [c for c, end in zip(ranked, ends, strict=True) if not end][: self.beam_width]
        if running:
            self._update_improvement_possible(running[0].cumulative_logprob, length)
        full = len(self.finished) == self.beam_width
        self.done = (
            not running or not self._improvement_possible or (full and self.early_stopping is True)
        )
        return [] if self.done else running

    def _add(self, beam: Any, c: BeamCandidate, length: int) -> None:
        stop = c.token_id in self.stop_token_ids
        hyp = BeamHypothesis(
            output_token_ids=[*beam.output_token_ids, c.token_id],
            cumulative_logprob=c.cumulative_logprob,
            score=self.score(c.cumulative_logprob, length),
            finish_reason="stop" if stop else "length",
            stop_reason=c.token_id if stop else None,
            logprobs=[*beam.output_logprobs, c.record] if c.record else [],
        )
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.beam_width :]

    def _update_improvement_possible(self, best_running: float, length: int) -> None:
        """HF's check: can the best running beam still beat the worst finished hypothesis?"""
        if len(self.finished) < self.beam_width:
            return
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = length
        best_possible = self.score(best_running, best_length)
        if best_possible <= self.finished[-1].score:
            self._improvement_possible = False


def step_beams(group: Any, candidates: dict, kv: Any) -> int:
    """One beam search step of a running group: extend the chosen beams (forking a beam chosen
    more than once, sharing its blocks through the KV cache manager `kv`) and free the pruned
    ones at once; `candidates`: each beam's (token ids, logprobs) by seq_id. Returns the change
    in the number of live beams. The caller finishes the group when `group.beam.done`."""
    beams = list(group.seqs)
    chosen = group.beam.step(
        beams, [candidates[b.seq_id] for b in beams], beams[0].num_output_tokens
    )
    children: dict[int, list[BeamCandidate]] = {}
    for c in chosen:
        children.setdefault(c.parent, []).append(c)
    new_order = {}
    for b, beam in enumerate(beams):
        picks = children.get(b)
        if not picks:
            continue
        for c in picks[1:]:  # fork before the parent itself is extended
            child = beam.fork(group.new_seq_id(kv.req_to_blocks), beam.sample_index)
            kv.fork(beam, child)
            _extend_beam(child, c)
            new_order[id(c)] = child
        _extend_beam(beam, picks[0])
        new_order[id(picks[0])] = beam
    for i, beam in enumerate(beams):
        if i not in children:  # pruned
            kv.free(beam)
    group.seqs[:] = [new_order[id(c)] for c in chosen]  # best first, like HF's beams
    return len(group.seqs) - len(beams)


def _extend_beam(beam: Any, c: BeamCandidate) -> None:
    beam.append_output_token(c.token_id)
    beam.cumulative_logprob = c.cumulative_logprob
    if c.record is not None:
        beam.output_logprobs.append(c.record)
