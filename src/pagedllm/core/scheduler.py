"""Continuous batching under a per-step token budget, FCFS, preemption by recompute. Torch-free.

The unit of scheduling is a sequence group (one user request: a single sequence, n / best_of
samples or beam_width beams; see sequence.py). Each step every running group's sequences get the
tokens they still lack (`num_tokens - num_computed_tokens`: a whole or partial prompt, or one
decode token), then waiting groups are admitted in arrival order while the token budget,
`max_num_seqs` (counted in sequences) and free blocks allow. When the pool runs dry, the most
recently arrived running group is preempted as a whole (gang scheduling): the blocks of all its
sequences are freed and it goes back to the head of the queue, to be recomputed (prompt + output
re-prefilled) and resumed as a whole later. With prefix caching, a waiting sequence starts at its
longest cached prefix of full blocks, so a resumed group re-prefills only what was evicted
meanwhile, and its sequences share their common prompt blocks again. A hybrid model's hits end
at a checkpoint of its recurrent state, taken where a prompt's chunk is made to end
(core/state_checkpoints.py, core/token_plan.py).

With LoRA a step runs at most max_loras adapters; new requests are admitted FCFS within what
fits (core/lora_admission.py), preempted groups strictly in order.

Preemption mode "swap" moves the victim's blocks to a CPU swap space instead (falling back to
recompute when the swap space, or a hybrid model's state stash, is full). Preempted groups
resume in arrival order, whether swapped out or waiting to be recomputed, before any new
request; no new request is admitted while any group is swapped out.

A group's sequences advance in lockstep: the step that samples one of them samples all, since
beam search compares every beam's candidates and a sampling group forks on its first token.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable

from pagedllm.config import SchedulerConfig
from pagedllm.core.beam_search import BeamSearchState, step_beams
from pagedllm.core.kv_cache_interface import BlockPair, KVCacheInterface
from pagedllm.core.lora_admission import LoRAAdmission
from pagedllm.core.scheduler_checks import check_scheduler
from pagedllm.core.scheduler_output import SchedulerOutput, SpecDecodeStats
from pagedllm.core.state_checkpoints import hand_over_state_moves
from pagedllm.core.token_plan import plan_tokens
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus


def _by_arrival(group: SequenceGroup) -> float:
    return group.arrival_time


def _by_priority(group: SequenceGroup) -> tuple[int, float]:
    return group.priority, group.arrival_time


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheInterface) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []  # in arrival order
        self.swapped: list[SequenceGroup] = []  # in arrival order
        self.requests: dict[str, SequenceGroup] = {}
        self._finished_since_last_step: set[str] = set()
        self.num_preemptions_total = 0
        self.num_swap_preemptions_total = 0
        self._num_running_seqs = 0
        self.spec_decode_stats = SpecDecodeStats()
        self.lora_admission = LoRAAdmission(config.max_loras)
        # The order of every queue: arrival, or (priority, arrival) under the priority policy.
        self.order = _by_priority if config.policy == "priority" else _by_arrival

    # -- queue management ---------------------------------------------------------------------
    def add_request(self, request: Sequence) -> None:
        """Queue a new request (its first sequence; `request.group` is the group)."""
        group = request.group
        if group.is_beam_search and group.beam is None:
            group.beam = BeamSearchState.for_request(request, self.config.max_model_len)
        self._queue(group)
        self.requests[group.request_id] = group

    def finish_requests(
        self, request_ids: Iterable[str], status: SequenceStatus
    ) -> list[SequenceGroup]:
        """Stop whole requests (abort) wherever they are; frees their blocks at once."""
        assert status.is_finished
        finished = []
        for request_id in request_ids:
            group = self.requests.get(request_id)
            if group is None:
                continue
            if group in self.running:
                self.running.remove(group)
                self._num_running_seqs -= len(group.seqs)
            elif group in self.swapped:
                self.swapped.remove(group)
            else:
                self.waiting.remove(group)
            for seq in list(group.seqs):
                self._finish_seq(seq, status)
            self._remove(group)
            finished.append(group)
        return finished

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """Stop one sequence (a stop string matched); its group ends with its last sequence."""
        group = seq.group
        if seq.is_finished() or group.request_id not in self.requests:
            return
        running = group in self.running
        self._finish_seq(seq, status)
        if running:
            self._num_running_seqs -= 1
        if group.is_finished():
            if running:
                self.running.remove(group)
            else:
                self.waiting.remove(group)
            self._remove(group)

    def _finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        self.kv_cache_manager.free(seq)
        seq.group.seqs.remove(seq)
        seq.group.finished_seqs.append(seq)

    def _remove(self, group: SequenceGroup) -> None:
        del self.requests[group.request_id]
        self.lora_admission.forget(group.request_id)
        self._finished_since_last_step.add(group.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running(self) -> int:
        """Running requests (sequence groups)."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        """Requests whose blocks are in the swap space now."""
        return len(self.swapped)

    @property
    def num_running_seqs(self) -> int:
        return self._num_running_seqs

    def running_seqs_by_id(self) -> dict[str, Sequence]:
        return {seq.seq_id: seq for group in self.running for seq in group.seqs}

    def is_id_in_use(self, request_id: str) -> bool:
        """Whether a new request may not be named `request_id`: an unfinished request is, or a
        live sequence (a fork is named "<request id>#<k>", see SequenceGroup.new_seq_id)."""
        if request_id in self.requests or request_id in self.kv_cache_manager.req_to_blocks:
            return True
        group = self.requests.get(request_id.rpartition("#")[0])
        return group is not None and any(seq.seq_id == request_id for seq in group.seqs)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        # Filled in as the step is planned, the block moves as the KV cache calls return them.
        out = SchedulerOutput([], {}, {}, 0)
        preempted: list[SequenceGroup] = []

        # Running groups first, in arrival order; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            group = self.running[i]
            plan = self._plan_tokens(group.seqs, budget)
            if not plan:
                i += 1
                continue
            if not self._allocate_or_preempt(group, plan, preempted, out):
                break  # the group itself was preempted: nothing later can fit either
            budget -= self._add_to_step(out, plan)
            i += 1

        # max_num_seqs counts sequences, including those a group will fork into.
        num_seqs = sum(g.max_num_running_seqs for g in self.running)
        self.lora_admission.start_step(self.running)

        # Then preempted groups, strictly in arrival order whichever way they were preempted
        # (swapped out, or waiting at the head of `waiting` to be recomputed), then new ones,
        # FCFS: nothing new while any group is swapped out, nothing at all in a step that had
        # to preempt.
        while not preempted and (self.swapped or self.waiting) and budget > 0:
            group, swapped = self._next_to_resume()
            if group is None:
                break
            if num_seqs + group.max_num_running_seqs > self.config.max_num_seqs:
                break
            plan = self._swap_in(group, budget, out) if swapped else self._admit(group, budget, out)
            if plan is None:
                break
            num_seqs += group.max_num_running_seqs
            budget -= self._add_to_step(out, plan)
            self.lora_admission.admitted(group)

        out.block_ids = {
            r.seq_id: self.kv_cache_manager.get_group_block_ids(r.seq_id)
            for r in out.scheduled_requests
        }
        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        out.preempted_request_ids = [g.request_id for g in preempted]
        out.swapped_out_seqs = [q.seq_id for g in preempted if g in self.swapped for q in g.seqs]
        out.finished_request_ids = set(self._finished_since_last_step)
        if not out.is_empty:  # an empty step never reaches the runner: they go with the next
            self._finished_since_last_step.clear()
        hand_over_state_moves(self.kv_cache_manager, out)  # last: checkpoints follow the plan
        return out

    @staticmethod
    def _add_to_step(out: SchedulerOutput, plan: list[tuple[Sequence, int]]) -> int:
        """Schedule the planned tokens; returns how many."""
        total = 0
        for seq, num_new in plan:
            out.scheduled_requests.append(seq)
            out.num_scheduled_tokens[seq.seq_id] = num_new
            if seq.spec_token_ids:  # verified by this step, replaced by its output's
                out.spec_token_ids[seq.seq_id] = seq.spec_token_ids
                seq.spec_token_ids = []
            total += num_new
        return total

    def _allocate(self, plan: list[tuple[Sequence, int]], out: SchedulerOutput) -> None:
        """Allocate for planned sequences whose room the caller counted; their copies join the
        step. (Once per scheduled sequence every step: kept lean.)"""
        allocate_slots = self.kv_cache_manager.allocate_slots
        for seq, num_new in plan:
            allocation = allocate_slots(seq, num_new)
            assert allocation is not None, "the room was counted"
            if allocation.blocks_to_copy:
                out.blocks_to_copy.extend(allocation.blocks_to_copy)

    def _plan_tokens(
        self, seqs: list[Sequence], budget: int, num_computed: list[int] | None = None
    ) -> list[tuple[Sequence, int]]:
        """Tokens for each sequence of a group within `budget`, from `num_computed` (default:
        their own) on: core/token_plan.py."""
        if num_computed is None:
            num_computed = [s.num_computed_tokens for s in seqs]
        checkpoints = getattr(self.kv_cache_manager, "state_checkpoints", None)
        chunked = self.config.enable_chunked_prefill
        return plan_tokens(seqs, budget, num_computed, chunked, checkpoints)

    def _start_running(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            seq.status = SequenceStatus.RUNNING
        self._num_running_seqs += len(group.seqs)
        # Keep `running` in arrival order, so a resumed group is not the next victim.
        bisect.insort(self.running, group, key=self.order)

    def _next_to_resume(self) -> tuple[SequenceGroup | None, bool]:
        """The next group to bring in, and whether it is swapped out: the earliest-arrived of the
        preempted groups (swapped, or preempted for recompute), else the first new one whose
        LoRA adapter fits; None when none may come in.

        Victims are always the latest-arrived running groups, so every preempted group arrived
        after every running one; resuming them in arrival order keeps it that way (and keeps
        the recompute victims at the head of `waiting` in arrival order). Resuming swapped
        groups first instead would let a swapped group overtake an earlier one that fell back
        to recompute, and, preempted again, be queued ahead of it."""
        group, swapped = self._next_preempted()
        if group is not None:
            return (group, swapped) if self.lora_admission.fits(group) else (None, False)
        return self.lora_admission.first_fitting(self.waiting), False

    def _next_preempted(self) -> tuple[SequenceGroup | None, bool]:
        head = self.waiting[0] if self.waiting else None
        if not self.swapped:
            return (head, False) if head is not None and head.num_preemptions else (None, False)
        if head is not None and head.num_preemptions:  # preempted for recompute
            if self.order(head) < self.order(self.swapped[0]):
                return head, False
        return self.swapped[0], True

    def _swap_in(
        self, group: SequenceGroup, budget: int, out: SchedulerOutput
    ) -> list[tuple[Sequence, int]] | None:
        """Bring a swapped group back and allocate its next tokens, or None if it does not fit.
        Counted exactly (the blocks it held, then its new blocks and copies), so that a group
        holding most of the pool can still come back once the pool is free."""
        kv = self.kv_cache_manager
        plan = self._plan_tokens(group.seqs, budget)
        if not plan:
            return None
        need = kv.num_swap_in_blocks(group.seqs) + kv.num_blocks_needed(plan, swapped=True)
        if need > kv.num_free_blocks:
            return None
        self.swapped.pop(0)
        out.blocks_to_swap_in += kv.swap_in(group.seqs)
        out.swapped_in_seqs += [seq.seq_id for seq in group.seqs]
        self._start_running(group)
        self._allocate(plan, out)
        return plan

    def _admit(
        self, group: SequenceGroup, budget: int, out: SchedulerOutput
    ) -> list[tuple[Sequence, int]] | None:
        """Allocate the first waiting group's sequences (a new request, or a preempted group to
        recompute), all or none, and start it running; returns the tokens to schedule, or None
        if it does not fit.

        Prefix caching: leading blocks already cached (by anyone, or by this group before it was
        preempted) are taken as computed; the budget only pays for the rest.
        """
        kv = self.kv_cache_manager
        hits = [kv.get_computed_blocks(seq) for seq in group.seqs]
        num_hit = [n for _, n in hits]
        plan = {seq.seq_id: n for seq, n in self._plan_tokens(group.seqs, budget, num_hit)}
        if not plan:
            return None
        entries = [
            (seq, plan.get(seq.seq_id, 0), blocks)
            for seq, (blocks, _) in zip(group.seqs, hits, strict=True)
        ]
        allocations = kv.allocate_group(entries)
        if allocations is None:
            return None
        for allocation in allocations:
            out.blocks_to_copy += allocation.blocks_to_copy
        for seq, (_, num_hit) in zip(group.seqs, hits, strict=True):
            seq.num_computed_tokens = num_hit
        self.waiting.remove(group)
        self._start_running(group)
        return [(seq, plan[seq.seq_id]) for seq in group.seqs if seq.seq_id in plan]

    def _allocate_or_preempt(
        self,
        group: SequenceGroup,
        plan: list[tuple[Sequence, int]],
        preempted: list[SequenceGroup],
        out: SchedulerOutput,
    ) -> bool:
        """Allocate for every planned sequence of a running group, preempting the latest-arrived
        running groups until it fits; False if the group itself had to go."""
        kv = self.kv_cache_manager
        while kv.num_blocks_needed(plan) > kv.num_free_blocks:
            victim = self.running.pop()
            out.blocks_to_swap_out += self._preempt(victim)
            preempted.append(victim)
            if victim is group:
                return False
        self._allocate(plan, out)
        return True

    def _preempt(self, group: SequenceGroup) -> list[BlockPair]:
        """Swap the group's blocks out (mode "swap", if the swap space has room), or drop them
        to recompute prompt + output later (mode "recompute", and the fallback); either way the
        whole group goes. Returns the (device, cpu) pairs to copy, if swapped."""
        kv = self.kv_cache_manager
        self._num_running_seqs -= len(group.seqs)
        group.num_preemptions += 1
        self.num_preemptions_total += 1
        for seq in group.seqs:
            seq.num_preemptions += 1
            seq.spec_token_ids = []
        stash = self.config.max_stashed_seqs  # the runner's stash of hybrid models' states
        room = stash is None or sum(len(g.seqs) for g in self.swapped) + len(group.seqs) <= stash
        if self.config.preemption_mode == "swap" and room and kv.can_swap_out(group.seqs):
            pairs = kv.swap_out(group.seqs)
            for seq in group.seqs:
                seq.status = SequenceStatus.SWAPPED
            self.num_swap_preemptions_total += 1
            bisect.insort(self.swapped, group, key=self.order)
            return pairs
        for seq in group.seqs:
            kv.free(seq)
            seq.status = SequenceStatus.PREEMPTED
            seq.num_computed_tokens = 0
        if self.order is _by_arrival:
            self.waiting.appendleft(group)  # it arrived before every new request
        else:
            self._queue(group)
        return []

    def _queue(self, group: SequenceGroup) -> None:
        """Into `waiting` in the policy's order (FCFS: at the back)."""
        if self.order is _by_arrival:
            self.waiting.append(group)
        else:  # after the groups of its key
            bisect.insort(self.waiting, group, key=self.order)

    # -- after the step -------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput
    ) -> list[SequenceGroup]:
        """Advance num_computed_tokens, append sampled tokens (forking a sampling group on its
        first token, stepping beam search), finish sequences that stop. Returns the groups that
        got tokens, in step order."""
        groups: dict[str, SequenceGroup] = {}
        pooled = []
        for seq in scheduler_output.scheduled_requests:
            if seq.is_finished():  # aborted while the step ran
                continue
            num_new = scheduler_output.num_scheduled_tokens[seq.seq_id]
            drafts = scheduler_output.spec_token_ids.get(seq.seq_id)
            if drafts:
                # The accepted drafts' K/V stay; the rejected ones' slots are given back.
                num_accepted = len(output.sampled_token_ids[seq.seq_id]) - 1
                self.spec_decode_stats.observe(len(drafts), num_accepted)
                num_new -= len(drafts) - num_accepted
                self.kv_cache_manager.trim(seq, seq.num_computed_tokens + num_new)
            seq.num_computed_tokens += num_new
            if seq.seq_id in output.pooled:  # an embedding request: done with its prompt
                seq.pooled = output.pooled[seq.seq_id]
                pooled.append(seq)
                groups.setdefault(seq.group.request_id, seq.group)
            elif seq.seq_id in output.sampled_token_ids or seq.seq_id in output.beam_candidates:
                groups.setdefault(seq.group.request_id, seq.group)
        for group in groups.values():
            if group.is_beam_search:
                self._step_beam_search(group, output)
            else:
                self._append_samples(group, output)
        for seq in pooled:
            self.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)
        return list(groups.values())

    def _append_samples(self, group: SequenceGroup, output: ModelRunnerOutput) -> None:
        """A sequence's tokens: its next one, several when it verified drafts (the accepted
        ones and the token after them, up to the first that stops it), or, on a group's first
        token, one per sample, each to its own fork."""
        kv = self.kv_cache_manager
        stopped = []
        for seq in list(group.seqs):
            token_ids = output.sampled_token_ids.get(seq.seq_id)
            if token_ids is None:
                continue
            records = output.logprobs.get(seq.seq_id) or [None] * len(token_ids)
            if seq.num_samples > 1:  # fork the other samples off the prompt's blocks
                targets = [seq]
                for index in range(1, len(token_ids)):
                    child = seq.fork(group.new_seq_id(kv.req_to_blocks), index)
                    kv.fork(seq, child)
                    targets.append(child)
                self._num_running_seqs += len(targets) - 1
                for target, token_id, record in zip(targets, token_ids, records, strict=True):
                    self._append_token(target, token_id, record)
                    status = target.check_stop(token_id, self.config.max_model_len)
                    if status is not None:
                        stopped.append((target, status))
                continue
            for token_id, record in zip(token_ids, records, strict=True):
                self._append_token(seq, token_id, record)
                status = seq.check_stop(token_id, self.config.max_model_len)
                if status is not None:
                    stopped.append((seq, status))
                    break
            else:
                drafts = output.spec_token_ids.get(seq.seq_id)
                seq.spec_token_ids = seq.usable_drafts(drafts, self.config.max_model_len)
        for seq, status in stopped:
            self.finish_seq(seq, status)

    @staticmethod
    def _append_token(seq: Sequence, token_id: int, record) -> None:
        seq.append_output_token(token_id)
        if record is not None:
            # Kept even without logprobs asked for: truncate_output takes their sum back.
            seq.cumulative_logprob += record.logprob
            seq.output_logprobs.append(record)

    def _step_beam_search(self, group: SequenceGroup, output: ModelRunnerOutput) -> None:
        kv = self.kv_cache_manager
        self._num_running_seqs += step_beams(group, output.beam_candidates, kv)
        if group.beam.done:
            for beam in group.seqs:
                kv.free(beam)
                beam.status = SequenceStatus.FINISHED_STOPPED
            self._num_running_seqs -= len(group.seqs)
            group.seqs.clear()
            self.running.remove(group)
            self._remove(group)

    def check_integrity(self) -> None:
        """The pools agree with the block tables and the queues with the groups
        (core/scheduler_checks.py)."""
        check_scheduler(self)
