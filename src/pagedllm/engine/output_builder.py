"""From what a step did to the requests to EngineCoreOutputs (engine/core_output.py): each
sequence's new token ids since the last output, the runner's logprob records, finish reasons,
prompt logprobs, pooled values, finished beams; and each request's first times and the
engine's time-to-first-token counters. Token ids only: text is the output processor's, on the
server's side of the boundary."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.engine.core_output import BeamOutput, EngineCoreOutput, SampleDelta
from pagedllm.outputs import ModelRunnerOutput, TokenLogprobs
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger("pagedllm")


@dataclass
class _Reported:
    """What the engine has reported of one request."""

    num_sent: dict[str, int] = field(default_factory=dict)  # seq id -> output tokens reported
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    times_sent: bool = False
    prompt_logprobs: list[tuple[int, TokenLogprobs]] = field(default_factory=list)  # pending


class OutputBuilder:
    def __init__(self) -> None:
        self.requests: dict[str, _Reported] = {}
        # Requests that got their first token, and the sum of their times to it (a mean TTFT
        # over any interval from two readings).
        self.num_first_tokens_total = 0
        self.time_to_first_token_seconds_total = 0.0

    def add_request(self, group: SequenceGroup) -> None:
        """A resumed request's output tokens (a lost engine's) count as reported."""
        first = group.first
        self.requests[group.request_id] = _Reported({first.seq_id: first.num_output_tokens})

    def remove(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def mark_scheduled(self, so: SchedulerOutput, now: float) -> None:
        for seq in so.scheduled_requests:
            reported = self.requests[seq.request_id]
            if reported.first_scheduled_time is None:
                reported.first_scheduled_time = now

    def build(
        self,
        so: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        groups: list[SequenceGroup],
        now: float,
    ) -> tuple[list[EngineCoreOutput], list[tuple[SequenceGroup, Exception]]]:
        """An output for every group that advanced, and the groups whose output could not be
        made (a broken grammar), with why: the engine fails those alone."""
        if runner_output.prompt_logprobs:
            request_ids = {s.seq_id: s.request_id for s in so.scheduled_requests}
            for seq_id, records in runner_output.prompt_logprobs.items():
                reported = self.requests.get(request_ids[seq_id])
                if reported is not None:
                    reported.prompt_logprobs += records
        outputs, failed = [], []
        for group in groups:
            reported = self.requests.get(group.request_id)
            if reported is None:
                continue
            if reported.first_token_time is None:
                reported.first_token_time = now
                self.num_first_tokens_total += 1
                self.time_to_first_token_seconds_total += max(0.0, now - group.arrival_time)
            try:
                outputs.append(self._output(group, reported))
            except Exception as e:  # noqa: BLE001 - fails this request only
                failed.append((group, e))
        return outputs, failed

    def fail(self, group: SequenceGroup, error: str) -> EngineCoreOutput:
        """The final output of a request the engine stops (its caller frees the blocks)."""
        self.requests.pop(group.request_id, None)
        return EngineCoreOutput(group.request_id, finished=True, error=error)

    def _output(self, group: SequenceGroup, reported: _Reported) -> EngineCoreOutput:
        finished = group.is_finished()
        output = EngineCoreOutput(group.request_id, finished=finished)
        if not reported.times_sent:
            output.first_scheduled_time = reported.first_scheduled_time
            output.first_token_time = reported.first_token_time
            reported.times_sent = True
        if reported.prompt_logprobs:
            output.prompt_logprobs, reported.prompt_logprobs = reported.prompt_logprobs, []
        if finished:
            del self.requests[group.request_id]
        first = group.first
        if first.pooling_params is not None:  # finished: pooled when its prompt was computed
            output.pooled = first.pooled.numpy().tobytes()
        elif group.is_beam_search:
            if finished:
                best = group.beam.finished[: group.sampling_params.n]
                output.beams = [_beam(hyp, group) for hyp in best]
        else:
            seqs = sorted([*group.seqs, *group.finished_seqs], key=lambda s: s.sample_index)
            for seq in seqs:
                delta = self._sample_delta(seq, reported)
                if delta is not None:
                    output.samples.append(delta)
        return output

    @staticmethod
    def _sample_delta(seq: Sequence, reported: _Reported) -> SampleDelta | None:
        if seq.grammar is not None and seq.grammar.error is not None:
            raise RuntimeError(f"the structured output grammar failed: {seq.grammar.error}")
        sent = reported.num_sent.get(seq.seq_id, 0)
        new_token_ids = seq.output_token_ids[sent:]
        if not new_token_ids:
            return None
        reported.num_sent[seq.seq_id] = seq.num_output_tokens
        params = seq.sampling_params
        delta = SampleDelta(seq.sample_index, new_token_ids)
        records = seq.output_logprobs[sent:]
        if params.logprobs is not None or params.num_sequences > params.n:
            sums, total = [], seq.cumulative_logprob
            for record in reversed(records):
                sums.append(total)
                total -= record.logprob if record is not None else 0.0
            delta.cumulative_logprobs = sums[::-1]
        if params.logprobs is not None:
            delta.logprobs = records
        if seq.is_finished():
            delta.finish_reason = seq.status.finish_reason
            delta.stop_reason = seq.stop_reason
            # An EOS or stop token that ended the sequence is not text (a token that completed
            # a structured output, also a stop, is).
            delta.stop_token = seq.status == SequenceStatus.FINISHED_STOPPED and (
                seq.stop_reason is not None or seq.output_token_ids[-1] in seq.eos_token_ids
            )
        return delta


def _beam(hyp, group: SequenceGroup) -> BeamOutput:
    logprobs = hyp.logprobs if group.sampling_params.logprobs is not None else None
    return BeamOutput(list(hyp.output_token_ids), hyp.cumulative_logprob, hyp.finish_reason,
                      hyp.stop_reason, logprobs)  # fmt: skip
