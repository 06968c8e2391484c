"""LLMEngine: the step loop and the request table. Each step the scheduler decides what runs,
the executor runs it on the workers, the scheduler takes the sampled tokens, and the output
builder reports them as EngineCoreOutputs (token ids); requests come in through the input
processor. `step()` also turns those into RequestOutputs (text) with the output processor;
the engine process leaves that to the server's side (`output_processing=False`, `step_core()`)."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

from pagedllm.attention.kv_quant import FLOAT_DTYPES
from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.core.contiguous_kv_cache_manager import ContiguousKVCacheManager
from pagedllm.core.kv_cache_interface import KVCacheInterface
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.arg_utils import create_engine_config
from pagedllm.engine.core_output import EngineCoreOutput
from pagedllm.engine.engine_info import EngineDescription
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.kv_events import KVEventPublisher
from pagedllm.engine.kv_snapshot import kv_snapshot
from pagedllm.engine.output_builder import OutputBuilder
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.stats import EngineStats
from pagedllm.executor import Executor, create_executor
from pagedllm.lora_request import LoRARequest
from pagedllm.model_loader.loader import load_model_tokenizer
from pagedllm.outputs import RequestOutput, ResumedOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import EngineCoreRequest, PromptType
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.sequence import SequenceStatus
from pagedllm.structured_output import Grammar
from pagedllm.worker.lora_manager import LoRALoadError

logger = logging.getLogger("pagedllm")

# (config, num_blocks, num_cpu_blocks, sliding window of each KV cache group) -> a KV cache
# manager: the engine's own choice by --kv-allocation, or one a benchmark passes in.
KVCacheManagerFactory = Callable[[EngineConfig, int, int, list], KVCacheInterface]

__all__ = ["LLMEngine", "PromptType"]


def make_kv_cache_manager(
    config: EngineConfig, num_blocks: int, num_cpu_blocks: int, windows: list
) -> KVCacheInterface:
    cache = config.cache
    if cache.kv_allocation == "paged":
        return KVCacheManager(
            num_blocks, cache.block_size, cache.enable_prefix_caching, num_cpu_blocks, windows,
            cache.num_state_checkpoints,
        )  # fmt: skip
    if windows != [None]:
        raise ValueError(
            f"--kv-allocation {cache.kv_allocation} reserves contiguous memory for full "
            "attention only; this model has sliding-window layers: use paged"
        )
    logger.warning(
        "--kv-allocation %s: contiguous KV reservations, for benchmarks only (no sharing, "
        "no prefix caching, n=1)", cache.kv_allocation,
    )  # fmt: skip
    return ContiguousKVCacheManager(
        num_blocks, cache.block_size, cache.kv_allocation, config.scheduler.max_model_len
    )


def _resume(request, resumed: ResumedOutput) -> None:
    """Append a lost engine's output tokens to `request` as if sampled here (its grammar takes
    them too); the scheduler then computes prompt and tokens as after a recompute preemption."""
    if request.num_samples > 1 or request.group.is_beam_search or request.pooling_params:
        raise ValueError("only a request of one sequence (n = best_of = 1, no beam search) resumes")
    if request.num_tokens + len(resumed.token_ids) > request.max_tokens + request.num_prompt_tokens:
        raise ValueError("the resumed output is longer than max_tokens")
    for token_id in resumed.token_ids:
        request.append_output_token(token_id)
    request.output_logprobs = [None] * len(resumed.token_ids)  # aligned with the tokens
    request.cumulative_logprob = resumed.cumulative_logprob


class LLMEngine(EngineDescription):
    def __init__(
        self,
        args: EngineArgs,
        *,
        executor: Executor | None = None,
        kv_cache_manager: KVCacheManagerFactory = make_kv_cache_manager,
        output_processing: bool = True,
    ) -> None:
        """`executor`: another engine's, whose loaded model this one runs with its own cache
        settings (the models must agree; the other engine steps no more); `kv_cache_manager`:
        how the block manager is made; `output_processing`: False in the engine process,
        whose outputs the server's side processes (only step_core() then)."""
        if args.data_parallel_size > 1 and args.data_parallel_rank is None:
            raise ValueError(
                "--data-parallel-size > 1 runs engine replicas behind `pagedllm serve` (in "
                "their own processes); one engine is one replica"
            )
        self.args = args
        self.config = config = create_engine_config(args)
        self.tokenizer = load_model_tokenizer(args.model, args.tokenizer)
        if executor is None:
            executor = create_executor(config)
        elif executor.config.model != config.model:
            raise ValueError("an executor runs the model it loaded: the model configs differ")
        elif executor.config.speculative != config.speculative:
            raise ValueError("an executor's runner proposes drafts as its own engine asked")
        else:
            executor.initialize_cache(config.cache, config.scheduler)
        self.executor = executor
        executor.owner = self  # an engine whose executor another took over must not step
        try:
            spec, num_blocks = executor.kv_cache_spec, executor.num_gpu_blocks
            manager = kv_cache_manager(config, num_blocks, executor.num_cpu_blocks,
                                       spec.sliding_windows)  # fmt: skip
            self.scheduler = Scheduler(config.scheduler, manager)
            self.input_processor = InputProcessor(config, self.tokenizer, spec, num_blocks)
            self._kv_events = self._kv_event_log = None
            if config.kv_events is not None:
                medium = "GPU" if config.device.device == "cuda" else "CPU"
                self._kv_event_log = manager.record_events(medium)
                dp = config.parallel
                rank = dp.data_parallel_rank if dp.data_parallel_size > 1 else None
                self._kv_events = KVEventPublisher(config.kv_events.for_rank(rank or 0), rank)
                self._publish_kv_events()  # AllBlocksCleared: a new engine's cache is empty
        except BaseException:
            self.shutdown()
            raise
        self.output_builder = OutputBuilder()
        self.output_processor = None
        if output_processing:
            self.output_processor = OutputProcessor(self.tokenizer, self.finish_sample)
        self._num_preemptions_logged = 0
        # Tokens run through the model: prompt tokens prefilled (again after a recompute), and
        # tokens sampled; for throughput logs.
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self._request_counter = itertools.count()

    # -- what the engine is (and model_name, model_config, max_model_len) ----------------------
    @property
    def eos_token_ids(self) -> list[int]:
        """The model's end-of-sequence ids and the tokenizer's."""
        return self.input_processor.eos_token_ids

    @property
    def max_num_batched_tokens(self) -> int:
        return self.config.scheduler.max_num_batched_tokens

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    @property
    def num_blocks(self) -> int:
        return self.executor.num_gpu_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.executor.num_cpu_blocks

    @property
    def kv_cache_spec(self):
        return self.executor.kv_cache_spec

    @property
    def weight_bytes(self) -> int:
        """What rank 0's weights take in memory."""
        return self.executor.driver_worker.weight_bytes

    @property
    def device(self):
        return self.executor.driver_worker.device

    @property
    def dtype(self):
        return FLOAT_DTYPES[self.config.model.dtype]

    def check_workers(self) -> None:
        """Raise if a tensor-parallel worker has exited (the engine cannot step without it), or
        if another engine took this one's executor over."""
        if self.executor.owner is not self:
            raise RuntimeError("another engine took this engine's executor over: it cannot step")
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any, and the KV event publisher.
        Idempotent; also run at exit."""
        if getattr(self, "_kv_events", None) is not None:
            self._kv_events.shutdown()
            self._kv_events = None
        self.executor.shutdown()

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        delta: bool = False,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        grammar: Grammar | None = None,
        resumed: ResumedOutput | None = None,
    ) -> str:
        """Queue a request; `delta=True` makes each output carry only the new text and tokens.
        Requests share prefix-cached blocks only with requests of the same `cache_salt` and
        LoRA adapter (`lora_request`, with --enable-lora). `priority`: with --scheduling-policy
        priority, lower values run first. PoolingParams (with --runner pooling): an embedding
        request, whose one output is a PoolingRequestOutput. `grammar`: the structured-output
        constraint compiled already (compile_grammar), else it is compiled here. `resumed`:
        the output a lost engine had generated for it (a single-sequence request), taken as
        generated here: sampling, stop checks and the text go on after it."""
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        core = EngineCoreRequest.of(
            self.tokenizer, request_id, prompt, params or SamplingParams(),
            arrival_time if arrival_time is not None else time.time(), cache_salt=cache_salt,
            lora_request=lora_request, priority=priority, resumed=resumed,
        )  # fmt: skip
        return self.add_core_request(core, delta, grammar)

    def add_core_request(
        self, core: EngineCoreRequest, delta: bool = False, grammar: Grammar | None = None
    ) -> str:
        """Queue a request made already (what add_request makes; the async engine and the
        engine process take theirs so); `delta` and `grammar` as in add_request."""
        request_id = core.request_id
        processor = self.output_processor
        in_use = processor is not None and request_id in processor.states
        if in_use or self.scheduler.is_id_in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.input_processor.process(core, grammar)
        if core.resumed is not None:
            _resume(request, core.resumed)
        if processor is not None:
            processor.add_request(core, delta)
        self.output_builder.add_request(request.group)
        self.scheduler.add_request(request)
        return request_id

    def compile_grammar(self, structured_outputs: StructuredOutputsParams) -> Grammar:
        """A structured-output constraint compiled for this model, from any thread (the
        async engine compiles off its loop, so a large schema stalls no step); ValueError for
        one that does not compile."""
        return self.input_processor.compile_grammar(structured_outputs)

    def check_lora(self, lora_request: LoRARequest) -> None:
        """ValueError unless the adapter can run here (read and checked once per id): what a
        server checks when it loads an adapter by name."""
        self.input_processor.check_lora(lora_request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(ids, SequenceStatus.FINISHED_ABORTED)
        self.output_builder.remove(ids)
        if self.output_processor is not None:
            self.output_processor.remove(ids)

    def finish_sample(self, request_id: str, index: int | None) -> None:
        """The output processor ended sample `index` of a request (a stop string matched; its
        blocks are freed, its later tokens were never wanted), or the whole request (None)."""
        group = self.scheduler.requests.get(request_id)
        if group is None:
            return
        if index is None:
            self.scheduler.finish_requests([request_id], SequenceStatus.FINISHED_ABORTED)
        else:
            seq = next((s for s in group.seqs if s.sample_index == index), None)
            if seq is not None:
                self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)
        if request_id not in self.scheduler.requests:  # its last sequence ended
            self.output_builder.remove([request_id])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting + self.scheduler.num_swapped

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing done) while requests hold blocks."""
        done = self.scheduler.kv_cache_manager.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def _publish_kv_events(self) -> None:
        if self._kv_events is not None:
            self._kv_events.publish(self._kv_event_log.take())

    # -- the step loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return an output for every request that advanced
        (requests with best_of > n or beam search only once they finish)."""
        return self.output_processor.process(self.step_core())

    def step_core(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, and report what happened to every request that
        advanced, in token ids."""
        self.check_workers()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.preempted_request_ids:
            self._warn_preemption()
        if scheduler_output.is_empty:
            return []
        self.output_builder.mark_scheduled(scheduler_output, time.time())
        for seq in scheduler_output.scheduled_requests:
            start = seq.num_computed_tokens
            end = start + scheduler_output.num_scheduled_tokens[seq.seq_id]
            self.num_prompt_tokens_total += max(0, min(end, seq.num_prompt_tokens) - start)
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except LoRALoadError as e:  # before any rank ran: the step is simply not taken
            return self._fail_lora(e)
        self.num_generation_tokens_total += sum(
            len(ids) for ids in runner_output.sampled_token_ids.values()
        ) + len(runner_output.beam_candidates)
        groups = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._publish_kv_events()
        outputs, failed = self.output_builder.build(
            scheduler_output, runner_output, groups, time.time()
        )
        return outputs + [self._fail(group, e) for group, e in failed]

    def _fail(self, group, error: Exception) -> EngineCoreOutput:
        """Stop one request whose output could not be made: its blocks are freed, and its final
        output carries the error. (A failure in the batched model run is not tied to one
        request: it propagates, and the engine stops.)"""
        request_id = group.request_id
        logger.error("request %s failed: %r", request_id, error, exc_info=error)
        self.scheduler.finish_requests([request_id], SequenceStatus.FINISHED_ABORTED)
        return self.output_builder.fail(group, f"request {request_id} failed: {error!r}")

    def _fail_lora(self, error: LoRALoadError) -> list[EngineCoreOutput]:
        """Fail every request of an adapter that can no longer be read; the others run in the
        next step (their scheduled tokens are scheduled again)."""
        groups = [g for g in self.scheduler.requests.values() if g.lora_int_id == error.lora_int_id]
        return [self._fail(g, error) for g in groups]

    def _warn_preemption(self) -> None:
        """Like vLLM: the first preemption and every 50th after it are logged."""
        total = self.scheduler.num_preemptions_total
        if self._num_preemptions_logged and total < self._num_preemptions_logged + 50:
            return
        self._num_preemptions_logged = total
        logger.warning(
            "requests were preempted (%d so far; %d swapped out now, %d by swap in all): the KV "
            "cache is too small for the load. Raise --kv-cache-memory (or "
            "--gpu-memory-utilization), or lower --max-num-seqs or --max-num-batched-tokens; "
            "--preemption-mode %s is in use",
            total, self.scheduler.num_swapped, self.scheduler.num_swap_preemptions_total,
            self.config.scheduler.preemption_mode,
        )  # fmt: skip

    def get_stats(self) -> dict[str, float | int]:
        """Scheduler and KV cache counters (for logs, benchmarks and the metrics endpoint):
        `stats()` as a dict."""
        return self.stats().as_dict()

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        kv = scheduler.kv_cache_manager
        num_cpu = kv.num_cpu_blocks
        outputs = self.output_builder
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_swapped=scheduler.num_swapped,
            num_preemptions_total=scheduler.num_preemptions_total,
            num_swap_preemptions_total=scheduler.num_swap_preemptions_total,
            kv_cache_usage=kv.usage,
            swap_space_usage=1 - kv.num_free_cpu_blocks / num_cpu if num_cpu else 0.0,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            num_first_tokens_total=outputs.num_first_tokens_total,
            time_to_first_token_seconds_total=outputs.time_to_first_token_seconds_total,
            **self.executor.block_move_counts(),
            **self._spec_decode_stats(),
        )

    def lora_stats(self) -> dict | None:
        """The adapters of running and of waiting (or swapped) requests, by name, and the
        slots (vLLM's lora_requests_info); None without --enable-lora."""
        if self.config.lora is None:
            return None
        s = self.scheduler

        def names(groups) -> list[str]:
            loras = (g.first.lora_request for g in groups)
            return sorted({lora.lora_name for lora in loras if lora is not None})

        return {
            "running": names(list(s.running)),
            "waiting": names([*s.waiting, *s.swapped]),
            "max_lora": self.config.lora.max_loras,
        }

    def _spec_decode_stats(self) -> dict:
        """Speculative decoding's counters (vLLM's names), when it is on."""
        if self.config.speculative is None:
            return {}
        stats = self.scheduler.spec_decode_stats
        return {
            "spec_decode_num_drafts": stats.num_drafts,
            "spec_decode_num_draft_tokens": stats.num_draft_tokens,
            "spec_decode_num_accepted_tokens": stats.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(stats.num_accepted_tokens_per_pos),
        }

    def kv_snapshot(self, check: bool = False) -> dict:
        """The KV cache block by block, the requests' block tables and the counters (see
        engine/kv_snapshot.py); `check` adds the integrity check's verdict."""
        return kv_snapshot(self, check)
