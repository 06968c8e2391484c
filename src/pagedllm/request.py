"""Per-request state shared by the scheduler (torch-free) and the model runner."""

from __future__ import annotations

import enum
import time
from typing import Any

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """A prompt and its generated tokens.

    The one invariant the scheduler drives: `num_computed_tokens` (tokens whose K/V are in the
    cache) catches up with `num_tokens` (prompt + output). Prefill, chunked prefill and recompute
    after preemption are all the same rule.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int] | None = None,
        max_tokens: int | None = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = list(eos_token_ids or [])
        # Resolved output budget (sampling_params.max_tokens, capped by max_model_len).
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # Model-runner state (e.g. a seeded torch.Generator); the core never touches it.
        self.generator: Any = None
        # Prefix caching: mixed into the first block's hash, so only requests with the same salt
        # share cached blocks; and the hashes of the full blocks so far, extended as tokens grow
        # (by kv_cache_manager.update_block_hashes).
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
