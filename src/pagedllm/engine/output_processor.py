"""The server's side of a request's outputs: from the engine's EngineCoreOutputs (token ids,
engine/core_output.py) to RequestOutputs: detokenizing with stop strings, logprobs with their
decoded tokens, prompt logprobs, the n / best_of / beam-search outputs, whole or delta outputs,
and each request's timing. It runs where the request came in: in the server's process when the
engine has its own (engine/core_client.py), beside the engine otherwise (LLMEngine.step).

A stop string is found here, so the sequence it ends is stopped here, and the engine told
(`finish`): a request with no sequence left goes, the engine's later tokens for a stopped
sequence are dropped. Work here is per request: a failure (a tokenizer that raises) fails that
request alone; the engine is told to drop it, and its final output carries the error."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.engine.core_output import BeamOutput, EngineCoreOutput, SampleDelta
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    ResumedOutput,
    TokenLogprobs,
)
from pagedllm.request import EngineCoreRequest

logger = logging.getLogger("pagedllm")

# finish(request_id, sample index): a stop string ended that sample; None: the whole request
# is done (or failed) here, and the engine drops it.
Finish = Callable[[str, int | None], None]


@dataclass
class Sample:
    """One sequence's output so far."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    detokenizer: IncrementalDetokenizer | None = None
    num_sent: int = 0  # tokens already output (delta)
    advanced: bool = False  # since the last output


@dataclass
class RequestState:
    request: EngineCoreRequest
    delta: bool
    metrics: RequestMetrics
    samples: dict[int, Sample] = field(default_factory=dict)
    # prompt_logprobs by prompt position (a recomputed prompt overwrites the same values).
    prompt_logprobs: dict[int, dict[int, Logprob]] = field(default_factory=dict)

    @property
    def params(self):
        return self.request.sampling_params

    def done(self) -> bool:
        """Every sequence of the request has ended (by the engine or a stop string here)."""
        samples = self.samples.values()
        num = self.params.num_sequences
        return len(self.samples) == num and all(s.finish_reason is not None for s in samples)


class OutputProcessor:
    def __init__(self, tokenizer, finish: Finish) -> None:
        self.tokenizer = tokenizer
        self._finish = finish
        self.states: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, delta: bool) -> None:
        """A resumed request's tokens (`request.resumed`, a lost engine's) count as handed
        out, with the text they made but for a tail that could still start a stop string."""
        state = RequestState(request, delta, RequestMetrics(arrival_time=request.arrival_time))
        self.states[request.request_id] = state
        resumed = request.resumed
        if resumed is not None and resumed.token_ids:
            sample = self._sample(state, 0)
            sample.token_ids = list(resumed.token_ids)
            sample.num_sent = len(resumed.token_ids)
            sample.logprobs = [None] * len(resumed.token_ids)
            sample.cumulative_logprob = resumed.cumulative_logprob
            if sample.detokenizer is not None:
                sample.detokenizer.update(list(resumed.token_ids))
                sample.detokenizer.get_next_output_text(finished=False, delta=True)

    def resumed_output(self, request_id: str) -> ResumedOutput | None:
        """What another engine resumes a single-sequence request from (None: the start)."""
        state = self.states.get(request_id)
        sample = state.samples.get(0) if state is not None else None
        if sample is None or not sample.token_ids:
            return None
        return ResumedOutput(list(sample.token_ids), sample.cumulative_logprob)

    def start_over(self, request_id: str) -> None:
        """A request that cannot resume runs again from the start (nothing was handed out)."""
        state = self.states.get(request_id)
        if state is not None:
            state.samples.clear()
            state.prompt_logprobs.clear()

    def remove(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.states.pop(request_id, None)

    def process(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """An output for every request that advanced (best_of > n and beam search only once
        finished); an error output for a request that failed."""
        now = time.time()
        results = []
        for output in outputs:
            state = self.states.get(output.request_id)
            if state is None:
                continue  # aborted, or ended here by a stop string
            try:
                result = self._process(state, output, now)
            except Exception as e:  # noqa: BLE001 - fails this request only
                result = self.fail(output.request_id, e)
            if result is not None:
                results.append(result)
        return results

    def fail(self, request_id: str, error: Exception | str) -> RequestOutput:
        """Stop one request (the engine drops it): its final output carries the error."""
        state = self.states.pop(request_id)
        if isinstance(error, Exception):
            logger.error("request %s failed: %r", request_id, error, exc_info=error)
            self._finish(request_id, None)
            error = f"request {request_id} failed: {error!r}"
        request = state.request
        return RequestOutput(request_id, request.prompt, request.prompt_token_ids, [], True,
                             error=error)  # fmt: skip

    def _process(self, state: RequestState, output: EngineCoreOutput, now: float):
        metrics = state.metrics
        if output.first_token_time is not None and metrics.first_token_time is None:
            # (a resumed request keeps the first times of its first engine)
            metrics.first_scheduled_time = output.first_scheduled_time
            metrics.first_token_time = output.first_token_time
        metrics.last_token_time = now
        request_id = output.request_id
        if output.error is not None:
            return self.fail(request_id, output.error)
        request = state.request
        if output.pooled is not None:
            pooled = PoolingRequestOutput(
                request_id, request.prompt, request.prompt_token_ids,
                PoolingOutput(_tensor(output.pooled)), metrics=metrics,
            )  # fmt: skip
            metrics.finished_time = now
            del self.states[request_id]
            return pooled
        for position, record in output.prompt_logprobs or ():
            state.prompt_logprobs[position] = self._logprob_dict(record)
        params = state.params
        if output.beams is not None:
            completions = [self._beam(i, b, params) for i, b in enumerate(output.beams)]
            return self._request_output(state, completions, now)
        if params.use_beam_search:
            return None  # its one output comes when it finishes
        stopped = []
        for delta in output.samples:
            sample = self._sample(state, delta.index)
            if sample.finish_reason is None:  # else: stopped here, a later token of the engine
                if self._append(sample, delta, params) and delta.finish_reason is None:
                    stopped.append(sample.index)  # the engine still runs it
        finished = state.done()
        if not output.finished and stopped:
            for index in [None] if finished else stopped:
                self._finish(request_id, index)
        samples = sorted(state.samples.values(), key=lambda s: s.index)
        if params.num_sequences > params.n:
            if not finished:
                return None  # the best n are known only at the end
            ranked = sorted(samples, key=lambda s: -s.cumulative_logprob)[: params.n]
            completions = [self._completion(state, s, i, True) for i, s in enumerate(ranked)]
        else:
            if state.delta:  # only the sequences that advanced since the last output
                samples = [s for s in samples if s.advanced]
            completions = [self._completion(state, s, s.index, finished) for s in samples]
        return self._request_output(state, completions, now, finished)

    def _sample(self, state: RequestState, index: int) -> Sample:
        sample = state.samples.get(index)
        if sample is None:
            sample = state.samples[index] = Sample(index)
            if self.tokenizer is not None:
                sample.detokenizer = IncrementalDetokenizer(
                    self.tokenizer.backend, state.request.prompt_token_ids, state.params
                )
        return sample

    def _append(self, sample: Sample, delta: SampleDelta, params) -> bool:
        """Take the engine's new tokens; True when a stop string ended the sequence here. Of
        several tokens a step accepted (speculative decoding), those after the match are
        dropped, so the output is what decoding them one by one would have given."""
        token_ids = delta.token_ids
        stop = None
        detokenizer = sample.detokenizer
        if detokenizer is not None:
            before = detokenizer.num_tokens
            if len(token_ids) == 1 or not detokenizer.stop:
                stop = detokenizer.update(token_ids, stop_terminated=delta.stop_token)
            else:
                for i, token_id in enumerate(token_ids):
                    last = i == len(token_ids) - 1
                    stop = detokenizer.update([token_id], delta.stop_token and last)
                    if stop is not None:
                        break
            num_kept = detokenizer.num_tokens - before
        else:
            num_kept = len(token_ids)
        sample.advanced = True
        sample.token_ids += token_ids[:num_kept]
        if delta.cumulative_logprobs is not None:
            sample.cumulative_logprob = delta.cumulative_logprobs[num_kept - 1]
        if params.logprobs is not None:
            records = delta.logprobs[:num_kept]
            sample.logprobs += [self._logprob_dict(r) for r in records]
        if stop is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop
            return True
        sample.finish_reason, sample.stop_reason = delta.finish_reason, delta.stop_reason
        return False

    def _completion(
        self, state: RequestState, sample: Sample, index: int, finished: bool
    ) -> CompletionOutput:
        params = state.params
        text = ""
        if sample.detokenizer is not None:
            ended = finished or sample.finish_reason is not None
            text = sample.detokenizer.get_next_output_text(ended, state.delta)
        token_ids = sample.token_ids
        logprobs = sample.logprobs if params.logprobs is not None else None
        if state.delta:
            token_ids = token_ids[sample.num_sent :]
            logprobs = logprobs[sample.num_sent :] if logprobs is not None else None
        else:
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        sample.num_sent = len(sample.token_ids)
        sample.advanced = False
        ranked = params.logprobs is not None or params.num_sequences > params.n
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=sample.cumulative_logprob if ranked else None,
            logprobs=logprobs,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )

    def _request_output(
        self, state: RequestState, completions: list, now: float, finished: bool = True
    ) -> RequestOutput:
        request = state.request
        prompt_logprobs = None
        if state.params.prompt_logprobs is not None:
            # vLLM's shape: None for the first prompt token, then one dict per prompt token.
            positions = range(1, len(request.prompt_token_ids))
            prompt_logprobs = [None, *(state.prompt_logprobs.get(p) for p in positions)]
        if finished:
            state.metrics.finished_time = now
            del self.states[request.request_id]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=state.metrics,
            prompt_logprobs=prompt_logprobs,
        )

    def _beam(self, index: int, beam: BeamOutput, params) -> CompletionOutput:
        token_ids = beam.token_ids
        text_ids = token_ids
        if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
            text_ids = token_ids[:-1]
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(text_ids, skip_special_tokens=params.skip_special_tokens)
        logprobs = None
        if beam.logprobs is not None:
            logprobs = [self._logprob_dict(r) for r in beam.logprobs]
        return CompletionOutput(index, text, list(token_ids), beam.cumulative_logprob, logprobs,
                                beam.finish_reason, beam.stop_reason)  # fmt: skip

    def _logprob_dict(self, record: TokenLogprobs) -> dict[int, Logprob]:
        decode = self._decode_token
        entry = {record.token_id: Logprob(record.logprob, record.rank, decode(record.token_id))}
        for rank, (token_id, logprob) in enumerate(record.top, start=1):
            entry.setdefault(token_id, Logprob(logprob, rank, decode(token_id)))
        return entry

    def _decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _tensor(data: bytes):
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.float32)
