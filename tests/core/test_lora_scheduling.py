"""The scheduler with LoRA slots (fake model, no torch): no step runs more than max_loras
adapters; requests whose adapter does not fit wait while later ones that fit are admitted; a
request passed over long enough blocks admission until its adapter fits, so a stream of requests
for busy adapters cannot starve it; preempted groups resume in order; every request finishes."""

from __future__ import annotations

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.lora_admission import LORA_MAX_SKIPPED_STEPS
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.lora_request import LoRARequest
from tests.core.test_scheduler import make_request, step


def _scheduler(max_loras=2, num_blocks=256, max_num_seqs=16):
    kv = KVCacheManager(num_blocks, 4)
    return Scheduler(SchedulerConfig(max_num_seqs, 64, 256, max_loras=max_loras), kv)


def _add(scheduler, lora: int | None, max_tokens=4, prompt_len=6):
    r = make_request(prompt_len, max_tokens)
    r.request.lora_request = None if lora is None else LoRARequest(f"l{lora}", lora, f"/p{lora}")
    scheduler.add_request(r)
    return r


def _loras(out) -> set[int]:
    return {r.lora_request.lora_int_id for r in out.scheduled_requests if r.lora_request}


def test_at_most_max_loras_per_step_and_fitting_requests_pass():
    s = _scheduler(max_loras=2)
    order = [1, 2, 3, None, 1, 2, 3, None]
    reqs = [_add(s, lora) for lora in order]
    out, _ = step(s)
    # 1 and 2 take the slots; 3 waits; base and more 1s / 2s pass it.
    assert _loras(out) == {1, 2}
    admitted = {r.request_id for r in out.scheduled_requests}
    assert admitted == {r.request_id for r, lora in zip(reqs, order, strict=True) if lora != 3}
    finished = set()
    while s.has_unfinished_requests():
        out, done = step(s)
        assert len(_loras(out)) <= 2
        finished |= {r.request_id for r in done}
    assert finished | admitted >= {r.request_id for r in reqs}


def test_a_passed_over_request_blocks_admission_after_a_while():
    """Adapters 1 and 2 get a new request every step forever; adapter 3's request must still
    run: after LORA_MAX_SKIPPED_STEPS nothing new is admitted, 1 and 2 drain, 3 gets a slot."""
    s = _scheduler(max_loras=2, num_blocks=1024, max_num_seqs=64)
    _add(s, 1, max_tokens=8)
    _add(s, 2, max_tokens=8)
    starving = _add(s, 3, max_tokens=2)
    for i in range(4 * LORA_MAX_SKIPPED_STEPS):
        _add(s, 1 + i % 2, max_tokens=8)
        out, _ = step(s)
        assert len(_loras(out)) <= 2
        if starving.num_output_tokens:
            break
    else:
        raise AssertionError("adapter 3's request never ran")
    assert i >= LORA_MAX_SKIPPED_STEPS  # it did wait while others could pass


def test_preempted_groups_with_adapters_resume_and_finish():
    """A pool that preemption must juggle, four adapters over two slots, every request ends."""
    s = _scheduler(max_loras=2, num_blocks=24)
    reqs = [_add(s, 1 + i % 4, max_tokens=20, prompt_len=10) for i in range(12)]
    steps = 0
    while s.has_unfinished_requests():
        out, _ = step(s)
        assert len(_loras(out)) <= 2
        steps += 1
        assert steps < 2000
    assert s.num_preemptions_total > 0
    assert all(r.num_output_tokens == 20 for r in reqs)


def test_without_lora_slots_it_is_plain_fcfs():
    s = _scheduler(max_loras=0)
    reqs = [_add(s, lora) for lora in (1, 2, 3, 4)]
    out, _ = step(s)
    assert [r.request_id for r in out.scheduled_requests] == [r.request_id for r in reqs]
