"""From an EngineCoreRequest (a tokenized prompt and its params) to a Sequence the scheduler can
always finish: every check a request must pass before it is queued (with the fix in the message),
the resolved output budget, and the structured-output grammar."""

from __future__ import annotations

import dataclasses
import threading

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_spec import KVCacheSpec
from pagedllm.engine.request_checks import check_dimensions, check_fits, check_vocab
from pagedllm.lora_request import LoRARequest
from pagedllm.model_loader.lora_adapter import load_lora_adapter
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import EngineCoreRequest
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.sequence import Sequence
from pagedllm.structured_output import Grammar, StructuredOutputManager


class InputProcessor:
    def __init__(
        self, config: EngineConfig, tokenizer, kv_cache_spec: KVCacheSpec, num_blocks: int
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.kv_cache_spec = kv_cache_spec
        self.num_blocks = num_blocks
        self.eos_token_ids = list(config.model.arch.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            if tokenizer.eos_token_id not in self.eos_token_ids:
                self.eos_token_ids.append(tokenizer.eos_token_id)
        self._structured_output_manager: StructuredOutputManager | None = None  # on first use
        self._manager_lock = threading.Lock()  # compile_grammar runs off the engine's thread
        self._checked_loras: dict[int, str] = {}  # adapter id -> its path, once read and checked

    def process(self, core: EngineCoreRequest, grammar: Grammar | None = None) -> Sequence:
        """The request's first sequence (its group is `seq.group`; both hold `core` as it is);
        ValueError if it is one the engine must refuse. `grammar`: its structured-output
        constraint compiled already (compile_grammar, off the engine's thread); else it is
        compiled here."""
        config = self.config
        params, priority, lora_request = core.params, core.priority, core.lora_request
        pooling = isinstance(params, PoolingParams)
        runner = config.model.runner
        if pooling != (runner == "pooling"):
            raise ValueError(
                "this engine runs the pooling runner (--runner pooling): it serves embeddings, "
                "not generation" if runner == "pooling" else
                "embeddings need the pooling runner: start the engine with --runner pooling"
            )  # fmt: skip
        if priority != 0 and config.scheduler.policy != "priority":
            raise ValueError(
                f"priority {priority} needs --scheduling-policy priority (the policy is "
                f"{config.scheduler.policy})"
            )
        if pooling:
            self._check_pooling(params)
        else:
            self._check_sequences(params.num_sequences)
        if lora_request is not None:
            self.check_lora(lora_request)
        token_ids = core.prompt_token_ids
        self._validate_prompt(token_ids, room_for_output=not pooling)
        if pooling:  # prefill-only: one token's budget, never sampled
            seq = Sequence(core, self.eos_token_ids, 1)
            seq.pooling_params = dataclasses.replace(params, pooling_type=config.model.pooling_type)
            return seq
        vocab = config.model.arch.vocab_size
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {vocab}")
        room = config.scheduler.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self._validate_group(params.num_sequences, len(token_ids) + max_tokens)
        seq = Sequence(core, self.eos_token_ids, max_tokens)
        if params.structured_outputs is not None:
            if grammar is None:
                grammar = self.compile_grammar(params.structured_outputs)
            seq.grammar = grammar
        return seq

    def compile_grammar(self, structured_outputs: StructuredOutputsParams) -> Grammar:
        """The constraint compiled against this model's tokenizer (any thread)."""
        return self._structured_outputs().grammar(structured_outputs)

    def _check_pooling(self, params: PoolingParams) -> None:
        check_dimensions(params.dimensions, self.config.model.arch.hidden_size)

    def _check_sequences(self, num_sequences: int) -> None:
        """A request's n / best_of / beam width against max_num_seqs and the KV allocation."""
        max_num_seqs = self.config.scheduler.max_num_seqs
        if num_sequences > max_num_seqs:
            raise ValueError(
                f"the request runs {num_sequences} sequences (n, best_of or beam width), "
                f"more than max_num_seqs ({max_num_seqs}): lower it or raise --max-num-seqs"
            )
        allocation = self.config.cache.kv_allocation
        if num_sequences > 1 and allocation != "paged":
            raise ValueError(
                f"--kv-allocation {allocation} runs one sequence per request: "
                "n, best_of and beam search need paged KV blocks"
            )

    def check_lora(self, lora_request: LoRARequest) -> None:
        """ValueError unless LoRA is on and the adapter can run on this model (read once per
        adapter id; an id names one adapter)."""
        lora = self.config.lora
        if lora is None:
            raise ValueError("LoRA adapters need a server started with --enable-lora")
        path = self._checked_loras.get(lora_request.lora_int_id)
        if path is not None:
            if path != lora_request.lora_path:
                raise ValueError(
                    f"lora_int_id {lora_request.lora_int_id} already names the adapter at "
                    f"{path}: give another adapter another id"
                )
            return
        load_lora_adapter(lora_request.lora_path, self.config.model.arch, lora.max_lora_rank)
        self._checked_loras[lora_request.lora_int_id] = lora_request.lora_path

    def _structured_outputs(self) -> StructuredOutputManager:
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and it has none")
        with self._manager_lock:
            if self._structured_output_manager is None:
                self._structured_output_manager = StructuredOutputManager(
                    self.tokenizer, self.config.model.arch.vocab_size, self.eos_token_ids
                )
            return self._structured_output_manager

    def _validate_prompt(self, token_ids: list[int], room_for_output: bool = True) -> None:
        check_fits(len(token_ids), self.config.scheduler.max_model_len, room_for_output)
        check_vocab(token_ids, self.config.model.arch.vocab_size)

    def _validate_group(self, num_seqs: int, max_len: int) -> None:
        """Refuse a group the scheduler could never finish (it would loop forever): its
        sequences decode in lockstep, so all must fit one step's token budget; and a preempted
        group is recomputed with nothing shared, so it must fit the pool as num_seqs separate
        sequences (a single sequence always does: checked at start-up)."""
        budget = self.config.scheduler.max_num_batched_tokens
        if num_seqs > budget:
            raise ValueError(
                f"the request runs {num_seqs} sequences (n, best_of or beam width), which decode "
                f"together, but max_num_batched_tokens is {budget}: raise "
                "--max-num-batched-tokens or lower n / best_of"
            )
        need = num_seqs * self.kv_cache_spec.max_num_blocks(max_len, chunk=budget)
        if num_seqs > 1 and need > self.num_blocks:
            raise ValueError(
                f"the request runs {num_seqs} sequences of up to {max_len} tokens, which need "
                f"{need} blocks of the KV cache, but it has {self.num_blocks}: lower n / best_of "
                "or max_tokens, or raise --kv-cache-memory"
            )
