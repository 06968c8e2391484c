"""What the endpoints share: one request's skeleton (`OpenAIServing.create`, with hooks for what
differs), the model, health, queue, limit and prompt checks, the engine's generators. Errors are
errors.py's; merged streams and disconnects streaming.py's."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedllm.engine.protocol import EngineClient
from pagedllm.engine.request_checks import check_fits, check_vocab
from pagedllm.engine.streams import EngineDeadError
from pagedllm.entrypoints.openai.errors import (
    OpenAIError,
    bad_request_checked,
    engine_error,
    request_failed,
)
from pagedllm.entrypoints.openai.metrics import RequestMetrics
from pagedllm.entrypoints.openai.protocol import random_id
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.entrypoints.openai.streaming import (
    DisconnectAwareStream,
    events,
    merge,
    unless_disconnected,
)
from pagedllm.outputs import RequestOutput
from pagedllm.request import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")
T = TypeVar("T")

# Request fields that constrain the output (not SamplingParams fields), named in 400s.
_STRUCTURED_FIELDS = {
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar"
}  # fmt: skip
EVENT_STREAM = "text/event-stream"
MAX_LOGPROB = -9999.0  # JSON has no -inf: clamp as vLLM does


class OpenAIServing:
    """An endpoint's requests: `create` runs the steps both endpoints share, the hooks below it
    (a subclass's) do what differs."""

    id_prefix = ""  # of the request ids: cmpl-..., chatcmpl-...

    def __init__(
        self,
        async_engine: EngineClient,
        config: ServerConfig,
        metrics: RequestMetrics | None = None,
        loras=None,
    ) -> None:
        self.async_engine = async_engine
        self.loras = loras  # the served LoRA adapters (lora.LoRARegistry), or None
        self.engine = async_engine.engine
        self.config = config  # its served_model_name filled in (build_app)
        self.metrics = metrics
        self.tokenizer = self.engine.tokenizer
        self.served_model_name = config.served_model_name
        self.limits = config.limits
        self.max_model_len = self.engine.max_model_len

    async def create(self, body, raw: Request):
        """Checks (model, health, sampling parameters, limits, prompts and their lengths), the
        engine's generators, then the stream or, once every output is final, the response."""
        lora = self.check_model(body.model)
        self.check_health()
        if self.engine.config.model.runner == "pooling":
            raise OpenAIError(
                "this server runs the pooling runner (an embedding model, or --runner pooling): "
                "it serves /v1/embeddings and /pooling, not generation"
            )
        params = self.sampling_params(body)
        self.check_limits(params)
        if body.stream and params.num_sequences > params.n and not params.use_beam_search:
            raise OpenAIError("best_of > n is not supported with streaming", param="best_of")
        prompts, plan = self.build_prompts(body, params)
        for prompt in prompts:
            self.check_length(len(prompt["prompt_token_ids"]), params.max_tokens)
        request_id = random_id(self.id_prefix)
        self.log_request(request_id, prompts, params)
        gens = self.generators(
            prompts, params, request_id, delta=body.stream, lora=lora, priority=body.priority
        )
        if body.stream:
            # Waiting for the first output (queued, or a long prefill) watches for a disconnect too.
            stream = await unless_disconnected(raw, self.first_and_rest(gens))
            if stream is None:
                return self.client_left()
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = self.stream_chunks(body, request_id, prompts, plan, stream, include_usage)
            return DisconnectAwareStream(
                self.frame(self._counted(chunks), request_id), media_type=EVENT_STREAM,
                on_disconnect=lambda: self.count_error("client_disconnected"),
            )  # fmt: skip
        try:
            finals = await unless_disconnected(raw, self.final_outputs(gens))
        except Exception as e:
            raise engine_error(e) from None
        if finals is None:  # the client left; nobody reads this
            return self.client_left()
        try:
            return self.response(body, request_id, prompts, plan, finals)
        except Exception as e:  # noqa: BLE001 - formatting this request's answer failed
            raise request_failed(request_id, e) from e

    # -- the hooks ------------------------------------------------------------------------------
    def sampling_params(self, body) -> SamplingParams:
        """The request's SamplingParams, with the endpoint's own checks (make_params)."""
        raise NotImplementedError

    def build_prompts(self, body, params: SamplingParams) -> tuple[list[dict], Any]:
        """The engine prompts ({"prompt", "prompt_token_ids"}), and what the formatting hooks
        need besides the body (chat: its tool plan; None for completions)."""
        raise NotImplementedError

    def response(self, body, request_id: str, prompts: list[dict], plan, finals: list):
        """The whole answer, from each prompt's final RequestOutput."""
        raise NotImplementedError

    def stream_chunks(
        self,
        body,
        request_id: str,
        prompts: list[dict],
        plan,
        stream: AsyncIterator[tuple[int, RequestOutput]],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """The stream's chunks as JSON text (events() frames them), from the merged outputs
        tagged with their prompt's index."""
        raise NotImplementedError

    def frame(self, chunks: AsyncIterator, request_id: str) -> AsyncIterator[str]:
        """The stream's chunks as server-sent events (OpenAI's: data lines, then [DONE]); an API
        with named events (Responses, Anthropic's Messages) frames its own."""
        return events(chunks, request_id)

    # -- the steps ------------------------------------------------------------------------------
    def count_error(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.count_error(reason)

    def client_left(self) -> JSONResponse:
        """The answer nobody reads (its requests aborted), counted."""
        self.count_error("client_disconnected")
        return JSONResponse({}, status_code=499)

    async def _counted(self, chunks: AsyncIterator) -> AsyncIterator:
        """The stream's chunks; a failure after the status was sent counted before framing."""
        async with contextlib.aclosing(chunks):
            try:
                async for chunk in chunks:
                    yield chunk
            except Exception:
                self.count_error("stream_error")
                raise

    def check_model(self, model: str | None):
        """The LoRA adapter `model` names (None: the base model); a 404 for an unknown name."""
        if self.loras is not None:
            return self.loras.resolve(model)
        if model is not None and model != self.served_model_name:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")
        return None

    @staticmethod
    def prompt_logprobs(body, final: RequestOutput) -> list | None:
        """The request's prompt_logprobs in vLLM's shape: per prompt token (None for the
        first) the token's own entry and the body.prompt_logprobs most likely (fewer than the
        engine computed when echo with logprobs asked for more)."""
        k = body.prompt_logprobs
        if k is None or final.prompt_logprobs is None:
            return None
        token_ids = final.prompt_token_ids
        out = []
        for token_id, entries in zip(token_ids, final.prompt_logprobs, strict=True):
            if entries is None:
                out.append(None)
                continue
            out.append({
                t: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                for t, lp in entries.items()
                if t == token_id or (lp.rank is not None and lp.rank <= k)
            })  # fmt: skip
        return out

    def text_or_token_prompts(
        self, prompt, param: str, add_special_tokens: bool = True
    ) -> list[dict]:
        """OpenAI's four prompt forms (a string, strings, token ids, lists of token ids) ->
        engine prompts; `param` names the field in the 400s."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError(f"{param} must not be empty", param=param)
        if len(prompt) > self.limits.max_prompts:
            raise OpenAIError(
                f"the request has {len(prompt)} prompts; this server allows at most "
                f"{self.limits.max_prompts} (--max-prompts)",
                param=param,
            )
        vocab = self.engine.model_config.vocab_size
        prompts = []
        for p in prompt:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise OpenAIError("this model has no tokenizer: send token ids", param=param)
                ids = self.tokenizer.encode(p, add_special_tokens=add_special_tokens)
                prompts.append({"prompt": p, "prompt_token_ids": ids})
                continue
            with bad_request_checked():
                check_vocab(p, vocab, param)
            prompts.append({"prompt": None, "prompt_token_ids": list(p)})
        return prompts

    def model_name(self, body) -> str:
        """The name the answer gives: the adapter's, or the base model's."""
        if self.loras is not None and body.model in self.loras.adapters:
            return body.model
        return self.served_model_name

    def check_health(self) -> None:
        try:
            self.async_engine.check_health()
        except EngineDeadError as e:
            raise OpenAIError(str(e), 503) from None

    def check_queue(self, num_new: int) -> None:
        """503 (retry later) when the engine's waiting queue is full."""
        limit = self.config.max_waiting_requests
        if limit is None:
            return
        waiting = self.engine.get_stats()["num_waiting"]
        if waiting + num_new > limit:
            raise OpenAIError(
                f"the server is overloaded: {waiting} requests are waiting (at most {limit}, "
                f"this request adds {num_new}); retry later",
                503,
                reason="overloaded",
            )

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """vLLM's context-length errors: the prompt plus max_tokens must fit max_model_len."""
        limit = self.max_model_len
        if max_tokens is None or num_prompt_tokens == 0:  # as the engine checks it
            with bad_request_checked():
                check_fits(
                    num_prompt_tokens, limit, param="messages" if num_prompt_tokens else "prompt"
                )
        elif num_prompt_tokens + max_tokens > limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the input, "
                f"{max_tokens} in the completion). Please reduce the length of the input or "
                "completion.",
                param="max_tokens",
            )

    def check_limits(self, params: SamplingParams) -> None:
        """The server's per-request limits (`ServerLimits`) on checked SamplingParams."""
        limits = self.limits
        if params.num_sequences > limits.max_n:
            raise OpenAIError(
                f"the request runs {params.num_sequences} sequences (n, best_of or beam width); "
                f"this server allows at most {limits.max_n} (--max-n)",
                param="best_of" if params.best_of is not None else "n",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limits.max_logprobs:
                raise OpenAIError(
                    f"{name} must be at most {limits.max_logprobs} (--max-logprobs), got {value}",
                    param="logprobs",
                )
        for name in ("stop", "stop_token_ids"):
            count = len(getattr(params, name))
            if count > limits.max_stop:
                raise OpenAIError(
                    f"{name} has {count} entries; this server allows at most {limits.max_stop} "
                    "(--max-stop)",
                    param=name,
                )

    def log_request(self, request_id: str, prompts: list[dict], params: SamplingParams) -> None:
        """Prompts go to the log only with --enable-log-requests; ids and sizes always may."""
        if self.config.log_requests:
            for i, prompt in enumerate(prompts):
                logger.info(
                    "request %s-%d: prompt %r, prompt_token_ids %s, params %s",
                    request_id, i, prompt["prompt"], prompt["prompt_token_ids"], params,
                )  # fmt: skip

    @staticmethod
    def make_params(build, *args) -> SamplingParams:
        try:
            return build(*args)
        except (ValueError, TypeError) as e:
            # SamplingParams' messages start with the field's name (and a colon for the request's
            # own structured-output fields).
            name = str(e).split(" ", 1)[0].removesuffix(":")
            known = name in SamplingParams.__dataclass_fields__ or name in _STRUCTURED_FIELDS
            param = name if known else None
            raise OpenAIError(str(e), param=param) from None

    def generators(
        self,
        prompts: list[dict],
        params: SamplingParams,
        request_id: str,
        delta: bool,
        lora=None,
        priority: int = 0,
    ) -> list[AsyncIterator[RequestOutput]]:
        self.check_queue(len(prompts))
        now = time.time()
        requests = [
            EngineCoreRequest.of(
                self.tokenizer,
                f"{request_id}-{i}",
                prompt,
                params,
                now,
                lora_request=lora,
                priority=priority,
            )  # fmt: skip
            for i, prompt in enumerate(prompts)
        ]
        gens = [
            self.async_engine.generate(request, params, request.request_id, delta)
            for request in requests
        ]
        if self.metrics is not None:
            gens = [self.metrics.observe(gen, delta) for gen in gens]
        return gens

    async def final_outputs(self, gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        """The last (complete) output of each generator, in order."""
        finals: list[RequestOutput | None] = [None] * len(gens)
        async for i, output in merge(gens):
            finals[i] = output
        return finals  # type: ignore[return-value]

    async def first_and_rest(
        self, gens: list[AsyncIterator[RequestOutput]]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The merged stream, its first item already awaited, so that bad input (raised by the
        engine on the first item) becomes a 400 before the streaming response starts."""
        stream = merge(gens)
        try:
            first = await anext(stream)
        except BaseException as e:
            await stream.aclose()
            raise engine_error(e) from None

        async def rest():
            try:
                yield first
                async for item in stream:
                    yield item
            finally:
                await stream.aclose()

        return rest()
