"""EngineCoreOutput: what one step did to one request, as the engine reports it: token ids,
the runner's logprob records, finish reasons, pooled values; no text. The engine makes them
(engine/output_builder.py), the output processor on the server's side turns them into
RequestOutputs (engine/output_processor.py). msgspec structs, so they cross the process
boundary as they are (engine/core_channel.py)."""

from __future__ import annotations

import msgspec

from pagedllm.outputs import TokenLogprobs


class SampleDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence's new tokens (a sample of the request: `index`, vLLM's output index)."""

    index: int
    token_ids: list[int]
    # The running sum of the sequence's token logprobs after each new token, when the
    # request is ranked (logprobs asked for, or best_of > n): a stop string that matches
    # before the last of them takes the sum back to where it matched.
    cumulative_logprobs: list[float] | None = None
    logprobs: list[TokenLogprobs] | None = None  # the new tokens' records, when asked for
    finish_reason: str | None = None  # "stop" | "length": the engine ended the sequence
    stop_reason: int | None = None  # the stop token id that ended it
    # The last token ended the sequence as an end-of-sequence or stop token: it is not text.
    stop_token: bool = False


class BeamOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """A finished beam-search hypothesis."""

    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str
    stop_reason: int | None = None
    logprobs: list[TokenLogprobs] | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    samples: list[SampleDelta] = []
    finished: bool = False  # the engine is done with the request (and forgot it)
    beams: list[BeamOutput] | None = None  # beam search, once finished: the best first
    # (prompt position, record of the prompt token there) computed since the last output.
    prompt_logprobs: list[tuple[int, TokenLogprobs]] | None = None
    pooled: bytes | None = None  # an embedding: float32 values, in the machine's byte order
    # Set in the request's first output: when it was first scheduled, when it first advanced.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    error: str | None = None  # the engine failed the request (and forgot it)
