"""Block pool, block tables and the scheduler, driven by a fake model (no torch)."""

import itertools

import pytest

from pagedllm.core.block_pool import BlockPool, NoFreeBlocksError
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceStatus

_ids = itertools.count()


def make_request(prompt_len: int, max_tokens: int, arrival: float | None = None) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    n = next(_ids)
    # Distinct prompts, so that prefix caching (on by default) shares nothing between requests.
    return Sequence.of(
        f"r{n}",
        [1000 * (n + 1) + i for i in range(prompt_len)],
        params,
        eos_token_ids=[0],
        arrival_time=arrival,
    )


def make_scheduler(
    num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=64, prefix_caching=True
):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    config = SchedulerConfig(max_num_seqs, budget, max_model_len)
    return Scheduler(config, kv)


def step(scheduler: Scheduler, token: int = 7):
    """One engine step with a fake model that always samples `token`."""
    out = scheduler.schedule()
    for r in out.scheduled_requests:
        # Block table covers every token computed after this step.
        n = r.num_computed_tokens + out.num_scheduled_tokens[r.request_id]
        assert len(out.block_ids[r.request_id][0]) * scheduler.kv_cache_manager.block_size >= n
    sampled = {r.seq_id: [token] for r in out.scheduled_requests if out.needs_sample(r)}
    groups = scheduler.update_from_output(out, ModelRunnerOutput(sampled))
    finished = [g.first for g in groups if g.is_finished()]
    scheduler.check_integrity()
    return out, finished


def run_to_completion(scheduler: Scheduler, max_steps: int = 1000):
    finished = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return finished
        finished += step(scheduler)[1]
    raise AssertionError("did not finish")


def test_block_pool_allocate_free_integrity():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free_blocks == 1
    pool.check_integrity([a])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    pool.free(a[:1])
    assert pool.num_free_blocks == 2
    pool.check_integrity([a[1:]])
    with pytest.raises(AssertionError):
        pool.check_integrity([a])  # a[0] is free, so a table holding it is inconsistent
    pool.free(a[1:])
    pool.check_integrity([])
    with pytest.raises(AssertionError):
        pool.free(a[:1])  # double free


def test_kv_cache_manager_grows_on_block_boundaries_and_frees():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = make_request(5, 10)
    assert kv.allocate_slots(r, 5)
    assert len(kv.get_block_ids(r.request_id)) == 2
    r.num_computed_tokens = 5
    for computed, expected_blocks in [(5, 2), (6, 2), (7, 2), (8, 3)]:
        r.num_computed_tokens = computed
        assert kv.allocate_slots(r, 1)
        assert len(kv.get_block_ids(r.request_id)) == expected_blocks
    kv.check_integrity()
    other = make_request(30, 1)
    assert not kv.allocate_slots(other, 30)  # needs 8 blocks, 5 free: nothing allocated
    assert kv.num_free_blocks == 5
    kv.free(r)
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_all_requests_finish_with_exact_lengths_and_every_block_returned():
    s = make_scheduler()
    reqs = [make_request(p, m) for p, m in [(3, 5), (10, 1), (17, 9), (1, 12)]]
    for r in reqs:
        s.add_request(r)
    finished = run_to_completion(s)
    assert {r.request_id for r in finished} == {r.request_id for r in reqs}
    for r in reqs:
        assert r.num_output_tokens == r.max_tokens
        assert r.status == SequenceStatus.FINISHED_LENGTH_CAPPED
    assert s.kv_cache_manager.num_free_blocks == 64


def test_admission_respects_token_budget_and_max_num_seqs():
    s = make_scheduler(budget=10, max_num_seqs=2)
    for p in (4, 4, 4):
        s.add_request(make_request(p, 3))
    out, _ = step(s)
    # Two fit the budget of 10 (4 + 4) and max_num_seqs=2 keeps the third out.
    assert [out.num_scheduled_tokens[r.request_id] for r in out.scheduled_requests] == [4, 4]
    assert s.num_waiting == 1
    out, _ = step(s)
    assert out.total_num_scheduled_tokens == 2  # two decodes; the third still waits (max_num_seqs)


def test_chunked_prefill_splits_long_prompt_and_samples_only_at_the_end():
    s = make_scheduler(budget=8)
    r = make_request(20, 2)
    s.add_request(r)
    chunks = []
    while r.num_output_tokens == 0:
        out, _ = step(s)
        chunks.append(out.num_scheduled_tokens[r.request_id])
        if r.num_computed_tokens < 20:
            assert r.num_output_tokens == 0  # no token sampled from a partial prompt
    assert chunks == [8, 8, 4]
    assert r.num_computed_tokens == 20


def test_chunked_prefill_disabled_keeps_prompt_whole():
    kv = KVCacheManager(64, 4)
    s = Scheduler(SchedulerConfig(8, 8, 64, enable_chunked_prefill=False), kv)
    small, big = make_request(4, 1), make_request(6, 1)
    s.add_request(small)
    s.add_request(big)
    out, _ = step(s)
    assert [r.request_id for r in out.scheduled_requests] == [small.request_id]  # 4 + 6 > 8


def test_request_joins_mid_flight_and_finished_leave_at_once():
    s = make_scheduler()
    a = make_request(4, 10)
    s.add_request(a)
    step(s)
    step(s)
    b = make_request(6, 2)
    s.add_request(b)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {a.request_id: 1, b.request_id: 6}
    _, finished = step(s)
    assert finished == [b]  # b's second token: max_tokens=2 reached
    assert b.request_id not in s.kv_cache_manager.req_to_blocks
    out, _ = step(s)
    assert out.finished_request_ids == {b.request_id}
    assert [r.request_id for r in out.scheduled_requests] == [a.request_id]


def test_preemption_by_recompute_evicts_latest_arrival_and_returns_every_block():
    # 6 blocks of 4 tokens: two requests of 8-token prompts growing to 16 tokens cannot coexist.
    s = make_scheduler(num_blocks=6, block_size=4, max_model_len=24)
    first, second = make_request(8, 8, arrival=1.0), make_request(8, 8, arrival=2.0)
    s.add_request(first)
    s.add_request(second)
    preempted = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        preempted += out.preempted_request_ids
        # While anything is preempted, nothing new is admitted: `first` keeps going alone.
    assert preempted and set(preempted) == {second.request_id}
    assert second.num_preemptions >= 1
    for r in (first, second):
        assert r.num_output_tokens == 8
    assert s.kv_cache_manager.num_free_blocks == 6


def test_recompute_reprefills_prompt_plus_output():
    # Without prefix caching: nothing of the freed blocks is reused (see test_prefix_caching.py).
    s = make_scheduler(num_blocks=5, block_size=4, max_model_len=20, prefix_caching=False)
    first, second = make_request(8, 8, arrival=1.0), make_request(6, 8, arrival=2.0)
    s.add_request(first)
    s.add_request(second)
    while second.status != SequenceStatus.PREEMPTED:
        step(s)
    generated = second.num_output_tokens
    assert generated > 0 and second.num_computed_tokens == 0
    while True:
        out, _ = step(s)
        if second.request_id in out.num_scheduled_tokens:
            break
    # Resumed with one prefill covering the prompt and every token generated before preemption,
    # and sampling continues from there (no token is lost or repeated).
    assert out.num_scheduled_tokens[second.request_id] == 6 + generated
    assert second.num_output_tokens == generated + 1


def test_new_request_waits_behind_preempted_one():
    s = make_scheduler(num_blocks=6, block_size=4, max_model_len=24)
    a, b = make_request(8, 8, arrival=1.0), make_request(8, 8, arrival=2.0)
    s.add_request(a)
    s.add_request(b)
    while b.status != SequenceStatus.PREEMPTED:
        step(s)
    c = make_request(1, 1, arrival=3.0)
    s.add_request(c)
    assert list(s.waiting)[0] is b.group  # the preempted request resumes before anything new
    order = []
    while s.has_unfinished_requests():
        out, finished = step(s)
        order += [r.request_id for r in out.scheduled_requests if r.request_id not in order]
    assert order.index(b.request_id) < order.index(c.request_id)


def test_abort_frees_blocks_running_and_waiting():
    s = make_scheduler(max_num_seqs=1)
    a, b = make_request(5, 10), make_request(5, 10)
    s.add_request(a)
    s.add_request(b)
    step(s)
    s.finish_requests([a.request_id, b.request_id], SequenceStatus.FINISHED_ABORTED)
    assert a.status == b.status == SequenceStatus.FINISHED_ABORTED
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.num_free_blocks == 64
    s.check_integrity()


def test_stop_conditions_eos_stop_token_min_tokens_and_max_model_len():
    s = make_scheduler(max_model_len=12)
    eos = Sequence.of("eos", [1, 2], SamplingParams(max_tokens=5), eos_token_ids=[7])
    stop = Sequence.of("stop", [1, 2], SamplingParams(max_tokens=5, stop_token_ids=[7]), [99])
    min_tok = Sequence.of("min", [1, 2], SamplingParams(max_tokens=5, min_tokens=3), [7])
    capped = Sequence.of("cap", [1] * 10, SamplingParams(max_tokens=None, ignore_eos=True), [7])
    for r in (eos, stop, min_tok, capped):
        s.add_request(r)
    run_to_completion(s)
    assert eos.num_output_tokens == 1 and eos.status == SequenceStatus.FINISHED_STOPPED
    assert stop.stop_reason == 7 and stop.status == SequenceStatus.FINISHED_STOPPED
    assert min_tok.num_output_tokens == 3
    assert capped.num_tokens == 12 and capped.status == SequenceStatus.FINISHED_LENGTH_CAPPED
