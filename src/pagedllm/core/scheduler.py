"""Continuous batching under a per-step token budget, FCFS, preemption by recompute. Torch-free.

Each step every running request gets the tokens it still lacks (`num_tokens -
num_computed_tokens`: a whole or partial prompt, or one decode token), then waiting requests are
admitted in arrival order while the token budget, `max_num_seqs` and free blocks allow. When the
pool runs dry, the most recently arrived running request is preempted: its blocks are freed and it
goes back to the head of the queue to be recomputed (prompt + output re-prefilled) later.
With prefix caching, a waiting request starts at its longest cached prefix of full blocks, so a
resumed request re-prefills only what was evicted meanwhile.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True


@dataclass
class SchedulerOutput:
    """What the model runner needs for one step; the scheduler never touches tensors."""

    scheduled_requests: list[Request]
    num_scheduled_tokens: dict[str, int]
    block_ids: dict[str, list[int]]
    total_num_scheduled_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that left since the previous step, so the runner can drop their state.
    finished_request_ids: set[str] = field(default_factory=set)

    def needs_sample(self, request: Request) -> bool:
        """True when this step reaches the end of the request's known tokens."""
        n = self.num_scheduled_tokens[request.request_id]
        return request.num_computed_tokens + n == request.num_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: set[str] = set()
        self.num_preemptions_total = 0

    # -- queue management ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Stop requests (stop string hit, abort) wherever they are; frees their blocks at once."""
        assert status.is_finished
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            finished.append(request)
        return finished

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_since_last_step.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.config.max_num_batched_tokens
        scheduled: list[Request] = []
        num_scheduled: dict[str, int] = {}
        preempted: list[Request] = []

        # Running requests first, in arrival order; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                i += 1
                continue
            if not self._allocate_or_preempt(request, num_new, preempted):
                break  # the request itself was preempted: nothing later can fit either
            scheduled.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            i += 1

        # Then waiting requests, strictly FCFS (preempted ones sit at the head). Nothing new is
        # admitted in a step that had to preempt.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            # Prefix caching: leading blocks already cached (by anyone, or by this request before
            # it was preempted) are taken as computed; the budget only pays for the rest.
            computed_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_new = self._num_new_tokens(request, budget, num_hit_tokens)
            if num_new == 0 or not kv.allocate_slots(request, num_new, computed_blocks):
                break
            request.num_computed_tokens = num_hit_tokens
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            # Keep `running` in arrival order, so a resumed request is not the next victim.
            bisect.insort(self.running, request, key=lambda r: r.arrival_time)
            scheduled.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new

        finished, self._finished_since_last_step = self._finished_since_last_step, set()
        return SchedulerOutput(
            scheduled_requests=scheduled,
            num_scheduled_tokens=num_scheduled,
            block_ids={r.request_id: kv.get_block_ids(r.request_id) for r in scheduled},
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            preempted_request_ids=[r.request_id for r in preempted],
            finished_request_ids=finished,
        )

    def _num_new_tokens(
        self, request: Request, budget: int, num_computed: int | None = None
    ) -> int:
        if num_computed is None:
            num_computed = request.num_computed_tokens
        num_new = request.num_tokens - num_computed
        if num_new > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(num_new, budget)

    def _allocate_or_preempt(
        self, request: Request, num_new: int, preempted: list[Request]
    ) -> bool:
        """Allocate, preempting the latest-arrived running requests until it fits."""
        while not self.kv_cache_manager.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Recompute mode: drop the KV cache; the request re-prefills prompt + output later."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Advance num_computed_tokens, append sampled tokens, finish requests that stop."""
        finished = []
        for request in scheduler_output.scheduled_requests:
            if request.is_finished():  # aborted while the step ran
                continue
            request.num_computed_tokens += scheduler_output.num_scheduled_tokens[request.request_id]
            token_id = sampled_token_ids.get(request.request_id)
            if token_id is None:
                continue
            request.append_output_token(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                self.running.remove(request)
                request.status = status
                self._free(request)
                finished.append(request)
        return finished

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.max_tokens is not None and request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def check_integrity(self) -> None:
        self.kv_cache_manager.check_integrity()
        held = set(self.kv_cache_manager.req_to_blocks)
        running = {r.request_id for r in self.running}
        assert held <= running | {r.request_id for r in self.waiting}, (
            "finished request holds blocks"
        )
        for request in self.waiting:
            if request.status == RequestStatus.PREEMPTED:
                assert request.request_id not in held, "preempted request still holds blocks"
