"""Request outputs in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

# One dict per generated token: token id -> Logprob (the sampled token is always included).
SampleLogprobs = list[dict[int, "Logprob"]]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


class TokenLogprobs(msgspec.Struct, array_like=True):
    """What the runner reports for one generated token: its logprob and rank, then the top-N
    (token id, logprob) pairs. A msgspec struct: it crosses to the server's process as it is
    (engine/core_output.py)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class ModelRunnerOutput:
    """One step's results, keyed by sequence id (`Sequence.seq_id`)."""

    # The tokens drawn for each sampled sequence: one, `num_samples` for a group's first (one
    # per sample), or for a sequence that verified drafts the accepted ones and the next.
    sampled_token_ids: dict[str, list[int]]
    # Aligned with sampled_token_ids, for sequences whose logprobs are needed.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Beam search: each beam's best next tokens and their logprobs, best first.
    beam_candidates: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    # prompt_logprobs: (position, record of the prompt token at that position) for the prompt
    # positions this step computed (position 0 has none: nothing precedes it).
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)
    # Speculative decoding: draft tokens proposed for each sequence's next step.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Embedding requests whose prompt this step completed: the pooled hidden state (float32,
    # on the CPU; normalized and cut to `dimensions` when asked).
    pooled: dict[str, Any] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: list | None = field(default=None)
    # Set when processing this request's output failed: the request was stopped and its blocks
    # freed, the others went on; `outputs` is then empty.
    error: str | None = None


@dataclass
class ResumedOutput:
    """What a single-sequence request had generated when its engine was lost, for the engine
    that takes it over (engine/core_client.py): the output tokens and their summed logprob.
    The new engine recomputes prompt and tokens, as after a recompute preemption, and goes on
    from there; the text stays with the server's side, which made it."""

    token_ids: list[int]
    cumulative_logprob: float = 0.0


@dataclass
class PoolingOutput:
    """An embedding: the prompt's pooled hidden state (float32, normalized when asked)."""

    data: Any  # a 1-D torch.Tensor

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()


@dataclass
class PoolingRequestOutput:
    """An embedding request's one output (vLLM's shape), when its prompt is computed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput | None
    finished: bool = True
    metrics: RequestMetrics | None = None
    error: str | None = None  # as RequestOutput's; `outputs` is then None


@dataclass
class BeamSearchSequence:
    """One finished beam of `LLM.beam_search` (vLLM's fields)."""

    tokens: list[int]  # prompt + output token ids (a final EOS included)
    logprobs: SampleLogprobs  # per output token: the beam's top candidates, the chosen included
    cum_logprob: float = 0.0
    text: str | None = None  # the output text (without the prompt or a final EOS)
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """`LLM.beam_search`'s result for one prompt: the best beams, best first."""

    sequences: list[BeamSearchSequence]
