"""EngineCoreRequest: the user's request as every engine takes it, made once where it enters
(the serving layer, the offline engine's add_request, a client's generate: the prompt is
tokenized there, on the server's side) and carried unchanged to the input processor and into
the scheduler's sequences, which hold it as it is (`Sequence.request`). A msgspec struct: it
crosses the process boundary as it is (engine/core_channel.py), no field list by position. A
new request field goes here, where the request is made, and where it is used."""

from __future__ import annotations

import operator
import time
from typing import Any

import msgspec

from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import ResumedOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

# A prompt: a string, a list of token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}.
PromptType = str | list[int] | dict


class EngineCoreRequest(msgspec.Struct, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None = None  # the text, when the prompt was one (for the outputs)
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
        cls, tokenizer, request_id: str, prompt: str | list[int] | dict[str, Any],
        params: SamplingParams | PoolingParams, arrival_time: float, **fields,
    ) -> EngineCoreRequest:  # fmt: skip
        """The request of `prompt` (a string, token ids, or vLLM's {"prompt": ...} /
        {"prompt_token_ids": ...}), tokenized by `tokenizer`, with `params` in its field by
        kind; ValueError for a prompt that is neither."""
        text, token_ids = tokenize_prompt(tokenizer, prompt)
        if isinstance(params, PoolingParams):
            fields["pooling_params"] = params
        else:
            fields["sampling_params"] = params
        return cls(request_id=request_id, prompt_token_ids=token_ids, prompt=text,
                   arrival_time=arrival_time, **fields)  # fmt: skip

    @property
    def params(self) -> SamplingParams | PoolingParams:
        return self.pooling_params if self.pooling_params is not None else self.sampling_params


def as_core_request(
    tokenizer, prompt, params: SamplingParams | PoolingParams, request_id: str, **fields
) -> EngineCoreRequest:
    """What a client's generate() takes: a request the serving layer made already (`prompt`
    an EngineCoreRequest, taken whole), else the request of `prompt` made here, now."""
    if isinstance(prompt, EngineCoreRequest):
        if prompt.request_id != request_id or prompt.params is not params:
            raise ValueError("a request made already brings its own id and parameters")
        return prompt
    return EngineCoreRequest.of(tokenizer, request_id, prompt, params, time.time(), **fields)


def tokenize_prompt(tokenizer, prompt) -> tuple[str | None, list[int]]:
    """(the prompt's text if it has one, its token ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text, prompt = prompt.get("prompt"), prompt["prompt_token_ids"]
            return (text if isinstance(text, str) else None), _token_ids(prompt)
        prompt = prompt.get("prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids instead")
        return prompt, tokenizer.encode(prompt)
    return None, _token_ids(prompt)


def _token_ids(prompt) -> list[int]:
    try:
        return [operator.index(t) for t in prompt]
    except TypeError:
        raise ValueError(
            "a prompt is a string, a list of token ids, or {'prompt': ...} / "
            "{'prompt_token_ids': [...]}"
        ) from None
