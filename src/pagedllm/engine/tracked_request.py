"""A request in flight through the engine process, as the API server's side knows it
(engine/core_client.py): enough to resubmit it to another engine process, and the whole outputs
of callers that want them (the engine process streams deltas only)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pagedllm.engine.core_request import EngineCoreRequest
from pagedllm.engine.streams import RequestStream
from pagedllm.outputs import CompletionOutput, RequestOutput, ResumedOutput
from pagedllm.pooling_params import PoolingParams


@dataclass
class TrackedRequest:
    request: EngineCoreRequest  # as sent to the first engine process (resumed: None)
    delta: bool
    stream: RequestStream
    sent: bool = False  # added to the current engine process
    num_faults: int = 0  # engine failures blamed on requests it was in flight for
    probation: bool = False  # runs only alone among requests on probation
    # What was handed out (a single-sequence request resumes from it).
    token_ids: list[int] = field(default_factory=list)
    num_text_chars: int = 0
    cumulative_logprob: float = 0.0
    handed_out: bool = False
    first_times: tuple | None = None  # (first_scheduled_time, first_token_time)
    completions: dict[int, CompletionOutput] = field(default_factory=dict)  # whole outputs

    @property
    def resumable(self) -> bool:
        params = self.request.params
        if isinstance(params, PoolingParams):
            return True  # nothing handed out before its one output
        return params.num_sequences == 1 and not params.use_beam_search

    def resumed_output(self) -> ResumedOutput | None:
        """What another engine process resumes it from (None: from the start)."""
        if not self.token_ids:
            return None
        return ResumedOutput(list(self.token_ids), self.num_text_chars, self.cumulative_logprob)

    def start_over(self) -> None:
        """A request that cannot resume runs again from the start (nothing was handed out)."""
        self.completions.clear()

    def hand_out(self, output):
        """Note what `output` (the engine's delta) hands out; returns the caller's view of it."""
        self.handed_out = True
        if not isinstance(output, RequestOutput):
            return output  # an embedding's one output
        metrics = output.metrics
        if metrics is not None:
            if self.first_times is None and metrics.first_token_time is not None:
                self.first_times = (metrics.first_scheduled_time, metrics.first_token_time)
            elif self.first_times is not None:  # resumed: its first times were before
                metrics.first_scheduled_time, metrics.first_token_time = self.first_times
        if self.resumable and output.outputs:
            (c,) = output.outputs
            self.token_ids += c.token_ids
            self.num_text_chars += len(c.text)
            if c.cumulative_logprob is not None:
                self.cumulative_logprob = c.cumulative_logprob
        if not self.delta:
            output.outputs = self._whole(output.outputs)
        return output

    def _whole(self, deltas: list[CompletionOutput]) -> list[CompletionOutput]:
        """The completions so far, each delta added to its sequence's (copies: the caller may
        keep each output)."""
        for c in deltas:
            whole = self.completions.get(c.index)
            if whole is None:
                self.completions[c.index] = _copy(c)
                continue
            whole.text += c.text
            whole.token_ids += c.token_ids
            if c.logprobs is not None:
                whole.logprobs = (whole.logprobs or []) + c.logprobs
            whole.cumulative_logprob = c.cumulative_logprob
            whole.finish_reason, whole.stop_reason = c.finish_reason, c.stop_reason
        return [_copy(c) for _, c in sorted(self.completions.items())]


def _copy(c: CompletionOutput) -> CompletionOutput:
    logprobs = list(c.logprobs) if c.logprobs is not None else None
    return dataclasses.replace(c, token_ids=list(c.token_ids), logprobs=logprobs)
