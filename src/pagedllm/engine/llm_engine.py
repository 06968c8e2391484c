"""LLMEngine: the synchronous step loop tying loader, scheduler, model runner and detokenizer."""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from pagedllm.attention.selector import resolve_backend_name
from pagedllm.config import EngineArgs
from pagedllm.core.contiguous_kv_cache_manager import ContiguousKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.cpu_info import available_cpus
from pagedllm.distributed import HeadShard, TPGroup
from pagedllm.distributed.parallel import min_over_ranks
from pagedllm.distributed.workers import (
    TPWorkers,
    init_process_group,
    launched_rank,
    leave_group,
    stop_workers,
)
from pagedllm.engine.arg_utils import TORCH_DTYPES, create_engine_config, resolve_device
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.kv_snapshot import kv_snapshot
from pagedllm.model_loader.build import build_model
from pagedllm.model_loader.loader import load_model_tokenizer
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.request import Request, RequestStatus, SequenceGroup
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")

# A prompt: a string, a list of token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}.
PromptType = str | list[int] | dict


@dataclass
class _RequestState:
    """Output-side state of one request (sequence group), per sequence where it differs."""

    group: SequenceGroup
    delta: bool
    metrics: RequestMetrics
    detokenizers: dict[str, IncrementalDetokenizer] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    num_sent: dict[str, int] = field(default_factory=dict)  # tokens already output (delta)
    # prompt_logprobs by prompt position (a recomputed prompt overwrites the same values).
    prompt_logprobs: dict[int, dict[int, Logprob]] = field(default_factory=dict)


class LLMEngine:
    def __init__(
        self, args: EngineArgs, tp_rank: int = 0, tp_address: tuple[str, int] | None = None
    ) -> None:
        """`tp_rank` / `tp_address`: for the processes a tensor-parallel engine spawns (rank 0,
        the engine users make, spawns them; see pagedllm.distributed.workers)."""
        self.config = config = create_engine_config(args)
        self.args = args
        self.device = resolve_device(args.device)
        self.dtype = TORCH_DTYPES[config.model.dtype]
        torch.manual_seed(args.seed)
        tp_size = args.tensor_parallel_size
        self._threads_before = torch.get_num_threads()  # shutdown() gives a rank's share back
        if self.device.type == "cpu":
            ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", tp_size))  # torchrun sets it
            cores = max(1, available_cpus() // ranks_here)  # each rank its share of the cores
            if torch.get_num_threads() > cores:
                # More compute threads than cores: OpenMP's barriers wait on descheduled threads.
                torch.set_num_threads(cores)
            logger.info("torch threads: %d (cores available: %d)", torch.get_num_threads(), cores)

        self.model_name = config.model.name
        self.model_config = config.model.arch
        self.tokenizer = load_model_tokenizer(args.model, args.tokenizer)
        self.tp_workers: TPWorkers | None = None
        self._tp_driver = False  # rank 0 of a group: shutdown() stops the others
        if tp_size > 1:
            tp_rank, tp_address = self._place_rank(tp_rank, tp_address)
        try:
            if tp_size > 1:
                init_process_group(tp_rank, tp_size, tp_address, self.device)
                logger.info("tensor parallelism: %d ranks", tp_size)
            self._start()
        except BaseException:
            self.shutdown()
            raise

    def _place_rank(self, tp_rank: int, tp_address) -> tuple[int, tuple[str, int] | None]:
        """Before joining a tensor-parallel group: check the head split, find this process's
        rank and where to connect (torchrun's environment, or the workers rank 0 spawns now),
        and its GPU on CUDA."""
        size, config = self.args.tensor_parallel_size, self.model_config
        HeadShard.of(config.num_attention_heads, config.num_key_value_heads, TPGroup(0, size))
        launched = launched_rank()
        if launched is not None:  # torchrun started every rank
            world = int(os.environ["WORLD_SIZE"])
            if world != size:
                raise ValueError(
                    f"--tensor-parallel-size {size}, but the launcher started {world} ranks "
                    "(WORLD_SIZE): they must be equal"
                )
            tp_rank, tp_address = launched, None
        elif tp_rank == 0:
            self.tp_workers = TPWorkers(self.args, size)
            tp_address = self.tp_workers.address
        if tp_rank == 0:
            self._tp_driver = True
            atexit.register(self.shutdown)
        if self.device.type == "cuda":  # one GPU per rank of this node
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", tp_rank)))
            torch.cuda.set_device(self.device)
        return tp_rank, tp_address

    def _start(self) -> None:
        """Build the model (this rank's shard), the runner and its KV cache, the scheduler."""
        args, config = self.args, self.model_config
        self.attention_backend = resolve_backend_name(args.attention_backend, self.device)
        built = build_model(
            self.config.model, self.config.load, self.device, self.attention_backend
        )
        self.model, self.weight_bytes = built.model, built.weight_bytes

        self.max_model_len = self.config.scheduler.max_model_len
        self.eos_token_ids = list(config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            if self.tokenizer.eos_token_id not in self.eos_token_ids:
                self.eos_token_ids.append(self.tokenizer.eos_token_id)
        self._structured_output_manager: StructuredOutputManager | None = None  # on first use

        self.block_size = args.block_size
        self.max_num_batched_tokens = self.config.scheduler.max_num_batched_tokens
        self.runner = ModelRunner(
            self.model, config, self.block_size, self.device, self.dtype, seed=args.seed,
            attention_backend=self.attention_backend,
        )  # fmt: skip
        self.num_blocks = self._num_kv_blocks()
        if args.tensor_parallel_size > 1:  # every rank's pool holds the same block ids
            self.num_blocks = min_over_ranks(self.num_blocks)
        self.runner.allocate_kv_cache(self.num_blocks)
        self.num_cpu_blocks = self._num_swap_blocks()
        if self.num_cpu_blocks:
            self.runner.allocate_swap_space(self.num_cpu_blocks)
        self.scheduler = Scheduler(self.config.scheduler, self._kv_cache_manager())
        self._num_preemptions_logged = 0
        # Tokens run through the model: prompt tokens prefilled (again after a recompute), and
        # tokens sampled; for throughput logs.
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        # Requests that got their first token, and the sum of their times to it (a mean TTFT
        # over any interval from two readings).
        self.num_first_tokens_total = 0
        self.time_to_first_token_seconds_total = 0.0
        self._states: dict[str, _RequestState] = {}
        self._request_counter = itertools.count()

    def check_workers(self) -> None:
        """Raise if a tensor-parallel worker has exited: the engine cannot step without it."""
        if self.tp_workers is not None and (why := self.tp_workers.dead()):
            raise RuntimeError(f"{why}: the engine cannot step")

    def shutdown(self) -> None:
        """Rank 0 of a tensor-parallel group: stop the other ranks (and join those it spawned);
        nothing to do on one rank. Idempotent; also run at exit."""
        if not self._tp_driver:
            return
        self._tp_driver = False
        atexit.unregister(self.shutdown)
        if self.tp_workers is not None:
            self.tp_workers.shutdown()
        else:
            stop_workers()
            leave_group()
        torch.set_num_threads(self._threads_before)

    # -- start-up -----------------------------------------------------------------------------
    def _kv_cache_manager(self) -> KVCacheManager | ContiguousKVCacheManager:
        args = self.args
        if args.kv_allocation == "paged":
            return KVCacheManager(
                self.num_blocks,
                self.block_size,
                args.enable_prefix_caching,
                self.num_cpu_blocks,
                self.runner.kv_cache_spec.sliding_windows,
            )
        if self.runner.kv_cache_spec.sliding_windows != [None]:
            raise ValueError(
                f"--kv-allocation {args.kv_allocation} reserves contiguous memory for full "
                "attention only; this model has sliding-window layers: use paged"
            )
        logger.warning(
            "--kv-allocation %s: contiguous KV reservations, for benchmarks only (no sharing, "
            "no prefix caching, n=1)", args.kv_allocation,
        )  # fmt: skip
        return ContiguousKVCacheManager(
            self.num_blocks, self.block_size, args.kv_allocation, self.max_model_len
        )

    def _num_kv_blocks(self) -> int:
        spec = self.runner.kv_cache_spec
        bytes_per_block = spec.bytes_per_block
        if self.args.num_gpu_blocks_override is not None:
            num_blocks = self.args.num_gpu_blocks_override
        else:
            num_blocks = self._kv_cache_budget() // bytes_per_block
        # A request's blocks while decoding, and at its peak (a prefill chunk on top of a
        # sliding window): the pool must hold one request at its peak.
        blocks_per_request = spec.max_num_blocks(self.max_model_len)
        peak = spec.max_num_blocks(self.max_model_len, chunk=self.max_num_batched_tokens)
        logger.info(
            "KV cache: %d blocks of %d tokens x %d layers, %.2f GiB (%s); "
            "a %d-token request holds %d blocks (%.1f MiB): maximum concurrency %.2fx",
            num_blocks, self.block_size, spec.group_size, num_blocks * bytes_per_block / 2**30,
            spec.describe(), self.max_model_len, blocks_per_request,
            blocks_per_request * bytes_per_block / 2**20, num_blocks / blocks_per_request,
        )  # fmt: skip
        if num_blocks < peak:
            raise ValueError(
                f"the KV cache has {num_blocks} blocks, less than one request of max_model_len "
                f"{self.max_model_len} needs ({peak}): raise --kv-cache-memory to at least "
                f"{peak * bytes_per_block / 2**20:.0f}MiB or lower --max-model-len"
            )
        return num_blocks

    def _num_swap_blocks(self) -> int:
        """Blocks of swap space: --swap-space GiB, never more than the KV cache itself (a
        preempted group never holds more than the whole pool)."""
        if self.args.preemption_mode != "swap":
            return 0
        bytes_per_block = self.runner.kv_cache_spec.bytes_per_block
        num_blocks = min(int(self.args.swap_space * 2**30) // bytes_per_block, self.num_blocks)
        logger.info(
            "swap space: %d blocks, %.2f GiB of CPU memory (preemption mode: swap)",
            num_blocks, num_blocks * bytes_per_block / 2**30,
        )  # fmt: skip
        if num_blocks == 0:
            logger.warning("swap space is empty: every preemption will recompute")
        return num_blocks

    def _kv_cache_budget(self) -> int:
        explicit = self.config.cache.kv_cache_memory
        if explicit is not None:
            return explicit
        return self._profile_cuda_kv_budget()

    def _profile_cuda_kv_budget(self) -> int:
        """What gpu_memory_utilization x total leaves after the peak of a forward pass over a
        full token budget (weights + activations) and memory held outside torch."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.runner.profile_run(self.max_num_batched_tokens, self.args.max_num_seqs)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        return max(0, int(total * self.args.gpu_memory_utilization) - peak - used_outside_torch)

    # -- requests -----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids instead")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        delta: bool = False,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; `delta=True` makes each output carry only the new text and tokens.
        Requests share prefix-cached blocks only with requests of the same `cache_salt`."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if (
            request_id in self._states
            or request_id in self.scheduler.kv_cache_manager.req_to_blocks
        ):
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.num_sequences > self.args.max_num_seqs:
            raise ValueError(
                f"the request runs {params.num_sequences} sequences (n, best_of or beam width), "
                f"more than max_num_seqs ({self.args.max_num_seqs}): lower it or raise "
                "--max-num-seqs"
            )
        if params.num_sequences > 1 and self.args.kv_allocation != "paged":
            raise ValueError(
                f"--kv-allocation {self.args.kv_allocation} runs one sequence per request: "
                "n, best_of and beam search need paged KV blocks"
            )
        text, token_ids = self.tokenize_prompt(prompt)
        self._validate_prompt(token_ids)
        vocab = self.model_config.vocab_size
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {vocab}")
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self._validate_group(params.num_sequences, len(token_ids) + max_tokens)
        request = Request(
            request_id,
            token_ids,
            params,
            self.eos_token_ids,
            max_tokens,
            text,
            arrival_time,
            cache_salt=cache_salt,
        )
        if params.structured_outputs is not None:
            request.grammar = self._structured_outputs().grammar(params.structured_outputs)
        self._states[request_id] = _RequestState(
            request.group, delta, RequestMetrics(arrival_time=request.arrival_time)
        )
        self.scheduler.add_request(request)
        return request_id

    def _structured_outputs(self) -> StructuredOutputManager:
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and it has none")
        if self._structured_output_manager is None:
            self._structured_output_manager = StructuredOutputManager(
                self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
            )
        return self._structured_output_manager

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt is {len(token_ids)} tokens long, but max_model_len is "
                f"{self.max_model_len}: shorten the prompt (it needs room for at least one "
                "generated token) or raise --max-model-len"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range for a vocabulary of {vocab}")

    def _validate_group(self, num_seqs: int, max_len: int) -> None:
        """Refuse a group the scheduler could never finish (it would loop forever): its
        sequences decode in lockstep, so all must fit one step's token budget; and a preempted
        group is recomputed with nothing shared, so it must fit the pool as num_seqs separate
        sequences (a single sequence always does: checked at start-up)."""
        if num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"the request runs {num_seqs} sequences (n, best_of or beam width), which decode "
                f"together, but max_num_batched_tokens is {self.max_num_batched_tokens}: raise "
                "--max-num-batched-tokens or lower n / best_of"
            )
        spec = self.runner.kv_cache_spec
        need = num_seqs * spec.max_num_blocks(max_len, chunk=self.max_num_batched_tokens)
        if num_seqs > 1 and need > self.num_blocks:
            raise ValueError(
                f"the request runs {num_seqs} sequences of up to {max_len} tokens, which need "
                f"{need} blocks of the KV cache, but it has {self.num_blocks}: lower n / best_of "
                "or max_tokens, or raise --kv-cache-memory"
            )

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for request_id in ids:
            self._states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing done) while requests hold blocks."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting + self.scheduler.num_swapped

    # -- the step loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return an output for every request that advanced
        (requests with best_of > n or beam search only once they finish)."""
        self.check_workers()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.preempted_request_ids:
            self._warn_preemption()
        if scheduler_output.is_empty:
            return []
        now = time.time()
        for seq in scheduler_output.scheduled_requests:
            metrics = self._states[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            start = seq.num_computed_tokens
            end = start + scheduler_output.num_scheduled_tokens[seq.seq_id]
            self.num_prompt_tokens_total += max(0, min(end, seq.num_prompt_tokens) - start)
        runner_output = self.runner.execute_model(scheduler_output)
        self.num_generation_tokens_total += sum(
            len(ids) for ids in runner_output.sampled_token_ids.values()
        ) + len(runner_output.beam_candidates)
        groups = self.scheduler.update_from_output(scheduler_output, runner_output)
        # From here on, work is per request: a failure fails that request only (see _fail).
        failed: dict[str, RequestOutput] = {}
        if runner_output.prompt_logprobs:
            request_ids = {s.seq_id: s.request_id for s in scheduler_output.scheduled_requests}
            for seq_id, records in runner_output.prompt_logprobs.items():
                state = self._states.get(request_ids[seq_id])
                if state is None:
                    continue
                try:
                    for position, record in records:
                        state.prompt_logprobs[position] = self._logprob_dict(record)
                except Exception as e:  # noqa: BLE001 - fails this request only
                    failed[state.group.request_id] = self._fail(state.group, e)

        now = time.time()
        for group in groups:
            state = self._states.get(group.request_id)
            if state is None:
                continue
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
                self.num_first_tokens_total += 1
                self.time_to_first_token_seconds_total += max(0.0, now - group.arrival_time)
            state.metrics.last_token_time = now
            if not group.is_beam_search:
                try:
                    self._process_samples(state)
                except Exception as e:  # noqa: BLE001 - fails this request only
                    failed[group.request_id] = self._fail(group, e)
        outputs = list(failed.values())
        for group in groups:
            state = self._states.get(group.request_id)
            if state is None:
                continue
            try:
                output = self._make_output(state, now)
            except Exception as e:  # noqa: BLE001 - fails this request only
                output = self._fail(group, e)
            if output is not None:
                outputs.append(output)
        return outputs

    def _fail(self, group: SequenceGroup, error: Exception) -> RequestOutput:
        """Stop one request whose output processing raised (detokenizing, stop strings,
        logprobs): its blocks are freed, and its final output carries the error. The batch's
        other requests go on. (A failure in the batched model run or sampler is not tied to one
        request: it propagates, and the async engine stops.)"""
        request_id = group.request_id
        logger.error("request %s failed: %r", request_id, error, exc_info=error)
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        self._states.pop(request_id, None)
        first = group.first
        return RequestOutput(
            request_id=request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[],
            finished=True,
            error=f"request {request_id} failed: {error!r}",
        )

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
            self.args.preemption_mode,
        )  # fmt: skip

    def get_stats(self) -> dict[str, float | int]:
        """Scheduler and KV cache counters (for logs, benchmarks and the metrics endpoint)."""
        scheduler = self.scheduler
        kv = scheduler.kv_cache_manager
        num_cpu = kv.num_cpu_blocks
        return {
            "num_running": scheduler.num_running,
            "num_waiting": scheduler.num_waiting,
            "num_swapped": scheduler.num_swapped,
            "num_preemptions_total": scheduler.num_preemptions_total,
            "num_swap_preemptions_total": scheduler.num_swap_preemptions_total,
            "kv_cache_usage": kv.usage,
            "swap_space_usage": 1 - kv.num_free_cpu_blocks / num_cpu if num_cpu else 0.0,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_prompt_tokens_total": self.num_prompt_tokens_total,
            "num_generation_tokens_total": self.num_generation_tokens_total,
            "num_first_tokens_total": self.num_first_tokens_total,
            "time_to_first_token_seconds_total": self.time_to_first_token_seconds_total,
            "num_copied_blocks": self.runner.num_copied_blocks,
            "num_swapped_out_blocks": self.runner.num_swapped_out_blocks,
            "num_swapped_in_blocks": self.runner.num_swapped_in_blocks,
        }

    def kv_snapshot(self, check: bool = False) -> dict:
        """The KV cache block by block, the requests' block tables and the counters (see
        engine/kv_snapshot.py); `check` adds the integrity check's verdict."""
        return kv_snapshot(self, check)

    def _process_samples(self, state: _RequestState) -> None:
        """Detokenize each sequence's new tokens; a matched stop string ends that sequence."""
        group = state.group
        for seq in [*group.seqs, *group.finished_seqs]:
            if seq.sampling_params.logprobs is not None:
                self._convert_logprobs(state, seq)
            if self.tokenizer is None:
                continue
            detokenizer = state.detokenizers.get(seq.seq_id)
            if detokenizer is None:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer.backend, seq.prompt_token_ids, seq.sampling_params
                )
                state.detokenizers[seq.seq_id] = detokenizer
            if seq.grammar is not None and seq.grammar.error is not None:
                raise RuntimeError(f"the structured output grammar failed: {seq.grammar.error}")
            new_token_ids = seq.output_token_ids[detokenizer.num_tokens :]
            if not new_token_ids:
                continue
            # An EOS or stop token that ended the sequence is not part of the text (a token that
            # completed a structured output, also a stop, is).
            by_token = seq.status == RequestStatus.FINISHED_STOPPED and (
                seq.stop_reason is not None or seq.output_token_ids[-1] in seq.eos_token_ids
            )
            stop = detokenizer.update(new_token_ids, stop_terminated=by_token)
            if stop is not None and not seq.is_finished():
                seq.stop_reason = stop
                self.scheduler.finish_seq(seq, RequestStatus.FINISHED_STOPPED)

    def _convert_logprobs(self, state: _RequestState, seq: Request) -> list[dict[int, Logprob]]:
        converted = state.logprobs.setdefault(seq.seq_id, [])
        for record in seq.output_logprobs[len(converted) :]:
            converted.append(self._logprob_dict(record))
        return converted

    def _logprob_dict(self, record) -> dict[int, Logprob]:
        decode = self._decode_token
        entry = {record.token_id: Logprob(record.logprob, record.rank, decode(record.token_id))}
        for rank, (token_id, logprob) in enumerate(record.top, start=1):
            entry.setdefault(token_id, Logprob(logprob, rank, decode(token_id)))
        return entry

    def _decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _make_output(self, state: _RequestState, now: float) -> RequestOutput | None:
        group = state.group
        params = group.sampling_params
        finished = group.is_finished()
        if finished:
            state.metrics.finished_time = now
            del self._states[group.request_id]
        if group.is_beam_search:
            if not finished:
                return None
            completions = self._beam_outputs(group)
        elif params.num_sequences > params.n:
            if not finished:
                return None  # the best n are known only at the end
            ranked = sorted(group.finished_seqs, key=lambda s: -s.cumulative_logprob)[: params.n]
            completions = [self._completion(state, s, i, True) for i, s in enumerate(ranked)]
        else:
            seqs = sorted([*group.seqs, *group.finished_seqs], key=lambda s: s.sample_index)
            if state.delta:  # only the sequences that advanced since the last output
                seqs = [s for s in seqs if s.num_output_tokens > state.num_sent.get(s.seq_id, 0)]
            completions = [self._completion(state, s, s.sample_index, finished) for s in seqs]
        first = group.first
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            # vLLM's shape: None for the first prompt token, then one dict per prompt token.
            positions = range(1, first.num_prompt_tokens)
            prompt_logprobs = [None, *(state.prompt_logprobs.get(p) for p in positions)]
        return RequestOutput(
            request_id=group.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=state.metrics,
            prompt_logprobs=prompt_logprobs,
        )

    def _completion(
        self, state: _RequestState, seq: Request, index: int, finished: bool
    ) -> CompletionOutput:
        params = seq.sampling_params
        detokenizer = state.detokenizers.get(seq.seq_id)
        text = ""
        if detokenizer is not None:
            text = detokenizer.get_next_output_text(finished or seq.is_finished(), state.delta)
        token_ids = seq.output_token_ids
        logprobs = state.logprobs.get(seq.seq_id) if params.logprobs is not None else None
        if state.delta:
            sent = state.num_sent.get(seq.seq_id, 0)
            token_ids = token_ids[sent:]
            logprobs = logprobs[sent:] if logprobs is not None else None
        else:
            token_ids = list(token_ids)
        state.num_sent[seq.seq_id] = seq.num_output_tokens
        ranked = params.logprobs is not None or params.num_sequences > params.n
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=seq.cumulative_logprob if ranked else None,
            logprobs=logprobs,
            finish_reason=seq.status.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _beam_outputs(self, group: SequenceGroup) -> list[CompletionOutput]:
        """The n best finished hypotheses, best first."""
        params = group.sampling_params
        completions = []
        for i, hyp in enumerate(group.beam.finished[: params.n]):
            token_ids = hyp.output_token_ids
            text_ids = token_ids
            if hyp.finish_reason == "stop" and not params.include_stop_str_in_output:
                text_ids = token_ids[:-1]
            text = ""
            if self.tokenizer is not None:
                text = self.tokenizer.decode(
                    text_ids, skip_special_tokens=params.skip_special_tokens
                )
            logprobs = None
            if params.logprobs is not None:
                logprobs = [self._logprob_dict(r) for r in hyp.logprobs]
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(token_ids),
                    cumulative_logprob=hyp.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=hyp.finish_reason,
                    stop_reason=hyp.stop_reason,
                )
            )
        return completions
