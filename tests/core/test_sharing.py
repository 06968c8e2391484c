"""Memory sharing between the sequences of a group: fork, copy-on-write, gang scheduling, beam
search bookkeeping, aborts. Torch-free: a fake runner keeps a simulated KV pool (each slot holds
the (position, token) written there), applies the step's block copies before writing, and derives
every next token from the context it reads back through the block table, so a wrong copy or a
write into a shared block changes the output."""

import hashlib
import itertools

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedllm.outputs import ModelRunnerOutput, TokenLogprobs
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceStatus
from tests.core.test_beam_search import run_ours, table_model

VOCAB = 50
EOS = 0
_ids = itertools.count()


def h(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def make_request(prompt_len, n=1, max_tokens=8, best_of=None, beam=None, ignore_eos=True,
                 arrival=None, prompt=None, **kwargs) -> Sequence:  # fmt: skip
    i = next(_ids)
    if beam is not None:
        params = SamplingParams(n=beam, temperature=0, use_beam_search=True, max_tokens=max_tokens,
                                ignore_eos=ignore_eos, **kwargs)  # fmt: skip
    else:
        params = SamplingParams(n=n, best_of=best_of, max_tokens=max_tokens, seed=i,
                                ignore_eos=ignore_eos, **kwargs)  # fmt: skip
    if prompt is None:
        prompt = [1 + h(i, j) % (VOCAB - 1) for j in range(prompt_len)]
    return Sequence.of(f"g{i}", prompt, params, eos_token_ids=[EOS], arrival_time=arrival)


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=16, budget=64, max_model_len=64,
                   prefix_caching=True) -> Scheduler:  # fmt: skip
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len), kv)


BEAM_VOCAB = 8
beam_model = table_model(BEAM_VOCAB, seed=3, eos_boost=0.0, eos=(EOS,))


class FakeRunner:
    """Plays the model runner on a simulated KV pool."""

    def __init__(self, scheduler: Scheduler, eos_every: int = 0):
        kv = scheduler.kv_cache_manager
        self.block_size = kv.block_size
        self.pool = [[None] * kv.block_size for _ in range(kv.num_blocks)]
        self.eos_every = eos_every  # sample EOS when a hash of the context is divisible by it

    def read(self, block_ids, num_tokens):
        bs = self.block_size
        return [self.pool[block_ids[p // bs]][p % bs] for p in range(num_tokens)]

    def next_token(self, context, sample_index):
        if self.eos_every and h(context, sample_index, "eos") % self.eos_every == 0:
            return EOS
        return 1 + h(context, sample_index) % (VOCAB - 1)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        # Copy-on-write first, as one gather then one scatter (like the runner's indexing).
        gathered = [list(self.pool[src]) for src, _ in so.blocks_to_copy]
        for (_, dst), contents in zip(so.blocks_to_copy, gathered, strict=True):
            self.pool[dst] = contents
        for seq in so.scheduled_requests:
            start, n = seq.num_computed_tokens, so.num_scheduled_tokens[seq.seq_id]
            (table,) = so.block_ids[seq.seq_id]
            for p in range(start, start + n):
                self.pool[table[p // self.block_size]][p % self.block_size] = (
                    p,
                    seq.all_token_ids[p],
                )
        out = ModelRunnerOutput({})
        for seq in so.scheduled_requests:
            if not so.needs_sample(seq):
                continue
            # What attention sees: the context read back through the block table.
            context = self.read(so.block_ids[seq.seq_id][0], seq.num_tokens)
            assert context == list(enumerate(seq.all_token_ids)), f"{seq.seq_id} reads bad K/V"
            tokens = [t for _, t in context]
            if seq.group.is_beam_search:
                lps = beam_model(tokens[seq.num_prompt_tokens :])
                k = seq.group.beam.num_candidates
                order = sorted(range(BEAM_VOCAB), key=lambda t: -lps[t])[:k]
                out.beam_candidates[seq.seq_id] = (order, [lps[t] for t in order])
                continue
            n = seq.num_samples
            indices = range(n) if n > 1 else [seq.sample_index]
            sampled = [self.next_token(tokens, i) for i in indices]
            out.sampled_token_ids[seq.seq_id] = sampled
            out.logprobs[seq.seq_id] = [
                TokenLogprobs(t, -(h(tokens, t) % 1000) / 100, 1, []) for t in sampled
            ]
        return out

    def check_contexts(self, scheduler: Scheduler):
        """Every live sequence still reads its own computed tokens (nobody overwrote them)."""
        kv = scheduler.kv_cache_manager
        for group in scheduler.running:
            for seq in group.seqs:
                context = self.read(kv.get_block_ids(seq.seq_id), seq.num_computed_tokens)
                expected = list(enumerate(seq.all_token_ids[: seq.num_computed_tokens]))
                assert context == expected, f"{seq.seq_id}'s K/V were overwritten"


def live_blocks(s: Scheduler) -> set[int]:
    kv = s.kv_cache_manager
    return {b for g in s.running for seq in g.seqs for b in kv.get_block_ids(seq.seq_id)}


def step(s: Scheduler, runner: FakeRunner):
    kv = s.kv_cache_manager
    # What the running sequences need, if they all get their remaining tokens this step.
    plan = [(seq, seq.num_tokens - seq.num_computed_tokens) for g in s.running for seq in g.seqs]
    predicted = kv.num_blocks_needed(plan)
    free_before = kv.num_free_blocks
    num_waiting = s.num_waiting
    out = s.schedule()
    s.check_integrity()
    got = {seq.seq_id: out.num_scheduled_tokens[seq.seq_id] for seq in out.scheduled_requests}
    if (
        not out.preempted_request_ids
        and s.num_waiting == num_waiting
        and got == dict((seq.seq_id, n) for seq, n in plan)
    ):
        assert free_before - kv.num_free_blocks == predicted, "num_blocks_needed was wrong"
    for seq in out.scheduled_requests:
        n = seq.num_computed_tokens + out.num_scheduled_tokens[seq.seq_id]
        assert len(out.block_ids[seq.seq_id][0]) * kv.block_size >= n
        # Lockstep: a group's sequences sample in the same step, or none of them does.
        group_samples = {out.needs_sample(q) if q in out.scheduled_requests else False
                         for q in seq.group.seqs}  # fmt: skip
        assert len(group_samples) == 1, f"{seq.group} samples out of step"
    # A copy goes from a block a sequence still holds to a fresh one only it holds.
    dsts = [d for _, d in out.blocks_to_copy]
    assert len(set(dsts)) == len(dsts)
    for src, dst in out.blocks_to_copy:
        assert kv.block_pool.blocks[dst].ref_cnt == 1
        assert src in live_blocks(s) and src != dst
    for request_id in out.preempted_request_ids:
        group = s.requests[request_id]
        assert group in s.waiting and group not in s.running
        for seq in group.seqs:
            assert seq.status == SequenceStatus.PREEMPTED and seq.num_computed_tokens == 0
            assert seq.seq_id not in kv.req_to_blocks
    groups = s.update_from_output(out, runner.execute(out))
    s.check_integrity()
    runner.check_contexts(s)
    # Blocks of pruned beams and finished sequences are back at once.
    assert kv.num_free_blocks == kv.block_pool.num_blocks - len(live_blocks(s))
    return out, groups


def run(s: Scheduler, runner: FakeRunner, max_steps=2000):
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return outs
        outs.append(step(s, runner)[0])
    raise AssertionError("did not finish")


def step_until(s: Scheduler, runner: FakeRunner, condition, max_steps=500):
    for _ in range(max_steps):
        if condition():
            return
        assert s.has_unfinished_requests(), "finished before the condition held"
        step(s, runner)
    raise AssertionError("the condition never held")


def assert_all_free(s: Scheduler):
    kv = s.kv_cache_manager
    s.check_integrity()
    assert not kv.req_to_blocks
    assert kv.num_free_blocks == kv.block_pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def results(requests):
    """Output tokens of every sample (by index), or every beam hypothesis (by rank)."""
    res = {}
    for r in requests:
        g = r.group
        if g.is_beam_search:
            res[g.request_id] = [tuple(hyp.output_token_ids) for hyp in g.beam.finished]
        else:
            seqs = sorted(g.seqs + g.finished_seqs, key=lambda q: q.sample_index)
            res[g.request_id] = [tuple(q.output_token_ids) for q in seqs]
    return res


# -- fork and copy-on-write -----------------------------------------------------------------------
def test_fork_shares_every_block_and_copies_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_request(10)
    assert kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    free = kv.num_free_blocks
    children = []
    for i in (1, 2):
        child = parent.fork(f"{parent.request_id}#{i}", i)
        kv.fork(parent, child)
        children.append(child)
    table = kv.get_block_ids(parent.seq_id)
    assert len(table) == 3
    for child in children:
        assert kv.get_block_ids(child.seq_id) == table
        assert child.group is parent.group and child.sample_index in (1, 2)
    assert [kv.block_pool.blocks[b].ref_cnt for b in table] == [3, 3, 3]
    assert kv.num_free_blocks == free
    assert kv.num_copied_blocks == 0
    assert kv.num_logical_blocks == 9
    kv.check_integrity()
    for r in (children[0], parent, children[1]):
        kv.free(r)
        kv.check_integrity()
    assert kv.num_free_blocks == 8
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_num_blocks_needed_counts_one_copy_per_writer_but_the_last():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request(6)
    assert kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    b, c = a.fork("b", 1), a.fork("c", 2)
    kv.fork(a, b)
    kv.fork(a, c)
    for seq in (a, b, c):
        seq.append_output_token(5)
    shared = kv.get_block_ids("b")[1]
    # Block 1 (tokens 4-7) is held three times: all three writing need 2 copies, two need 2
    # (the third keeps the original), one needs 1.
    assert kv.num_blocks_needed([(a, 1), (b, 1), (c, 1)]) == 2
    assert kv.num_blocks_needed([(a, 1), (b, 1)]) == 2
    assert kv.num_blocks_needed([(b, 1)]) == 1
    # Tokens past the block boundary add new blocks on top of the copy.
    assert kv.num_blocks_needed([(a, 3)]) == 2
    free = kv.num_free_blocks
    a_new, b_new = kv.allocate_slots(a, 1), kv.allocate_slots(b, 1)
    assert [list(x) for x in a_new.new_blocks + b_new.new_blocks] == [[], []]  # neither grows
    assert kv.num_free_blocks == free - 2
    pairs = a_new.blocks_to_copy + b_new.blocks_to_copy
    assert [src for src, _ in pairs] == [shared, shared]
    assert {dst for _, dst in pairs} == {kv.get_block_ids(a.seq_id)[1], kv.get_block_ids("b")[1]}
    assert kv.get_block_ids("c")[1] == shared  # the last holder writes in place
    assert kv.block_pool.blocks[shared].ref_cnt == 1
    # Full block 0 stays shared by all three.
    assert kv.block_pool.blocks[kv.get_block_ids(a.seq_id)[0]].ref_cnt == 3
    assert kv.num_blocks_needed([(c, 1)]) == 0
    assert kv.allocate_slots(c, 1).blocks_to_copy == [] and kv.num_copied_blocks == 2
    kv.check_integrity()
    # One holder gone: the other two share the block, and one copy does.
    for seq in (a, b, c):
        seq.num_computed_tokens += 1
        seq.append_output_token(6)
    d = c.fork("d", 3)
    kv.fork(c, d)
    kv.free(c)
    assert kv.num_blocks_needed([(d, 1)]) == 0  # d holds it alone now
    for seq in (a, b, d):
        kv.free(seq)
    kv.check_integrity()
    assert kv.num_free_blocks == 16


@pytest.mark.parametrize(
    "prompt_len, block_size, n, copies",
    [(10, 4, 3, 2), (10, 4, 2, 1), (9, 4, 4, 3), (8, 4, 3, 0), (7, 1, 3, 0), (5, 16, 4, 3),
     (16, 16, 2, 0)],
)  # fmt: skip
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_copy_on_write_copies_exactly_the_diverging_block(
    prompt_len, block_size, n, copies, prefix_caching
):
    s = make_scheduler(block_size=block_size, prefix_caching=prefix_caching)
    kv = s.kv_cache_manager
    runner = FakeRunner(s)
    r = make_request(prompt_len, n=n, max_tokens=12)
    s.add_request(r)
    group = r.group
    num_prompt_blocks = -(-prompt_len // block_size)

    out, _ = step(s, runner)  # the prompt, and n first tokens: the group forks
    assert out.blocks_to_copy == []
    assert len(group.seqs) == n and sorted(q.sample_index for q in group.seqs) == list(range(n))
    table = kv.get_block_ids(r.seq_id)
    assert len(table) == num_prompt_blocks
    for seq in group.seqs:
        assert kv.get_block_ids(seq.seq_id) == table
    assert all(kv.block_pool.blocks[b].ref_cnt == n for b in table)
    assert kv.num_free_blocks == kv.block_pool.num_blocks - num_prompt_blocks

    out, _ = step(s, runner)  # every sample writes its first token's K/V
    last = table[-1]
    assert [src for src, _ in out.blocks_to_copy] == [last] * copies
    new_tables = {seq.seq_id: kv.get_block_ids(seq.seq_id) for seq in group.seqs}
    assert sorted(dst for _, dst in out.blocks_to_copy) == sorted(
        t[num_prompt_blocks - 1] for t in new_tables.values() if t[num_prompt_blocks - 1] != last
    )
    full = prompt_len // block_size
    for t in new_tables.values():
        assert t[:full] == table[:full]  # full prompt blocks stay shared
    assert kv.num_copied_blocks == copies
    assert len({t[num_prompt_blocks - 1] for t in new_tables.values()}) == (n if copies else 1)

    while s.has_unfinished_requests():
        out, _ = step(s, runner)
        assert out.blocks_to_copy == []  # nothing is shared mid-block any more
        for seq in group.seqs:  # full prompt blocks are shared to the end
            held = kv.get_block_ids(seq.seq_id)[:full]
            assert held == table[:full]
            assert all(kv.block_pool.blocks[b].ref_cnt == len(group.seqs) for b in held)
    assert kv.num_copied_blocks == copies
    assert_all_free(s)
    # The samples diverged, each from its own first token.
    outputs = results([r])[r.request_id]
    assert len(set(outputs)) == n and all(len(o) == 12 for o in outputs)


def test_fork_shares_one_prompt_among_many_samples():
    s = make_scheduler(num_blocks=20, block_size=4)
    runner = FakeRunner(s)
    r = make_request(40, n=8, max_tokens=4)  # 10 prompt blocks; 8 samples need 8 more
    s.add_request(r)
    step(s, runner)
    kv = s.kv_cache_manager
    assert kv.num_logical_blocks == 80 and kv.num_free_blocks == 10
    run(s, runner)
    assert s.num_preemptions_total == 0
    assert_all_free(s)


# -- gang scheduling ------------------------------------------------------------------------------
def test_max_num_seqs_counts_the_sequences_a_group_will_fork_into():
    s = make_scheduler(max_num_seqs=4)
    runner = FakeRunner(s)
    a, b, c = make_request(5, n=3), make_request(5, n=2), make_request(3)
    for r in (a, b, c):
        s.add_request(r)
    out, _ = step(s, runner)
    assert [q.seq_id for q in out.scheduled_requests] == [a.seq_id]  # 3 + 2 > 4; c waits (FCFS)
    assert s.num_running_seqs == 3
    step_until(s, runner, lambda: a.request_id not in s.requests)
    out, _ = step(s, runner)
    assert {q.request_id for q in out.scheduled_requests} == {b.request_id, c.request_id}
    max_running = 0
    while s.has_unfinished_requests():
        step(s, runner)
        max_running = max(max_running, s.num_running_seqs)
    assert max_running == 3
    assert_all_free(s)


def test_beam_group_reserves_its_width_at_admission():
    s = make_scheduler(max_num_seqs=4)
    runner = FakeRunner(s)
    beam, first, second = make_request(5, beam=3), make_request(3), make_request(3)
    for r in (beam, first, second):
        s.add_request(r)
    out, _ = step(s, runner)
    assert [q.request_id for q in out.scheduled_requests] == [beam.request_id, first.request_id]
    run(s, runner)
    assert_all_free(s)


MIXED = [  # (prompt length, kwargs), arrival order
    (10, dict(n=3, max_tokens=14)),
    (9, dict(beam=3, max_tokens=10)),
    (7, dict(n=2, best_of=4, max_tokens=12)),
    (6, dict(max_tokens=16)),
    (12, dict(beam=2, max_tokens=9, length_penalty=0.5)),
    (8, dict(n=2, max_tokens=11)),
]


def run_mixed(prefix_caching, **config):
    s = make_scheduler(prefix_caching=prefix_caching, **config)
    runner = FakeRunner(s)
    requests = [
        make_request(0, prompt=[1 + h("mixed", i, j) % (VOCAB - 1) for j in range(p)], **kw)
        for i, (p, kw) in enumerate(MIXED)
    ]
    for i, r in enumerate(requests):
        r.request.arrival_time = float(i)
        s.add_request(r)
    outs = run(s, runner)
    assert_all_free(s)
    # Key by position, since request ids differ between runs.
    res = results(requests)
    return [res[r.request_id] for r in requests], s, outs


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize(
    "config",
    [dict(num_blocks=30), dict(num_blocks=24, budget=7), dict(num_blocks=120, block_size=1)],
    ids=["small-pool", "small-pool-chunked", "bs1-small-pool"],
)
def test_gang_preemption_and_resume_give_the_same_tokens(prefix_caching, config):
    big = dict(config, num_blocks=400)
    expected, s_big, _ = run_mixed(prefix_caching, **big)
    assert s_big.num_preemptions_total == 0
    got, s, outs = run_mixed(prefix_caching, **config)
    assert got == expected
    assert s.num_preemptions_total > 0
    assert any(out.preempted_request_ids for out in outs)
    # Beam groups came out of the runs the same as the beam search alone.
    for (_, kw), hyps in zip(MIXED, got, strict=True):
        if "beam" in kw:
            state, _ = run_ours(beam_model, kw["beam"], kw["max_tokens"],
                                kw.get("length_penalty", 1.0), False, [])  # fmt: skip
            assert hyps == [tuple(hyp.output_token_ids) for hyp in state.finished]


@pytest.mark.parametrize("budget", [64, 6])
def test_preempted_beam_group_resumes_in_lockstep(budget):
    # Each group fits the pool alone even unshared (3 x 5 blocks), not both together.
    s = make_scheduler(num_blocks=16, block_size=4, budget=budget, max_model_len=40)
    runner = FakeRunner(s)
    first = make_request(8, n=3, max_tokens=12, arrival=1.0)
    beam = make_request(6, beam=3, max_tokens=12, arrival=2.0)
    s.add_request(first)
    s.add_request(beam)
    step_until(s, runner, lambda: beam.status == SequenceStatus.PREEMPTED)
    assert len(beam.group.seqs) == 3 and beam.num_output_tokens > 0
    run(s, runner)
    state, _ = run_ours(beam_model, 3, 12, 1.0, False, [])
    assert results([beam])[beam.request_id] == [tuple(h.output_token_ids) for h in state.finished]
    assert_all_free(s)


def test_preempted_group_releases_every_sequence_and_resumes_together():
    s = make_scheduler(num_blocks=20, block_size=4, max_model_len=40)
    runner = FakeRunner(s)
    first = make_request(8, n=2, max_tokens=16, arrival=1.0)
    second = make_request(6, n=3, max_tokens=16, arrival=2.0)
    s.add_request(first)
    s.add_request(second)
    step_until(s, runner, lambda: second.status == SequenceStatus.PREEMPTED)
    kv = s.kv_cache_manager
    group = second.group
    assert len(group.seqs) == 3 and group.num_preemptions == 1
    assert all(q.status == SequenceStatus.PREEMPTED for q in group.seqs)
    assert not any(q.seq_id in kv.req_to_blocks for q in group.seqs)
    assert s.waiting[0] is group
    while group in s.waiting:
        out, _ = step(s, runner)
    # Resumed as a whole: every sequence was admitted in that step.
    assert {q.seq_id for q in group.seqs} <= {q.seq_id for q in out.scheduled_requests}
    run(s, runner)
    assert [len(q.output_token_ids) for q in group.finished_seqs] == [16, 16, 16]
    assert_all_free(s)


# -- beam search through the scheduler ------------------------------------------------------------
@pytest.mark.parametrize("prompt_len, block_size", [(10, 4), (8, 4), (3, 1), (5, 16)])
def test_beam_search_forks_chosen_beams_and_frees_pruned_ones_in_the_same_step(
    prompt_len, block_size
):
    s = make_scheduler(block_size=block_size, max_model_len=64)
    kv = s.kv_cache_manager
    runner = FakeRunner(s)
    width, max_tokens = 3, 12
    r = make_request(prompt_len, beam=width, max_tokens=max_tokens)
    s.add_request(r)
    group = r.group
    step(s, runner)
    # Step 1: the only beam is chosen `width` times: two forks share all its blocks.
    assert len(group.seqs) == width
    table = kv.get_block_ids(r.seq_id)
    assert all(kv.get_block_ids(b.seq_id) == table for b in group.seqs)
    assert all(kv.block_pool.blocks[b].ref_cnt == width for b in table)
    assert kv.num_copied_blocks == 0
    num_pruned = num_forked = 0
    while s.has_unfinished_requests():
        before = {b.seq_id for b in group.seqs}
        step(s, runner)  # checks free == total - blocks of the live beams, after every step
        after = {b.seq_id for b in group.seqs}
        for seq_id in before - after:
            assert seq_id not in kv.req_to_blocks  # a pruned (or ended) beam holds nothing
        if after:
            assert len(after) == width
            num_pruned += len(before - after)
            num_forked += len(after - before)
    assert num_pruned > 0 and num_forked == num_pruned
    state, _ = run_ours(beam_model, width, max_tokens, 1.0, False, [])
    assert results([r])[r.request_id] == [tuple(h.output_token_ids) for h in state.finished]
    assert [hyp.score for hyp in group.beam.finished] == [hyp.score for hyp in state.finished]
    assert r.group.is_finished()
    assert_all_free(s)


def test_beam_search_with_eos_ends_hypotheses_and_frees_everything():
    s = make_scheduler()
    runner = FakeRunner(s)
    r = make_request(6, beam=2, max_tokens=20, ignore_eos=False, early_stopping=True)
    s.add_request(r)
    run(s, runner)
    state, _ = run_ours(beam_model, 2, 20, 1.0, True, [EOS])
    assert [h.output_token_ids for h in r.group.beam.finished] == [
        h.output_token_ids for h in state.finished
    ]
    assert any(h.finish_reason == "stop" for h in r.group.beam.finished)
    assert_all_free(s)


# -- stopping one sample, aborting a group ------------------------------------------------------
def test_finish_seq_frees_one_sample_and_the_group_goes_on():
    s = make_scheduler()
    kv = s.kv_cache_manager
    runner = FakeRunner(s)
    r = make_request(10, n=3, max_tokens=10)
    s.add_request(r)
    for _ in range(6):
        step(s, runner)
    group = r.group
    victim = group.seqs[1]
    own = [b for b in kv.get_block_ids(victim.seq_id) if kv.block_pool.blocks[b].ref_cnt == 1]
    assert own  # its copied block and the blocks it grew alone
    free = kv.num_free_blocks
    s.finish_seq(victim, SequenceStatus.FINISHED_STOPPED)
    s.check_integrity()
    assert kv.num_free_blocks == free + len(own)
    assert victim.seq_id not in kv.req_to_blocks and victim in group.finished_seqs
    assert s.num_running_seqs == 2 and group in s.running
    run(s, runner)
    assert len(group.finished_seqs) == 3 and not group.seqs
    assert victim.num_output_tokens == 6
    assert_all_free(s)


def test_samples_stopping_on_eos_including_on_the_first_token():
    s = make_scheduler()
    runner = FakeRunner(s, eos_every=4)
    requests = [make_request(p, n=4, max_tokens=10, ignore_eos=False) for p in (5, 8, 9, 11)]
    for r in requests:
        s.add_request(r)
    run(s, runner)
    stopped = [q for r in requests for q in r.group.finished_seqs if q.output_token_ids[-1] == EOS]
    assert stopped and any(q.num_output_tokens == 1 for q in stopped)
    for q in stopped:
        assert q.status == SequenceStatus.FINISHED_STOPPED
    assert_all_free(s)


def test_abort_frees_running_preempted_and_beam_groups():
    s = make_scheduler(num_blocks=16, block_size=4, max_model_len=40)
    runner = FakeRunner(s)
    a = make_request(10, n=3, max_tokens=20, arrival=1.0)
    b = make_request(9, beam=3, max_tokens=20, arrival=2.0)
    c = make_request(6, n=2, max_tokens=20, arrival=3.0)
    for r in (a, b, c):
        s.add_request(r)
    for _ in range(40):
        step(s, runner)
        if s.num_preemptions_total and any(g.num_preemptions for g in s.waiting):
            break
    preempted = [g for g in s.waiting if g.num_preemptions]
    assert preempted, "the pool should have forced a preemption"
    s.finish_requests([g.request_id for g in preempted], SequenceStatus.FINISHED_ABORTED)
    s.check_integrity()
    for g in preempted:
        assert not g.seqs and all(q.status == SequenceStatus.FINISHED_ABORTED
                                  for q in g.finished_seqs)  # fmt: skip
    step(s, runner)
    s.finish_requests([r.request_id for r in (a, b, c)], SequenceStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert_all_free(s)
    out = s.schedule()
    assert out.is_empty
    assert {a.request_id, b.request_id, c.request_id} <= out.finished_request_ids | {
        g.request_id for g in preempted
    }


@pytest.mark.parametrize("kind", ["samples", "first-token", "beam"])
def test_abort_while_the_step_runs(kind):
    s = make_scheduler()
    runner = FakeRunner(s)
    if kind == "beam":
        r = make_request(10, beam=3, max_tokens=10)
    else:
        r = make_request(10, n=3, max_tokens=10)
    s.add_request(r)
    if kind != "first-token":
        for _ in range(3):
            step(s, runner)
    out = s.schedule()
    output = runner.execute(out)
    s.finish_requests([r.request_id], SequenceStatus.FINISHED_ABORTED)
    assert s.update_from_output(out, output) == []
    assert not s.has_unfinished_requests()
    assert len(r.group.seqs) == 0
    assert_all_free(s)


def test_best_of_accumulates_each_samples_logprob():
    s = make_scheduler()
    runner = FakeRunner(s)
    r = make_request(7, n=2, best_of=4, max_tokens=6)
    s.add_request(r)
    records = {}
    orig = runner.execute

    def execute(so):
        out = orig(so)
        for seq_id, recs in out.logprobs.items():
            records.setdefault(seq_id, []).append(recs)
        return out

    runner.execute = execute
    run(s, runner)
    seqs = r.group.finished_seqs
    assert len(seqs) == 4
    first = records[r.seq_id][0]  # the group's first step: four tokens, one per sample
    for q in seqs:
        later = [recs[0].logprob for recs in records.get(q.seq_id, [])]
        if q is r:
            later = later[1:]
        expected = first[q.sample_index].logprob + sum(later)
        assert q.cumulative_logprob == pytest.approx(expected)
    assert_all_free(s)
