"""The offline API: `LLM(model=...).generate(prompts, params)` and `.chat(messages, params)`."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm import tqdm

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    PoolingRequestOutput,
    RequestOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

Conversation = list[dict]
_MAX_LOGPROBS = 20  # SamplingParams.logprobs' upper bound


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a string, a token id list or a dict) or a sequence of them, as a list."""
    if isinstance(prompts, str | dict) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    return list(prompts)


class LLM:
    """Takes every engine flag as a keyword argument, as vLLM's LLM does."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(
                f"unknown engine argument(s) {sorted(unknown)}; "
                f"known: {sorted(EngineArgs.field_names())}"
            )
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs))

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (also done at exit)."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """lora_request: one adapter for every prompt, or one (or None) per prompt (needs
        LLM(enable_lora=True)); priority: one per prompt (needs scheduling_policy="priority")."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams | PoolingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts: "
                "give one, or one per prompt"
            )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(
                f"got {len(lora_request)} LoRA requests for {len(prompts)} prompts: "
                "give one, or one per prompt"
            )
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = []
        try:
            for prompt, params, lora, level in zip(
                prompts, sampling_params, lora_request, priority, strict=True
            ):
                ids.append(engine.add_request(None, prompt, params, lora_request=lora,
                                              priority=level))  # fmt: skip
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's embedding (`output.outputs.embedding`), pooled as the engine pools
        (needs runner="pooling", or a model that declares its pooling)."""
        params = PoolingParams() if pooling_params is None else pooling_params
        return self.generate(prompts, params, use_tqdm, lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's API): one `BeamSearchOutput` per prompt, holding
        the `beam_width` best finished beams, best first (by cumulative logprob / generated
        length ** length_penalty, as HF transformers ranks them). Each sequence's `tokens` are the
        prompt's followed by the output's (a final EOS included), `text` the output's alone."""
        sampling_params = params.to_sampling_params()
        # Per output token, the beam's top 2 x beam_width candidates (vLLM's choice), which the
        # runner has at hand anyway.
        sampling_params.logprobs = min(2 * params.beam_width, _MAX_LOGPROBS)
        outputs = self.generate(prompts, sampling_params, use_tqdm, lora_request)
        results = []
        for output in outputs:
            prompt_ids = list(output.prompt_token_ids)
            sequences = [
                BeamSearchSequence(
                    tokens=prompt_ids + list(c.token_ids),
                    logprobs=c.logprobs or [],
                    cum_logprob=c.cumulative_logprob or 0.0,
                    text=c.text,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in output.outputs
            ]
            results.append(BeamSearchOutput(sequences=sequences))
        return results

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot render a chat")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=tools,
            )
            # The rendered template already holds any BOS it wants.
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)  # fmt: skip
        start = time.perf_counter()
        num_in = num_out = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if not output.finished:
                        continue
                    finished[output.request_id] = output
                    num_in += len(output.prompt_token_ids)
                    if isinstance(output, RequestOutput):
                        num_out += sum(len(c.token_ids) for c in output.outputs)
                    elapsed = time.perf_counter() - start
                    speed = f"input: {num_in / elapsed:.1f}, output: {num_out / elapsed:.1f} toks/s"
                    bar.set_postfix_str(speed)
                    bar.update(1)
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]
