"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    ChatChoiceLogProbs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProb,
    ChatLogProbsContent,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from pagedllm.entrypoints.openai.reasoning import ReasoningStream, split_reasoning
from pagedllm.entrypoints.openai.serving import MAX_LOGPROB, OpenAIServing
from pagedllm.entrypoints.openai.tools import (
    ToolCallStream,
    ToolPlan,
    calls_in_output,
    plan_tools,
    response_tool_calls,
    template_messages,
)
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams


def _logprob(lp: Logprob) -> ChatLogProb:
    token = lp.decoded_token or ""
    return ChatLogProb(
        token=token, logprob=max(lp.logprob, MAX_LOGPROB), bytes=list(token.encode())
    )


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int
) -> ChatChoiceLogProbs:
    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        sampled = _logprob(entry[token_id])
        ranked = sorted(
            (lp for lp in entry.values() if lp.rank is not None and lp.rank <= num_top),
            key=lambda lp: lp.rank,
        )
        top = [_logprob(lp) for lp in ranked[:num_top]]
        content.append(ChatLogProbsContent(**sampled.model_dump(), top_logprobs=top))
    return ChatChoiceLogProbs(content=content)


def _message_dict(message) -> dict:
    data = message.model_dump(exclude_none=True)
    content = data.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError("only text content parts are supported", param="messages.content")
            texts.append(part["text"])
        data["content"] = "\n".join(texts)
    return data


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"

    def render(self, messages, add_generation_prompt: bool, tools: ToolPlan | None = None) -> dict:
        """Chat messages (and the tools they may call) through the template ->
        {"prompt", "prompt_token_ids"}."""
        template = self.config.chat_template or (self.tokenizer and self.tokenizer.chat_template)
        if self.tokenizer is None or template is None:
            raise OpenAIError("this model has no chat template: use /v1/completions")
        messages = [_message_dict(m) for m in messages]
        messages, tool_dicts = template_messages(messages, tools or ToolPlan(), template)
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                chat_template=template,
                tools=tool_dicts,
            )
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation
            raise OpenAIError(f"cannot apply the chat template: {e}", param="messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": ids}

    @staticmethod
    def _constrain_tool_calls(plan: ToolPlan, params) -> None:
        """Constrain the output so that tool calls parse: "required" and named choices always,
        "auto" (hermes) unless the request constrains its output itself or uses beam search."""
        constraint = plan.structured_outputs()
        if constraint is None:
            return
        if plan.mode == "auto" and (params.structured_outputs or params.use_beam_search):
            return  # free text; the parser still reads any calls in it
        if params.structured_outputs is not None:
            raise OpenAIError(
                f'tool_choice "{plan.mode}" constrains the output itself: it cannot be combined '
                "with response_format or structured_outputs",
                param="tool_choice",
            )
        if params.use_beam_search:
            raise OpenAIError(
                "tool calls are not supported with beam search", param="use_beam_search"
            )
        params.structured_outputs = constraint

    def _num_logprobs(self, body: ChatCompletionRequest) -> int | None:
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise OpenAIError(
                    "when using top_logprobs, logprobs must be set to true", param="top_logprobs"
                )
            if not 0 <= body.top_logprobs <= self.limits.max_logprobs:
                raise OpenAIError(
                    f"top_logprobs must be an integer in [0, {self.limits.max_logprobs}] "
                    f"(--max-logprobs), got {body.top_logprobs}",
                    param="top_logprobs",
                )
        if not body.logprobs:
            return None
        return body.top_logprobs or 0

    def sampling_params(self, body: ChatCompletionRequest) -> SamplingParams:
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        return self.make_params(body.sampling_params, max_tokens, self._num_logprobs(body))

    def build_prompts(self, body: ChatCompletionRequest, params) -> tuple[list[dict], ToolPlan]:
        """The conversation through the template, and how the reply may call tools."""
        plan = plan_tools(body, self.config.enable_auto_tool_choice, self.config.tool_call_parser)
        self._constrain_tool_calls(plan, params)
        return [self.render(body.messages, body.add_generation_prompt, plan)], plan

    def _choice_logprobs(self, c: CompletionOutput, num_logprobs: int | None):
        if num_logprobs is None or c.logprobs is None:
            return None
        return chat_logprobs(c.token_ids, c.logprobs, num_logprobs)

    def response(
        self, body, request_id: str, prompts, plan: ToolPlan, finals: list[RequestOutput]
    ) -> ChatCompletionResponse:
        final, num_logprobs = finals[0], self._num_logprobs(body)
        choices = []
        parser = self.config.reasoning_parser
        for c in sorted(final.outputs, key=lambda c: c.index):
            reasoning, text = split_reasoning(parser, c.text) if parser else (None, c.text)
            message = ChatResponseMessage(content=text, reasoning_content=reasoning)
            finish_reason = c.finish_reason
            if plan.mode != "none":
                content, calls = calls_in_output(plan, text or "")
                tool_calls = response_tool_calls(calls)
                message = ChatResponseMessage(
                    content=content, tool_calls=tool_calls, reasoning_content=reasoning
                )
                if calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
            choices.append(
                ChatCompletionChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._choice_logprobs(c, num_logprobs),
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        prompt_tokens = len(final.prompt_token_ids)
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        usage = UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        return ChatCompletionResponse(
            id=request_id, model=self.model_name(body), choices=choices, usage=usage,
            prompt_logprobs=self.prompt_logprobs(body, final),
        )  # fmt: skip

    async def stream_chunks(
        self,
        body: ChatCompletionRequest,
        request_id: str,
        prompts,
        plan: ToolPlan,
        stream: AsyncIterator[tuple[int, RequestOutput]],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        chunks = self.chunk_objects(body, request_id, plan, stream, include_usage)
        async for chunk in chunks:
            yield chunk.model_dump_json()

    async def chunk_objects(
        self,
        body: ChatCompletionRequest,
        request_id: str,
        plan: ToolPlan,
        stream: AsyncIterator[tuple[int, RequestOutput]],
        include_usage: bool,
    ) -> AsyncIterator[ChatCompletionChunk]:
        """The stream's chunks as objects (APIs built on chat's turn them into their events)."""
        model = self.model_name(body)
        num_logprobs = self._num_logprobs(body)
        usage = UsageInfo()
        tool_streams, reasoning_streams = {}, {}
        if plan.mode != "none":
            tool_streams = {i: ToolCallStream(plan) for i in range(body.n)}
        if self.config.reasoning_parser:
            parser = self.config.reasoning_parser
            reasoning_streams = {i: ReasoningStream(parser) for i in range(body.n)}
        # The role comes first, once per choice, as OpenAI sends it.
        for index in range(body.n):
            delta = DeltaMessage(role="assistant", content="")
            role = ChatStreamChoice(index=index, delta=delta)
            chunk = ChatCompletionChunk(id=request_id, model=model, choices=[role])
            yield chunk
        async for _, output in stream:
            usage.prompt_tokens = len(output.prompt_token_ids)
            for c in output.outputs:
                usage.completion_tokens += len(c.token_ids)
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                text, reasoning = c.text, None
                reasoning_stream = reasoning_streams.get(c.index)
                if reasoning_stream is not None:
                    last = c.finish_reason is not None
                    reasoning, text = reasoning_stream.feed(c.text, last)
                delta, finish_reason = DeltaMessage(content=text), c.finish_reason
                tool_stream = tool_streams.get(c.index)
                if tool_stream is not None:
                    delta, finish_reason = _tool_delta(tool_stream, text, c.finish_reason)
                if reasoning_stream is not None:
                    delta.reasoning_content = reasoning or None
                    delta.content = delta.content or None
                choice = ChatStreamChoice(
                    index=c.index,
                    delta=delta,
                    logprobs=self._choice_logprobs(c, num_logprobs),
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                )
                yield ChatCompletionChunk(id=request_id, model=model, choices=[choice])
        if include_usage:
            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
            yield ChatCompletionChunk(id=request_id, model=model, choices=[], usage=usage)


def _tool_delta(
    stream: ToolCallStream, text: str, finish_reason: str | None
) -> tuple[DeltaMessage, str | None]:
    """A choice's next delta when it may call tools: content and calls as they become certain;
    the last one carries what the finished text still holds."""
    content, calls = stream.feed(text)
    if finish_reason is not None:
        more_content, more_calls = stream.finish()
        content = (content or "") + (more_content or "") or None
        calls += more_calls
        if stream.num_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
    return DeltaMessage(content=content, tool_calls=calls or None), finish_reason
