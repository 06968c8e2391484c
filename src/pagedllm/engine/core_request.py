"""EngineCoreRequest: one request as the engine takes it, made once where it enters (the offline
engine's add_request, the async engine's or the engine-process client's generate) and carried
unchanged to the input processor, which makes the scheduler's Request from it. A msgspec struct:
it crosses the process boundary as it is (engine/core_channel.py), no field list by position.
A new request field goes here, where the request is made, and where it is used."""

from __future__ import annotations

from typing import Any

import msgspec

from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import ResumedOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, kw_only=True):
    request_id: str
    # A string, token ids, or {"prompt": ...} / {"prompt_token_ids": ...} (PromptType).
    prompt: str | list[int] | dict[str, Any]
    # One of the two: a generation or an embedding (pooling) request.
    sampling_params: SamplingParams | None = None
    pooling_params: PoolingParams | None = None
    arrival_time: float
    # Prefix-cached blocks are shared only among requests of the same salt and adapter.
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    priority: int = 0  # with --scheduling-policy priority, lower runs first
    # What a lost engine process had generated for it (engine/core_client.py), taken as
    # generated here.
    resumed: ResumedOutput | None = None

    @classmethod
    def of(
        cls, request_id: str, prompt, params: SamplingParams | PoolingParams, arrival_time: float,
        **fields,
    ) -> EngineCoreRequest:  # fmt: skip
        """The request with `params` in its field by kind."""
        if isinstance(params, PoolingParams):
            fields["pooling_params"] = params
        else:
            fields["sampling_params"] = params
        return cls(request_id=request_id, prompt=prompt, arrival_time=arrival_time, **fields)

    @property
    def params(self) -> SamplingParams | PoolingParams:
        return self.pooling_params if self.pooling_params is not None else self.sampling_params
