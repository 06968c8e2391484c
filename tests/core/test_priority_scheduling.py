"""--scheduling-policy priority (fake model, no torch): requests run by priority, lower values
first, in arrival order within a level (so a stream of equal-priority requests never starves an
earlier one); preemption takes the lowest priority first; FCFS is unchanged."""

from __future__ import annotations

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from tests.core.test_scheduler import make_request, step


def _scheduler(policy="priority", num_blocks=256, max_num_seqs=1, budget=64):
    kv = KVCacheManager(num_blocks, 4)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 256, policy=policy), kv)


def _add(s, priority, prompt_len=6, max_tokens=3):
    r = make_request(prompt_len, max_tokens)
    r.request.priority = priority
    s.add_request(r)
    return r


def _finish_order(s) -> list[str]:
    order = []
    while s.has_unfinished_requests():
        order += [r.request_id for r in step(s)[1]]
    return order


def test_lower_priority_values_first_arrival_within_a_level():
    s = _scheduler()
    reqs = [_add(s, p) for p in (5, 1, 3, 1, 5)]
    ids = [r.request_id for r in reqs]
    assert _finish_order(s) == [ids[1], ids[3], ids[2], ids[0], ids[4]]


def test_fcfs_ignores_priorities():
    s = _scheduler(policy="fcfs")
    reqs = [_add(s, p) for p in (5, 1, 3)]
    assert _finish_order(s) == [r.request_id for r in reqs]


def test_equal_priorities_never_starve_an_earlier_request():
    """A new request of the same priority arrives every step; the queue's head still runs
    next, each in its turn."""
    s = _scheduler(max_num_seqs=2)
    first = [_add(s, 2) for _ in range(4)]
    finished = []
    for _ in range(60):
        _add(s, 2)
        finished += [r.request_id for r in step(s)[1]]
    assert finished[:4] == [r.request_id for r in first]


def test_preemption_takes_the_lowest_priority_first():
    """Two long requests on a pool that holds one: the low-priority one arrived first and is
    running when the urgent one comes; when blocks run out, the low-priority one goes."""
    s = _scheduler(num_blocks=12, max_num_seqs=2)
    low = _add(s, 9, prompt_len=8, max_tokens=30)
    step(s)
    urgent = _add(s, 0, prompt_len=8, max_tokens=30)
    preempted = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        preempted += out.preempted_request_ids
    assert preempted and set(preempted) == {low.request_id}
    assert urgent.num_output_tokens == 30 and low.num_output_tokens == 30
