"""Preemption by swap and by recompute at the scheduler level. Torch-free: the fake runner of
test_sharing.py plus a simulated swap space, so that a swapped block that comes back with the
wrong contents changes the output (the runner asserts every context it reads).

Every step is checked (`step` below): one status per group, the victim of a preemption is the
latest-arrived running group, nothing is admitted while a group is swapped, FCFS admission,
and every swap-out / swap-in moves a group's blocks with their sharing intact."""

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.sequence import SequenceStatus
from tests.core.test_beam_search import run_ours
from tests.core.test_sharing import (
    MIXED,
    VOCAB,
    FakeRunner,
    beam_model,
    h,
    make_request,
    results,
)


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=16, budget=64, max_model_len=64,
                   prefix_caching=True, mode="swap", num_cpu_blocks=64,
                   max_stashed_seqs=None) -> Scheduler:  # fmt: skip
    kv = KVCacheManager(num_blocks, block_size, prefix_caching, num_cpu_blocks)
    config = SchedulerConfig(max_num_seqs, budget, max_model_len, preemption_mode=mode,
                             max_stashed_seqs=max_stashed_seqs)  # fmt: skip
    return Scheduler(config, kv)


def shape(tables):
    """A group's block tables with each block replaced by the order of its first appearance:
    equal shapes mean the same blocks are shared in the same places."""
    index: dict[int, int] = {}
    canon = tuple(tuple(index.setdefault(b.block_id, len(index)) for b in t) for t in tables)
    return canon, index


class SwapRecorder:
    """Wraps the KV cache manager's swap_out / swap_in and checks each move: the group's
    tables keep their shape (so the blocks shared inside it stay shared), one destination block
    per distinct source block, destination ref counts mirror the sharing, and the (source,
    destination) pairs handed to the runner are exactly that mapping."""

    def __init__(self, s: Scheduler):
        self.kv = kv = s.kv_cache_manager
        self.events: list[tuple[str, str, int, int]] = []  # (kind, request id, distinct, logical)
        self.shapes: dict[str, tuple] = {}  # request id -> shape while swapped out
        swap_out, swap_in = kv.swap_out, kv.swap_in

        def recorded_swap_out(seqs):
            return self._move("out", seqs, swap_out, kv.req_to_blocks, kv.swapped_blocks,
                              kv.block_pool, kv.cpu_block_pool)  # fmt: skip

        def recorded_swap_in(seqs):
            return self._move("in", seqs, swap_in, kv.swapped_blocks, kv.req_to_blocks,
                              kv.cpu_block_pool, kv.block_pool)  # fmt: skip

        kv.swap_out, kv.swap_in = recorded_swap_out, recorded_swap_in

    def _move(self, kind, seqs, move, src_tables, dst_tables, src_pool, dst_pool):
        group = seqs[0].group
        assert seqs == group.seqs, "a group moves as a whole"
        src = [src_tables[q.seq_id] for q in seqs]
        src_shape, src_index = shape(src)
        uses = {}  # source block -> references from this group
        for table in src:
            for b in table:
                uses[b.block_id] = uses.get(b.block_id, 0) + 1
        src_refs = {b: src_pool.blocks[b].ref_cnt for b in uses}
        num_free_dst = dst_pool.num_free_blocks
        pairs = move(seqs)
        dst = [dst_tables[q.seq_id] for q in seqs]
        dst_shape, dst_index = shape(dst)
        assert dst_shape == src_shape, f"swap {kind} changed the group's sharing"
        assert not any(q.seq_id in src_tables for q in seqs)
        # Distinct blocks before == destination blocks taken == pairs to copy.
        assert num_free_dst - dst_pool.num_free_blocks == len(uses)
        by_canon = {c: b for b, c in dst_index.items()}
        assert sorted(pairs) == sorted((b, by_canon[c]) for b, c in src_index.items())
        for b, c in src_index.items():
            # The destination holds exactly the group's references; the source loses them
            # (a device block also cached for other requests keeps theirs).
            assert dst_pool.blocks[by_canon[c]].ref_cnt == uses[b]
            assert src_pool.blocks[b].ref_cnt == src_refs[b] - uses[b]
        if kind == "out":
            self.shapes[group.request_id] = src_shape
        else:
            assert self.shapes.pop(group.request_id) == src_shape, "changed while swapped out"
        logical = sum(len(t) for t in src)
        self.events.append((kind, group.request_id, len(uses), logical))
        return pairs


class SwapRunner(FakeRunner):
    """The fake runner with a swap space: swaps out, then in (each one gather, then one
    scatter), before the copies and the forward, like ModelRunner.execute_model."""

    def __init__(self, s: Scheduler, **kwargs):
        super().__init__(s, **kwargs)
        kv = s.kv_cache_manager
        self.cpu = [[None] * kv.block_size for _ in range(kv.num_cpu_blocks)]

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        gathered = [list(self.pool[dev]) for dev, _ in so.blocks_to_swap_out]
        for (_, cpu), contents in zip(so.blocks_to_swap_out, gathered, strict=True):
            self.cpu[cpu] = contents
        gathered = [list(self.cpu[cpu]) for cpu, _ in so.blocks_to_swap_in]
        for (cpu, dev), contents in zip(so.blocks_to_swap_in, gathered, strict=True):
            self.pool[dev] = contents
            self.cpu[cpu] = [None] * self.block_size  # free now: may hold anything later
        return super().execute(so)


def check_statuses(s: Scheduler):
    """Every sequence of a group has the group's one status, and the queue agrees with it."""
    expected = {"running": {SequenceStatus.RUNNING}, "swapped": {SequenceStatus.SWAPPED},
                "waiting": {SequenceStatus.WAITING, SequenceStatus.PREEMPTED}}  # fmt: skip
    for name, allowed in expected.items():
        for group in getattr(s, name):
            statuses = {q.status for q in group.seqs}
            assert len(statuses) == 1 and statuses <= allowed, f"{group}: {statuses} in {name}"


def step(s: Scheduler, runner: SwapRunner):
    kv = s.kv_cache_manager
    running, waiting, swapped = list(s.running), list(s.waiting), list(s.swapped)
    computed = {q.seq_id: q.num_computed_tokens for g in running for q in g.seqs}
    out = s.schedule()
    s.check_integrity()
    check_statuses(s)

    # Preemption: the victims are the latest arrivals among the running groups, and a step that
    # preempts brings nothing in.
    victims = [s.requests[r] for r in out.preempted_request_ids]
    for victim in victims:
        assert victim in running and victim not in s.running
        assert all(g.arrival_time < victim.arrival_time for g in s.running)
        if victim in s.swapped:
            assert s.config.preemption_mode == "swap"
            for q in victim.seqs:  # nothing to recompute
                assert q.num_computed_tokens == computed[q.seq_id]
                assert q.seq_id not in kv.req_to_blocks and q.seq_id in kv.swapped_blocks
        else:
            assert victim in s.waiting
            for q in victim.seqs:
                assert q.num_computed_tokens == 0 and q.seq_id not in kv.req_to_blocks
    resumed = [g for g in swapped if g in s.running]
    admitted = [g for g in waiting if g in s.running]
    if victims:
        assert not resumed and not admitted
        assert set(s.running) <= set(running)
    # Preempted groups come back in arrival order, however they were preempted; then new ones,
    # in arrival order (FCFS), and none while anything is swapped out.
    for g in resumed + admitted:
        assert all(other.arrival_time > g.arrival_time for other in [*s.swapped, *s.waiting])
        if not g.num_preemptions:  # a new request: every preempted one has resumed
            assert not s.swapped, "a new request was admitted while a group is swapped out"
            assert not any(other.num_preemptions for other in s.waiting)
    # The runner hears which sequences went out and came back (a hybrid model's states go to a
    # host stash and back), and the stash keeps its bound.
    assert out.swapped_out_seqs == [q.seq_id for v in victims if v in s.swapped for q in v.seqs]
    assert out.swapped_in_seqs == [q.seq_id for g in resumed for q in g.seqs]
    if s.config.max_stashed_seqs is not None:
        assert sum(len(g.seqs) for g in s.swapped) <= s.config.max_stashed_seqs
    assert len({cpu for _, cpu in out.blocks_to_swap_out}) == len(out.blocks_to_swap_out)
    assert len({dev for _, dev in out.blocks_to_swap_in}) == len(out.blocks_to_swap_in)

    groups = s.update_from_output(out, runner.execute(out))
    s.check_integrity()
    check_statuses(s)
    runner.check_contexts(s)
    # Both pools hold exactly the live sequences' distinct blocks.
    live = {b for g in s.running for q in g.seqs for b in kv.get_block_ids(q.seq_id)}
    assert kv.num_free_blocks == kv.block_pool.num_blocks - len(live)
    held = {b.block_id for t in kv.swapped_blocks.values() for b in t}
    assert kv.num_free_cpu_blocks == kv.num_cpu_blocks - len(held)
    return out, groups


def run(s: Scheduler, runner: SwapRunner, max_steps=3000):
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return outs
        outs.append(step(s, runner)[0])
    raise AssertionError(f"did not finish: running {s.running}, swapped {s.swapped}")


def step_until(s, runner, condition, max_steps=500):
    for _ in range(max_steps):
        if condition():
            return
        assert s.has_unfinished_requests(), "finished before the condition held"
        step(s, runner)
    raise AssertionError("the condition never held")


def assert_all_free(s: Scheduler):
    kv = s.kv_cache_manager
    s.check_integrity()
    assert not kv.req_to_blocks and not kv.swapped_blocks
    assert kv.num_free_blocks == kv.block_pool.num_blocks
    assert kv.num_free_cpu_blocks == kv.num_cpu_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    if kv.cpu_block_pool is not None:
        assert all(b.ref_cnt == 0 for b in kv.cpu_block_pool.blocks)


# -- swap space bookkeeping -----------------------------------------------------------------------
def test_swap_out_and_in_keep_a_forked_groups_sharing():
    kv = KVCacheManager(num_blocks=12, block_size=4, num_cpu_blocks=8)
    parent = make_request(10, n=3)
    assert kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    seqs = [parent]
    for i in (1, 2):
        child = parent.fork(f"{parent.request_id}#{i}", i)
        kv.fork(parent, child)
        seqs.append(child)
    for q in seqs:
        q.append_output_token(5)
    # The first writes its first token: it copies the third block, which the others share.
    assert len(kv.allocate_slots(parent, 1).blocks_to_copy) == 1
    parent.num_computed_tokens += 1
    tables = [kv.get_block_ids(q.seq_id) for q in seqs]
    distinct = {b for t in tables for b in t}
    assert len(distinct) == 4 and sum(map(len, tables)) == 9  # 2 shared by 3, 2 third blocks
    assert kv.can_swap_out(seqs)
    out = kv.swap_out(seqs)
    kv.check_integrity()
    assert kv.num_free_blocks == 12 and kv.num_free_cpu_blocks == 4
    assert sorted(dev for dev, _ in out) == sorted(distinct)
    cpu_refs = sorted(kv.cpu_block_pool.blocks[cpu].ref_cnt for _, cpu in out)
    dev_refs = sorted(tables_refs := [sum(t.count(b) for t in tables) for b in distinct])
    assert cpu_refs == dev_refs == [1, 2, 3, 3] and sum(tables_refs) == 9
    # Swap-in needs the 4 blocks, plus what the next step writes: two sequences write into the
    # third block they share, so one of them copies it.
    plan = [(q, q.num_tokens - q.num_computed_tokens) for q in seqs]
    assert [n for _, n in plan] == [0, 1, 1]
    assert kv.num_swap_in_blocks(seqs) == 4
    assert kv.num_blocks_needed(plan, swapped=True) == 1
    in_ = kv.swap_in(seqs)
    kv.check_integrity()
    assert len(in_) == 4 and kv.num_free_blocks == 8 and kv.num_free_cpu_blocks == 8
    assert shape([kv.req_to_blocks[q.seq_id] for q in seqs])[0] == ((0, 1, 2),) + ((0, 1, 3),) * 2
    assert kv.num_blocks_needed(plan) == 1
    for q in seqs:
        kv.free(q)
    kv.check_integrity()
    assert kv.num_free_blocks == 12


def test_can_swap_out_counts_distinct_blocks_against_the_free_swap_space():
    kv = KVCacheManager(num_blocks=12, block_size=4, num_cpu_blocks=3)
    a = make_request(10, n=2)
    assert kv.allocate_slots(a, 10)  # 3 blocks
    b = a.fork("b", 1)
    kv.fork(a, b)
    assert kv.can_swap_out([a, b])  # 6 in the tables, 3 distinct
    other = make_request(1)
    assert kv.allocate_slots(other, 1)
    kv.swap_out([other])
    assert not kv.can_swap_out([a, b])  # 2 free
    assert not KVCacheManager(4, 4).can_swap_out([a])  # no swap space at all


# -- whole workloads: same tokens as an unconstrained run --------------------------------------
def run_mixed(**config):
    s = make_scheduler(**config)
    recorder = SwapRecorder(s)
    runner = SwapRunner(s)
    requests = [
        make_request(0, prompt=[1 + h("mixed", i, j) % (VOCAB - 1) for j in range(p)], **kw)
        for i, (p, kw) in enumerate(MIXED)
    ]
    for i, r in enumerate(requests):
        r.request.arrival_time = float(i)
        s.add_request(r)
    outs = run(s, runner)
    assert_all_free(s)
    res = results(requests)
    return [res[r.request_id] for r in requests], s, recorder, outs


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize(
    "config",
    [dict(num_blocks=30), dict(num_blocks=24, budget=7), dict(num_blocks=120, block_size=1)],
    ids=["small-pool", "small-pool-chunked", "bs1-small-pool"],
)
@pytest.mark.parametrize("mode", ["swap", "swap-tiny", "recompute"])
def test_groups_under_pressure_give_the_same_tokens(mode, config, prefix_caching):
    config = dict(config, prefix_caching=prefix_caching)
    expected, s_big, _, _ = run_mixed(**dict(config, num_blocks=400), mode="recompute")
    assert s_big.num_preemptions_total == 0
    tiny = mode == "swap-tiny"
    num_cpu = config["num_blocks"] // (8 if tiny else 1)
    mode = mode.removesuffix("-tiny")
    got, s, recorder, outs = run_mixed(**config, mode=mode, num_cpu_blocks=num_cpu)
    assert got == expected
    assert s.num_preemptions_total > 0
    if mode == "recompute":
        assert s.num_swap_preemptions_total == 0 and not recorder.events
    elif tiny:  # too small for some groups: those fall back to recompute
        assert 0 < s.num_swap_preemptions_total < s.num_preemptions_total
    else:
        assert s.num_swap_preemptions_total > 0
    outs_ = [e for e in recorder.events if e[0] == "out"]
    assert len(outs_) == s.num_swap_preemptions_total
    assert len(outs_) == len([e for e in recorder.events if e[0] == "in"])  # all came back
    if mode == "swap" and not tiny:
        # Groups of several sequences went out and came back, sharing blocks.
        assert any(distinct < logical for _, _, distinct, logical in outs_)
    for (_, kw), hyps in zip(MIXED, got, strict=True):
        if "beam" in kw:
            state, _ = run_ours(beam_model, kw["beam"], kw["max_tokens"],
                                kw.get("length_penalty", 1.0), False, [])  # fmt: skip
            assert hyps == [tuple(hyp.output_token_ids) for hyp in state.finished]


@pytest.mark.parametrize("max_stashed", [1, 3])
def test_a_full_state_stash_falls_back_to_recompute(max_stashed):
    """A hybrid model: swapped-out sequences keep their recurrent state in the runner's host
    stash, at most max_stashed_seqs of them; a group past it is preempted by recompute."""
    expected, _, _, _ = run_mixed(num_blocks=400, mode="recompute")
    got, s, _, _ = run_mixed(num_blocks=30, max_stashed_seqs=max_stashed)
    assert got == expected
    assert 0 < s.num_swap_preemptions_total < s.num_preemptions_total


# -- groups go and come back together, sharing intact ---------------------------------------
@pytest.mark.parametrize("kind", ["samples", "beam"])
def test_swapped_group_keeps_its_sharing_through_the_round_trip(kind):
    # Each group fits the pool alone even unshared (3 x 5 blocks), not both together.
    s = make_scheduler(num_blocks=16, block_size=4, max_model_len=40, num_cpu_blocks=16)
    recorder = SwapRecorder(s)
    runner = SwapRunner(s)
    kv = s.kv_cache_manager
    first = make_request(8, n=3, max_tokens=12, arrival=1.0)
    second = (make_request(10, n=3, max_tokens=12, arrival=2.0) if kind == "samples"
              else make_request(6, beam=3, max_tokens=12, arrival=2.0))  # fmt: skip
    s.add_request(first)
    s.add_request(second)
    group = second.group
    step_until(s, runner, lambda: group in s.swapped)
    assert len(group.seqs) == 3 and second.num_output_tokens > 0
    assert all(q.status == SequenceStatus.SWAPPED for q in group.seqs)
    (event,) = recorder.events
    _, request_id, distinct, logical = event
    assert request_id == group.request_id and distinct < logical  # blocks were shared
    tables = [kv.swapped_blocks[q.seq_id] for q in group.seqs]
    assert len({b.block_id for t in tables for b in t}) == distinct
    assert kv.num_cpu_blocks - kv.num_free_cpu_blocks == distinct
    # Frozen while out: the first group goes on alone, nothing else is admitted.
    late = make_request(3, max_tokens=2, arrival=3.0)
    s.add_request(late)
    out, _ = step(s, runner)
    assert late.group in s.waiting and group in s.swapped
    while group in s.swapped:
        seq_ids = {q.seq_id for q in group.seqs}  # beams fork and go in update_from_output
        out, _ = step(s, runner)
        assert late.group in s.waiting or not s.swapped
    # Back as a whole in one step, with as many device blocks as it had swap blocks.
    assert seq_ids <= {q.seq_id for q in out.scheduled_requests}
    assert len(out.blocks_to_swap_in) == distinct
    assert recorder.events[-1] == ("in", group.request_id, distinct, logical)
    run(s, runner)
    if kind == "beam":
        state, _ = run_ours(beam_model, 3, 12, 1.0, False, [])
        assert results([second])[second.request_id] == [
            tuple(hyp.output_token_ids) for hyp in state.finished
        ]
    else:
        assert [q.num_output_tokens for q in group.finished_seqs] == [12, 12, 12]
    assert_all_free(s)


def test_swapped_group_holding_most_of_the_pool_comes_back():
    """Regression: swap-in used to count the group's blocks twice (the swapped blocks, and
    again as new ones) plus one per sequence, so a group holding more than half the pool could
    never come back, even to an empty pool, and the engine spun forever."""
    s = make_scheduler(num_blocks=16, block_size=4, num_cpu_blocks=16)
    runner = SwapRunner(s)
    first = make_request(8, max_tokens=20, arrival=1.0)
    second = make_request(30, max_tokens=20, arrival=2.0)
    s.add_request(first)
    s.add_request(second)
    step_until(s, runner, lambda: second.group in s.swapped)
    assert len(s.kv_cache_manager.swapped_blocks[second.seq_id]) > 8
    run(s, runner, max_steps=100)
    assert s.num_swap_preemptions_total == s.num_preemptions_total == 1
    assert first.num_output_tokens == second.num_output_tokens == 20
    assert_all_free(s)


# -- arrival order ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, num_cpu", [("swap", 16), ("swap", 4), ("recompute", 0)])
@pytest.mark.parametrize("budget", [64, 10])
def test_preemption_follows_arrival_order_and_nobody_starves(mode, num_cpu, budget):
    """Sixteen requests of different lengths on a pool 5-10x too small: `step` checks that each
    victim arrived after every group left running, that nothing is admitted ahead of an earlier
    arrival or while a group is swapped, and that preempted groups resume before new ones."""
    s = make_scheduler(num_blocks=16, block_size=4, budget=budget, max_model_len=64,
                       mode=mode, num_cpu_blocks=num_cpu)  # fmt: skip
    runner = SwapRunner(s)
    requests = []
    for i in range(16):
        kw = dict(n=2) if i % 4 == 1 else dict(beam=2) if i % 4 == 3 else {}
        r = make_request(3 + (7 * i) % 11, max_tokens=6 + (5 * i) % 13, arrival=float(i), **kw)
        requests.append(r)
        s.add_request(r)
    demand = sum(r.group.num_samples * -(-(r.num_prompt_tokens + r.max_tokens) // 4)
                 for r in requests)  # fmt: skip
    assert 5 * 16 <= demand <= 10 * 16
    first_scheduled: dict[str, int] = {}
    for i, out in enumerate(run(s, runner)):
        for q in out.scheduled_requests:
            first_scheduled.setdefault(q.request_id, i)
    assert s.num_preemptions_total > 0
    if mode == "swap":
        assert s.num_swap_preemptions_total > 0
        if num_cpu < 16:  # some groups did not fit the swap space and were recomputed
            assert s.num_swap_preemptions_total < s.num_preemptions_total
    # Started in arrival order (FCFS admission), and every one finished in full.
    order = sorted(first_scheduled, key=first_scheduled.get)
    assert order == [r.request_id for r in requests]
    for r in requests:
        group = r.group
        assert group.is_finished()
        if not group.is_beam_search:
            assert all(q.num_output_tokens == r.max_tokens for q in group.finished_seqs)
    assert_all_free(s)


def test_preempted_groups_resume_in_arrival_order_whether_swapped_or_recomputed():
    """Regression: swapped groups used to resume before every waiting group, so when the
    latest victim fit the swap space and an earlier one fell back to recompute, the later one
    came back first; preempted again by recompute, it was queued ahead of the earlier one and
    admitted before it."""
    s = make_scheduler(num_blocks=16, block_size=4, num_cpu_blocks=3)
    runner = SwapRunner(s)
    a = make_request(8, max_tokens=40, arrival=0.0)
    b = make_request(20, max_tokens=24, arrival=1.0)  # 6+ blocks: never fits the swap space
    c = make_request(2, max_tokens=24, arrival=2.0)
    for r in (a, b, c):
        s.add_request(r)
    step_until(s, runner, lambda: c.group in s.swapped and b.group in s.waiting)
    assert b.status == SequenceStatus.PREEMPTED
    step_until(s, runner, lambda: b.group in s.running or c.group in s.running)
    assert b.group in s.running  # the earlier arrival first (c may follow in the same step)
    run(s, runner)  # `step` checks the order at every step
    assert [r.num_output_tokens for r in (a, b, c)] == [40, 24, 24]
    assert_all_free(s)


# -- aborts ---------------------------------------------------------------------------------------
def test_abort_of_a_swapped_group_frees_its_swap_blocks():
    s = make_scheduler(num_blocks=16, block_size=4, max_model_len=40, num_cpu_blocks=16)
    runner = SwapRunner(s)
    kv = s.kv_cache_manager
    first = make_request(8, n=3, max_tokens=12, arrival=1.0)
    second = make_request(10, n=3, max_tokens=12, arrival=2.0)
    third = make_request(4, max_tokens=4, arrival=3.0)
    for r in (first, second, third):
        s.add_request(r)
    step_until(s, runner, lambda: second.group in s.swapped)
    assert kv.num_free_cpu_blocks < kv.num_cpu_blocks
    s.finish_requests([second.request_id], SequenceStatus.FINISHED_ABORTED)
    s.check_integrity()
    assert kv.num_free_cpu_blocks == kv.num_cpu_blocks and not kv.swapped_blocks
    assert not s.swapped and second.request_id not in s.requests
    assert all(q.status == SequenceStatus.FINISHED_ABORTED for q in second.group.finished_seqs)
    # Nothing is swapped any more: the third request is admitted as soon as it fits.
    run(s, runner)
    assert third.num_output_tokens == 4
    assert s.schedule().is_empty
    assert_all_free(s)
