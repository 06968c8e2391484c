"""A request's sequences, shared by the scheduler (torch-free) and the model runner.

A `Sequence` is a prompt and the tokens generated after it. A user request that asks
for several outputs (n > 1 or best_of samples, or beam search) is a `SequenceGroup` of such
sequences: it starts as one sequence, which is forked after the prompt (samples) or at every step
(beams). Forked sequences share their blocks until one writes into a shared block
(copy-on-write, in the KV cache manager). The scheduler treats a group as a unit: admitted,
scheduled, preempted and resumed together.
"""

from __future__ import annotations

import copy
import enum
import itertools
import time
from typing import Any

from pagedllm.lora_request import LoRARequest
from pagedllm.request import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    """Ordered: every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()  # preempted with its blocks in the swap space
    PREEMPTED = enum.auto()  # preempted for recompute
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > SequenceStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    """One sequence: a prompt and its generated tokens.

    The one invariant the scheduler drives: `num_computed_tokens` (tokens whose K/V are in the
    cache) catches up with `num_tokens` (prompt + output). Prefill, chunked prefill and recompute
    after preemption are all the same rule.
    """

    def __init__(
        self,
        request: EngineCoreRequest,
        eos_token_ids: list[int] | None = None,
        max_tokens: int | None = None,
    ) -> None:
        # The user's request as it arrived, carried unchanged (shared by the group's
        # sequences): its id, prompt, parameters, arrival time, salt, adapter and priority.
        self.request = request
        # The key of this sequence's block table and scheduled tokens: the request id for the
        # first sequence of a group, a derived unique id for its forks.
        self.seq_id = request.request_id
        self.sample_index = 0  # which of the group's samples (or beams) this is
        # A pooling request's placeholder, never read for sampling: it is prefill-only.
        self.sampling_params = request.sampling_params or SamplingParams(max_tokens=1)
        self.eos_token_ids = list(eos_token_ids or [])
        # Resolved output budget (sampling_params.max_tokens, capped by max_model_len).
        self.max_tokens = max_tokens if max_tokens is not None else self.sampling_params.max_tokens
        self.status = SequenceStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # Sum of the raw logprobs of the output tokens (ranks best_of samples and beams), and the
        # runner's per-token logprob records when they are computed.
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[Any] = []
        # Prefix caching: the hashes of the full blocks so far, extended as tokens grow (by
        # core.block_hash.update_block_hashes; the request's cache_salt and adapter mix in).
        self.block_hashes: list[bytes] = []
        # Structured outputs: this sequence's grammar state (a structured_output.Grammar), which
        # consumes each output token; None when unconstrained.
        self.grammar: Any = None
        # Speculative decoding: the draft tokens proposed to follow `all_token_ids`, verified
        # by the next step (never part of the tokens until accepted).
        self.spec_token_ids: list[int] = []
        # Embedding requests (a pooling_params.PoolingParams): prefill-only, they end with
        # `pooled`, the prompt's pooled hidden state (a float32 CPU tensor), and sample nothing.
        self.pooling_params: Any = None
        self.pooled: Any = None
        self.group = SequenceGroup(self)

    @classmethod
    def of(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int] | None = None,
        *,
        max_tokens: int | None = None,
        arrival_time: float | None = None,
        **fields,
    ) -> Sequence:
        """The first sequence of a request made here, not by an engine's client (a scheduler
        driven by a fake model, a simulation); `fields`: EngineCoreRequest's others."""
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            **fields,
        )
        return cls(request, eos_token_ids, max_tokens)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt(self) -> str | None:
        return self.request.prompt

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time

    @property
    def cache_salt(self) -> str | None:
        """Mixed into the first block's hash: only requests with the same salt share blocks."""
        return self.request.cache_salt

    @property
    def lora_request(self) -> LoRARequest | None:
        return self.request.lora_request

    @property
    def priority(self) -> int:
        """With --scheduling-policy priority, lower values run first."""
        return self.request.priority

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def needs_every_position(self) -> bool:
        """True when every prompt position must be computed here (no prefix-cache hits):
        prompt logprobs score them all, and mean or first-token pooling reads their hidden
        states (cached blocks hold K/V, not hidden states)."""
        if self.sampling_params.prompt_logprobs is not None:
            return True
        return self.pooling_params is not None and self.pooling_params.pooling_type != "LAST"

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept_token(token_id)

    def check_stop(self, token_id: int, max_model_len: int) -> SequenceStatus | None:
        """The status that `token_id`, just appended, ends this sequence with, if any."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                self.stop_reason = None
                return SequenceStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                self.stop_reason = token_id
                return SequenceStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.is_terminated():
            self.stop_reason = None  # the constrained output is complete
            return SequenceStatus.FINISHED_STOPPED
        if self.max_tokens is not None and self.num_output_tokens >= self.max_tokens:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        if self.num_tokens >= max_model_len:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        return None

    def usable_drafts(self, drafts: list[int] | None, max_model_len: int) -> list[int]:
        """The proposed drafts a step can verify: no more than could be kept (max_tokens,
        max_model_len: a step yields one token more than it verifies), and only those this
        sequence's grammar would take."""
        if not drafts:
            return []
        room = max_model_len - self.num_tokens
        if self.max_tokens is not None:
            room = min(room, self.max_tokens - self.num_output_tokens)
        drafts = drafts[: max(0, room - 1)]
        if self.grammar is not None and drafts:
            drafts = drafts[: self.grammar.num_valid(drafts)]
        return drafts

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens past the first `num_output_tokens` (a stop string matched
        before the last of several tokens a step accepted). Only for a sequence that ends."""
        dropped = self.num_output_tokens - num_output_tokens
        if dropped <= 0:
            return
        for record in self.output_logprobs[num_output_tokens:]:
            self.cumulative_logprob -= record.logprob
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[len(self.all_token_ids) - dropped :]
        del self.output_logprobs[num_output_tokens:]

    def with_drafts(self, drafts: list[int]) -> Sequence:
        """A view of this sequence as if `drafts` were accepted: what sampling the position
        after them sees (penalties, min_tokens, its grammar's state). The grammar is a copy;
        the sequence itself is unchanged."""
        view = copy.copy(self)
        view.output_token_ids = self.output_token_ids + drafts
        if self.grammar is not None:
            view.grammar = self.grammar.fork()
            for token_id in drafts:
                view.grammar.accept_token(token_id)
        return view

    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_samples(self) -> int:
        """Tokens to draw from this sequence's next logits: every sample of a group that has not
        forked yet (it forks on its first token), otherwise one."""
        group = self.group
        if group.num_samples > 1 and not group.is_beam_search and self.num_output_tokens == 0:
            return group.num_samples
        return 1

    def fork(self, seq_id: str, sample_index: int) -> Sequence:
        """A copy sharing everything so far; the KV cache manager shares its blocks."""
        child = copy.copy(self)
        child.seq_id = seq_id
        child.sample_index = sample_index
        child.output_token_ids = list(self.output_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.output_logprobs = list(self.output_logprobs)
        child.spec_token_ids = []
        if self.grammar is not None:
            child.grammar = self.grammar.fork()
        self.group.seqs.append(child)
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )


class SequenceGroup:
    """The sequences of one user request (see the module docstring).

    `seqs` holds the live sequences in sample order; finished ones move to `finished_seqs`.
    Beam search keeps its finished hypotheses in `beam` (a `BeamSearchState`) instead.
    """

    def __init__(self, first: Sequence) -> None:
        params = first.sampling_params
        self.request = first.request  # the user's request, unchanged
        self.request_id = first.request_id
        self.first = first  # the original sequence
        self.seqs: list[Sequence] = [first]
        self.finished_seqs: list[Sequence] = []
        self.is_beam_search = params.use_beam_search
        # Sequences to run: best_of samples (n unless given) or beam_width beams.
        self.num_samples = params.num_sequences
        self.beam: Any = None  # a BeamSearchState, set by the scheduler for beam search
        self.num_preemptions = 0
        self._fork_ids = itertools.count(1)

    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time

    @property
    def sampling_params(self):
        return self.first.sampling_params

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def lora_int_id(self) -> int | None:
        """The adapter the group runs with (its slot must be free to admit it), or None."""
        lora = self.request.lora_request
        return None if lora is None else lora.lora_int_id

    def is_finished(self) -> bool:
        return not self.seqs

    @property
    def max_num_running_seqs(self) -> int:
        """Sequences this group may run at once (what admission must leave room for)."""
        if self.is_beam_search or (self.seqs and self.seqs[0].num_samples > 1):
            return self.num_samples  # beams, or samples that have not forked yet
        return len(self.seqs)

    def new_seq_id(self, taken) -> str:
        """A fork id unique among the live sequences `taken` (a container of seq ids)."""
        while True:
            seq_id = f"{self.request_id}#{next(self._fork_ids)}"
            if seq_id not in taken:
                return seq_id

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, seqs={self.seqs})"
