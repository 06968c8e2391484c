"""POST /v1/embeddings (and vLLM's /pooling) on an engine running the pooling runner: each
input is one prefill-only request, batched with the others by the scheduler; its pooled hidden
state comes back as floats or base64 (little-endian float32, which the openai SDK asks for by
default and decodes)."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import Request

from pagedllm.engine.request_checks import check_dimensions, check_fits
from pagedllm.entrypoints.openai.embedding_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    PoolingData,
)
from pagedllm.entrypoints.openai.errors import (
    OpenAIError,
    bad_request_checked,
    engine_error,
    request_failed,
)
from pagedllm.entrypoints.openai.protocol import random_id
from pagedllm.entrypoints.openai.serving import OpenAIServing
from pagedllm.entrypoints.openai.streaming import unless_disconnected
from pagedllm.pooling_params import PoolingParams


class OpenAIServingEmbedding(OpenAIServing):
    id_prefix = "embd"

    async def create(self, body: EmbeddingRequest, raw: Request, pooling: bool = False):
        """The embeddings of body.input, in its order; `pooling`: vLLM's /pooling shape."""
        lora = self.check_model(body.model)
        self.check_health()
        if self.engine.config.model.runner != "pooling":
            raise OpenAIError(
                "this server generates text: embeddings need a server started with "
                "--runner pooling (or an embedding model)", param="input",
            )  # fmt: skip
        with bad_request_checked():
            check_dimensions(body.dimensions, self.engine.model_config.hidden_size)
        try:
            params = PoolingParams(normalize=body.normalize, dimensions=body.dimensions)
        except ValueError as e:
            raise OpenAIError(str(e), param="dimensions") from None
        prompts = self._prompts(body)
        request_id = random_id(self.id_prefix)
        self.log_request(request_id, prompts, params)
        gens = self.generators(prompts, params, request_id, False, lora, body.priority)
        try:
            finals = await unless_disconnected(raw, self.final_outputs(gens))
        except Exception as e:
            raise engine_error(e) from None
        if finals is None:  # the client left: its requests were aborted
            return self.client_left()
        try:
            return self._response(body, request_id, finals, pooling)
        except Exception as e:  # noqa: BLE001 - formatting this request's answer failed
            raise request_failed(request_id, e) from e

    def _prompts(self, body: EmbeddingRequest) -> list[dict]:
        prompts = self.text_or_token_prompts(body.input, "input", body.add_special_tokens)
        for prompt in prompts:
            ids = self._truncate(prompt["prompt_token_ids"], body.truncate_prompt_tokens)
            with bad_request_checked():
                check_fits(len(ids), self.max_model_len, generating=False, param="input",
                           hint=", or set truncate_prompt_tokens")  # fmt: skip
            prompt["prompt_token_ids"] = ids
        return prompts

    def _truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the last `keep` tokens (-1: max_model_len)."""
        if keep is None:
            return ids
        keep = self.max_model_len if keep == -1 else keep
        return ids[-keep:] if keep else []

    def _response(self, body, request_id: str, finals, pooling: bool) -> EmbeddingResponse:
        data, num_tokens = [], 0
        for index, final in enumerate(finals):
            vector = final.outputs.data
            if body.encoding_format == "base64":
                raw = np.ascontiguousarray(vector.numpy(), dtype="<f4").tobytes()
                value = base64.b64encode(raw).decode()
            else:
                value = vector.tolist()
            if pooling:
                data.append(PoolingData(index=index, data=value))
            else:
                data.append(EmbeddingData(index=index, embedding=value))
            num_tokens += len(final.prompt_token_ids)
        usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        model = self.model_name(body)
        return EmbeddingResponse(id=request_id, model=model, data=data, usage=usage)
