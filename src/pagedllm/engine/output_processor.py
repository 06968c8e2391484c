"""From what a step did to the requests to RequestOutputs: detokenizing with stop strings,
logprobs with their decoded tokens, prompt logprobs, and the n / best_of / beam-search outputs;
plus each request's timing (queued, first scheduled, first and last token, finished).

Work here is per request: a failure (a tokenizer that raises, a broken grammar) fails that
request alone; it is aborted and its final output carries the error."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import (
    CompletionOutput,
    Logprob,
    ModelRunnerOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    ResumedOutput,
)
from pagedllm.request import Request, RequestStatus, SequenceGroup

logger = logging.getLogger("pagedllm")


@dataclass
class RequestState:
    """Output-side state of one request (sequence group), per sequence where it differs."""

    group: SequenceGroup
    delta: bool
    metrics: RequestMetrics
    detokenizers: dict[str, IncrementalDetokenizer] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    num_sent: dict[str, int] = field(default_factory=dict)  # tokens already output (delta)
    # prompt_logprobs by prompt position (a recomputed prompt overwrites the same values).
    prompt_logprobs: dict[int, dict[int, Logprob]] = field(default_factory=dict)


class OutputProcessor:
    def __init__(
        self,
        tokenizer,
        finish_seq: Callable[[Request, RequestStatus], None],
        abort: Callable[[list[str]], None],
    ) -> None:
        """`finish_seq` ends a sequence whose stop string matched, `abort` whole requests
        (the scheduler's, which frees their blocks)."""
        self.tokenizer = tokenizer
        self._finish_seq = finish_seq
        self._abort = abort
        self.states: dict[str, RequestState] = {}
        # Requests that got their first token, and the sum of their times to it (a mean TTFT
        # over any interval from two readings).
        self.num_first_tokens_total = 0
        self.time_to_first_token_seconds_total = 0.0

    def add_request(
        self, group: SequenceGroup, delta: bool, resumed: ResumedOutput | None = None
    ) -> None:
        """`resumed`: the output a lost engine had handed out already (its tokens are in the
        group's sequence): neither its tokens nor its text are output again."""
        metrics = RequestMetrics(arrival_time=group.arrival_time)
        state = RequestState(group, delta, metrics)
        self.states[group.request_id] = state
        if resumed is not None and resumed.token_ids:
            seq = group.first
            state.num_sent[seq.seq_id] = len(resumed.token_ids)
            if self.tokenizer is not None:
                detokenizer = self._detokenizer(state, seq)
                detokenizer.update(list(resumed.token_ids))
                detokenizer.mark_sent(resumed.num_text_chars)

    def remove(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.states.pop(request_id, None)

    def mark_scheduled(self, so: SchedulerOutput, now: float) -> None:
        for seq in so.scheduled_requests:
            metrics = self.states[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now

    def process(
        self, so: SchedulerOutput, runner_output: ModelRunnerOutput, groups: list[SequenceGroup]
    ) -> list[RequestOutput]:
        """An output for every group that advanced (best_of > n and beam search only once
        finished); the failed requests' outputs first."""
        failed: dict[str, RequestOutput] = {}
        if runner_output.prompt_logprobs:
            request_ids = {s.seq_id: s.request_id for s in so.scheduled_requests}
            for seq_id, records in runner_output.prompt_logprobs.items():
                state = self.states.get(request_ids[seq_id])
                if state is None:
                    continue
                try:
                    for position, record in records:
                        state.prompt_logprobs[position] = self._logprob_dict(record)
                except Exception as e:  # noqa: BLE001 - fails this request only
                    failed[state.group.request_id] = self._fail(state.group, e)

        now = time.time()
        for group in groups:
            state = self.states.get(group.request_id)
            if state is None:
                continue
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
                self.num_first_tokens_total += 1
                self.time_to_first_token_seconds_total += max(0.0, now - group.arrival_time)
            state.metrics.last_token_time = now
            if not group.is_beam_search and group.first.pooling_params is None:
                try:
                    self._process_samples(state)
                except Exception as e:  # noqa: BLE001 - fails this request only
                    failed[group.request_id] = self.fail(group, e)
        outputs = list(failed.values())
        for group in groups:
            state = self.states.get(group.request_id)
            if state is None:
                continue
            try:
                output = self._make_output(state, now)
            except Exception as e:  # noqa: BLE001 - fails this request only
                output = self.fail(group, e)
            if output is not None:
                outputs.append(output)
        return outputs

    def fail(self, group: SequenceGroup, error: Exception) -> RequestOutput:
        """Stop one request whose output processing raised: its blocks are freed, and its
        final output carries the error. The batch's other requests go on. (A failure in the
        batched model run or sampler is not tied to one request: it propagates, and the async
        engine stops.)"""
        request_id = group.request_id
        logger.error("request %s failed: %r", request_id, error, exc_info=error)
        self._abort([request_id])
        self.states.pop(request_id, None)
        first = group.first
        return RequestOutput(
            request_id=request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[],
            finished=True,
            error=f"request {request_id} failed: {error!r}",
        )

    def _process_samples(self, state: RequestState) -> None:
        """Detokenize each sequence's new tokens; a matched stop string ends that sequence."""
        group = state.group
        for seq in [*group.seqs, *group.finished_seqs]:
            if self.tokenizer is not None:
                self._detokenize(state, seq)
            if seq.sampling_params.logprobs is not None:
                self._convert_logprobs(state, seq)

    def _detokenize(self, state: RequestState, seq: Request) -> None:
        """The sequence's new text; a stop string that matched ends it there. Of several
        tokens a step accepted (speculative decoding), those after the match are dropped, so
        the output is what decoding them one by one would have given."""
        detokenizer = self._detokenizer(state, seq)
        if seq.grammar is not None and seq.grammar.error is not None:
            raise RuntimeError(f"the structured output grammar failed: {seq.grammar.error}")
        new_token_ids = seq.output_token_ids[detokenizer.num_tokens :]
        if not new_token_ids:
            return
        # An EOS or stop token that ended the sequence is not part of the text (a token that
        # completed a structured output, also a stop, is).
        by_token = seq.status == RequestStatus.FINISHED_STOPPED and (
            seq.stop_reason is not None or seq.output_token_ids[-1] in seq.eos_token_ids
        )
        if len(new_token_ids) == 1 or not detokenizer.stop:
            stop = detokenizer.update(new_token_ids, stop_terminated=by_token)
        else:
            for i, token_id in enumerate(new_token_ids):
                last = i == len(new_token_ids) - 1
                stop = detokenizer.update([token_id], stop_terminated=by_token and last)
                if stop is not None:
                    break
        if stop is None:
            return
        if detokenizer.num_tokens < seq.num_output_tokens:
            seq.truncate_output(detokenizer.num_tokens)
            if seq.is_finished():  # by a later token, now dropped
                seq.status = RequestStatus.FINISHED_STOPPED
                seq.stop_reason = stop
        if not seq.is_finished():
            seq.stop_reason = stop
            self._finish_seq(seq, RequestStatus.FINISHED_STOPPED)

    def _detokenizer(self, state: RequestState, seq: Request) -> IncrementalDetokenizer:
        detokenizer = state.detokenizers.get(seq.seq_id)
        if detokenizer is None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer.backend, seq.prompt_token_ids, seq.sampling_params
            )
            state.detokenizers[seq.seq_id] = detokenizer
        return detokenizer

    def _convert_logprobs(self, state: RequestState, seq: Request) -> list[dict[int, Logprob]]:
        converted = state.logprobs.setdefault(seq.seq_id, [])
        for record in seq.output_logprobs[len(converted) :]:
            # None: a resumed token, its logprobs handed out by the engine before
            converted.append(None if record is None else self._logprob_dict(record))
        return converted

    def _logprob_dict(self, record) -> dict[int, Logprob]:
        decode = self._decode_token
        entry = {record.token_id: Logprob(record.logprob, record.rank, decode(record.token_id))}
        for rank, (token_id, logprob) in enumerate(record.top, start=1):
            entry.setdefault(token_id, Logprob(logprob, rank, decode(token_id)))
        return entry

    def _decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _make_output(
        self, state: RequestState, now: float
    ) -> RequestOutput | PoolingRequestOutput | None:
        group = state.group
        params = group.sampling_params
        finished = group.is_finished()
        if finished:
            state.metrics.finished_time = now
            del self.states[group.request_id]
        first = group.first
        if first.pooling_params is not None:  # finished: pooled when its prompt was computed
            return PoolingRequestOutput(
                group.request_id, first.prompt, first.prompt_token_ids,
                PoolingOutput(first.pooled), metrics=state.metrics,
            )  # fmt: skip
        if group.is_beam_search:
            if not finished:
                return None
            completions = self._beam_outputs(group)
        elif params.num_sequences > params.n:
            if not finished:
                return None  # the best n are known only at the end
            ranked = sorted(group.finished_seqs, key=lambda s: -s.cumulative_logprob)[: params.n]
            completions = [self._completion(state, s, i, True) for i, s in enumerate(ranked)]
        else:
            seqs = sorted([*group.seqs, *group.finished_seqs], key=lambda s: s.sample_index)
            if state.delta:  # only the sequences that advanced since the last output
                seqs = [s for s in seqs if s.num_output_tokens > state.num_sent.get(s.seq_id, 0)]
            completions = [self._completion(state, s, s.sample_index, finished) for s in seqs]
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            # vLLM's shape: None for the first prompt token, then one dict per prompt token.
            positions = range(1, first.num_prompt_tokens)
            prompt_logprobs = [None, *(state.prompt_logprobs.get(p) for p in positions)]
        return RequestOutput(
            request_id=group.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=state.metrics,
            prompt_logprobs=prompt_logprobs,
        )

    def _completion(
        self, state: RequestState, seq: Request, index: int, finished: bool
    ) -> CompletionOutput:
        params = seq.sampling_params
        detokenizer = state.detokenizers.get(seq.seq_id)
        text = ""
        if detokenizer is not None:
            text = detokenizer.get_next_output_text(finished or seq.is_finished(), state.delta)
        token_ids = seq.output_token_ids
        logprobs = state.logprobs.get(seq.seq_id) if params.logprobs is not None else None
        if state.delta:
            sent = state.num_sent.get(seq.seq_id, 0)
            token_ids = token_ids[sent:]
            logprobs = logprobs[sent:] if logprobs is not None else None
        else:
            token_ids = list(token_ids)
        state.num_sent[seq.seq_id] = seq.num_output_tokens
        ranked = params.logprobs is not None or params.num_sequences > params.n
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=seq.cumulative_logprob if ranked else None,
            logprobs=logprobs,
            finish_reason=seq.status.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _beam_outputs(self, group: SequenceGroup) -> list[CompletionOutput]:
        """The n best finished hypotheses, best first."""
        params = group.sampling_params
        completions = []
        for i, hyp in enumerate(group.beam.finished[: params.n]):
            token_ids = hyp.output_token_ids
            text_ids = token_ids
            if hyp.finish_reason == "stop" and not params.include_stop_str_in_output:
                text_ids = token_ids[:-1]
            text = ""
            if self.tokenizer is not None:
                text = self.tokenizer.decode(
                    text_ids, skip_special_tokens=params.skip_special_tokens
                )
            logprobs = None
            if params.logprobs is not None:
                logprobs = [self._logprob_dict(r) for r in hyp.logprobs]
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(token_ids),
                    cumulative_logprob=hyp.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=hyp.finish_reason,
                    stop_reason=hyp.stop_reason,
                )
            )
        return completions
