"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from pagedllm.entrypoints.openai.serving import MAX_LOGPROB, OpenAIServing
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams


def completion_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int, offset: int
) -> CompletionLogProbs:
    """OpenAI's completions format; `offset`: where the first token starts in the text."""
    result = CompletionLogProbs()
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        sampled = entry[token_id]
        token = sampled.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(max(sampled.logprob, MAX_LOGPROB))
        top = {}
        for tid, lp in sorted(entry.items(), key=lambda kv: kv[1].rank or 0):
            if tid == token_id or (lp.rank is not None and lp.rank <= num_top):
                top.setdefault(lp.decoded_token or "", max(lp.logprob, MAX_LOGPROB))
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(token)
    return result


def echo_logprobs(
    prompt_token_ids: list[int],
    prompt_logprobs: list[dict[int, Logprob] | None],
    num_top: int,
    decode,
) -> CompletionLogProbs:
    """The prompt's part of `echo` with `logprobs`: the first token has no logprob (nothing
    precedes it), as in OpenAI's and vLLM's answers; offsets start at 0."""
    first = CompletionLogProbs(
        tokens=[decode(prompt_token_ids[0])],
        token_logprobs=[None],
        top_logprobs=[None],
        text_offset=[0],
    )
    rest = completion_logprobs(
        prompt_token_ids[1:], prompt_logprobs[1:], num_top, len(first.tokens[0])
    )
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(first, name).extend(getattr(rest, name))
    return first


class OpenAIServingCompletion(OpenAIServing):
    id_prefix = "cmpl"

    def sampling_params(self, body: CompletionRequest) -> SamplingParams:
        if body.suffix is not None:
            raise OpenAIError("suffix is not supported", param="suffix")
        max_tokens = body.max_tokens
        if max_tokens == 0:  # the legacy API's scoring: the prompt echoed, nothing generated
            if not body.echo or body.stream:
                raise OpenAIError(
                    "max_tokens must be >= 1, or 0 with echo and no stream (scoring the prompt)",
                    param="max_tokens",
                )
            max_tokens = 1  # the engine generates a token; the answer leaves it out
        params = self.make_params(body.sampling_params, max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:  # the echoed prompt gets logprobs too
            params.prompt_logprobs = max(body.logprobs, body.prompt_logprobs or 0)
        return params

    def build_prompts(self, body: CompletionRequest, params) -> tuple[list[dict], None]:
        """A string, a list of strings, token ids, or a list of token-id lists -> engine prompts."""
        return self.text_or_token_prompts(body.prompt, "prompt"), None

    def _prompt_text(self, prompt: dict) -> str:
        if prompt["prompt"] is not None:
            return prompt["prompt"]
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(prompt["prompt_token_ids"], skip_special_tokens=False)

    def _choice_logprobs(self, body, c: CompletionOutput, offset: int, echoed=None):
        """`echoed`: the RequestOutput whose prompt is echoed in front of this text, if any."""
        if body.logprobs is None or c.logprobs is None:
            return None
        token_ids = [] if body.max_tokens == 0 else c.token_ids  # scoring: the prompt's alone
        result = completion_logprobs(token_ids, c.logprobs, body.logprobs, offset)
        if echoed is None or echoed.prompt_logprobs is None:
            return result
        prompt = echo_logprobs(
            echoed.prompt_token_ids, echoed.prompt_logprobs, body.logprobs, self._decode_token
        )
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(prompt, name).extend(getattr(result, name))
        return prompt

    def _decode_token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def response(
        self, body: CompletionRequest, request_id: str, prompts, plan, finals: list[RequestOutput]
    ) -> CompletionResponse:
        choices = []
        usage = UsageInfo()
        for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            usage.prompt_tokens += len(final.prompt_token_ids)
            echo = self._prompt_text(prompt) if body.echo else ""
            for c in final.outputs:
                scoring = body.max_tokens == 0
                usage.completion_tokens += 0 if scoring else len(c.token_ids)
                choices.append(
                    CompletionChoice(
                        index=i * body.n + c.index,
                        text=echo + ("" if scoring else c.text),
                        logprobs=self._choice_logprobs(
                            body, c, len(echo), final if body.echo else None
                        ),
                        finish_reason="length" if scoring else c.finish_reason,
                        stop_reason=None if scoring else c.stop_reason,
                        prompt_logprobs=self.prompt_logprobs(body, final),
                    )
                )
        choices.sort(key=lambda ch: ch.index)
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return CompletionResponse(
            id=request_id, model=self.model_name(body), choices=choices, usage=usage
        )

    async def stream_chunks(
        self,
        body: CompletionRequest,
        request_id: str,
        prompts: list[dict],
        plan,
        stream: AsyncIterator[tuple[int, RequestOutput]],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        model = self.model_name(body)
        offsets: dict[int, int] = {}  # choice index -> characters sent so far
        usage = UsageInfo()
        counted_prompts = set()
        async for i, output in stream:
            if i not in counted_prompts:
                counted_prompts.add(i)
                usage.prompt_tokens += len(output.prompt_token_ids)
            for c in output.outputs:
                index = i * body.n + c.index
                text = c.text
                echoed = None
                if index not in offsets:
                    offsets[index] = 0
                    if body.echo:
                        text = self._prompt_text(prompts[i]) + text
                        echoed = output
                usage.completion_tokens += len(c.token_ids)
                if not text and not c.token_ids and c.finish_reason is None:
                    continue
                offset = offsets[index] + len(text) - len(c.text)
                choice = CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=self._choice_logprobs(body, c, offset, echoed),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                offsets[index] += len(text)
                chunk = CompletionResponse(id=request_id, model=model, choices=[choice])
                yield chunk.model_dump_json(exclude_unset=False)
        if include_usage:
            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
            chunk = CompletionResponse(id=request_id, model=model, choices=[], usage=usage)
            yield chunk.model_dump_json()
