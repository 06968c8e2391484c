"""A hybrid model's prefix caching, the scheduler's side (core/state_checkpoints.py): a prompt's
chunk ends at its checkpoint and the step saves it; a hit ends at a checkpointed block and
restores it; the index is bounded (least recently used first out) and a checkpoint goes with
its evicted block. No torch."""

from __future__ import annotations

import itertools

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.core.state_checkpoints import StateCheckpoints
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence

_ids = itertools.count()
BS = 4


def make_request(prompt, max_tokens=2) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence.of(f"c{next(_ids)}", list(prompt), params, eos_token_ids=[0])


def make_scheduler(num_checkpoints=4, num_blocks=64, budget=64, chunked=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, num_state_checkpoints=num_checkpoints)
    return Scheduler(SchedulerConfig(8, budget, 64, chunked), kv)


def step(s: Scheduler):
    out = s.schedule()
    sampled = {r.seq_id: [7] for r in out.scheduled_requests if out.needs_sample(r)}
    s.update_from_output(out, ModelRunnerOutput(sampled))
    s.check_integrity()  # the checkpoint index's too
    return out


def run(s: Scheduler, *requests: Sequence) -> list:
    """Every step's output until the requests are done."""
    for r in requests:
        s.add_request(r)
    outs = []
    while s.has_unfinished_requests():
        outs.append(step(s))
    return outs


def checkpoints(s: Scheduler) -> StateCheckpoints:
    return s.kv_cache_manager.state_checkpoints


PROMPT = list(range(100, 111))  # 11 tokens: checkpointed at 8 (its last full block of 4)


@pytest.mark.parametrize("chunked", [True, False])
def test_a_prompt_chunk_ends_at_its_checkpoint_which_the_step_saves(chunked):
    s = make_scheduler(chunked=chunked)
    a = make_request(PROMPT)
    first, second, *_ = run(s, a)
    assert first.num_scheduled_tokens == {a.seq_id: 8}  # cut at the checkpoint
    assert first.state_checkpoint_saves == [(a.seq_id, 0)] and not first.state_checkpoint_loads
    assert second.num_scheduled_tokens == {a.seq_id: 3} and not second.state_checkpoint_saves
    assert a.block_hashes[1] in checkpoints(s) and len(checkpoints(s)) == 1
    # Without checkpoints (not a hybrid, or no prefix caching) the prompt runs whole.
    plain = Scheduler(SchedulerConfig(8, 64, 64, chunked), KVCacheManager(64, BS))
    b = make_request(PROMPT)
    assert run(plain, b)[0].num_scheduled_tokens == {b.seq_id: 11}


def test_chunks_that_cross_the_checkpoint_stop_there():
    s = make_scheduler(budget=3)
    a = make_request(PROMPT)
    outs = run(s, a)
    assert [o.num_scheduled_tokens[a.seq_id] for o in outs[:4]] == [3, 3, 2, 3]
    assert [bool(o.state_checkpoint_saves) for o in outs[:4]] == [False, False, True, False]


def test_a_hit_ends_at_a_checkpoint_and_restores_it():
    s = make_scheduler()
    a = make_request(PROMPT)
    run(s, a)
    # The same prompt: a hit up to the checkpoint (8 tokens), restored before the step.
    b = make_request(PROMPT)
    out, *_ = run(s, b)
    assert b.num_computed_tokens > 0 and out.num_scheduled_tokens == {b.seq_id: 3}
    assert out.state_checkpoint_loads == [(b.seq_id, 0)] and not out.state_checkpoint_saves
    assert s.kv_cache_manager.prefix_cache_hits == 8
    # An extension of it (a chat's next turn): the same hit, then its own checkpoint (at 12).
    c = make_request(PROMPT + [5, 6, 7])
    out, *_ = run(s, c)
    assert out.state_checkpoint_loads == [(c.seq_id, 0)]
    assert out.num_scheduled_tokens == {c.seq_id: 4}  # from 8 to its own checkpoint at 12
    assert out.state_checkpoint_saves == [(c.seq_id, 1)]
    assert s.kv_cache_manager.prefix_cache_hits == 16


def test_no_hit_without_a_checkpoint():
    """Cached blocks alone are no hit: only a checkpointed block ends one."""
    s = make_scheduler()
    run(s, make_request(PROMPT))
    kv = s.kv_cache_manager
    assert kv.block_pool.num_cached_blocks >= 2
    # Its first block is cached, but its checkpoint is at its second: nothing to take.
    b = make_request(PROMPT[:5] + [1, 2, 3])
    (hit_blocks,), num_hit = kv.get_computed_blocks(b)
    assert num_hit == 0 and hit_blocks == []
    out, *_ = run(s, b)
    assert not out.state_checkpoint_loads and out.num_scheduled_tokens == {b.seq_id: 4}
    # The whole prompt is never a hit: 8 tokens are checkpointed at 4, and hit there.
    c = make_request(PROMPT[:8])
    run(s, c)
    d = make_request(PROMPT[:8])
    assert kv.get_computed_blocks(d)[1] == 4
    # With a hybrid model's checkpoints gone (reset), no hit at all.
    assert kv.reset_prefix_cache() and len(checkpoints(s)) == 0
    assert kv.get_computed_blocks(make_request(PROMPT))[1] == 0


def test_the_index_keeps_the_most_recently_used_checkpoints():
    s = make_scheduler(num_checkpoints=2)
    a, b, c = (make_request([i] * 11) for i in (1, 2, 3))
    run(s, a)
    run(s, b)
    run(s, make_request([1] * 11))  # a hit on a's: now b's is the least recently used
    run(s, c)  # takes b's slot
    index = checkpoints(s)
    assert len(index) == 2
    assert a.block_hashes[1] in index and c.block_hashes[1] in index
    assert b.block_hashes[1] not in index
    kv = s.kv_cache_manager
    assert kv.get_computed_blocks(make_request([2] * 11))[1] == 0  # b's blocks, but no state
    assert kv.get_computed_blocks(make_request([3] * 11))[1] == 8


def test_a_checkpoint_goes_with_its_evicted_block():
    s = make_scheduler(num_blocks=4)
    a = make_request(PROMPT, max_tokens=1)
    run(s, a)
    assert len(checkpoints(s)) == 1
    # 4 blocks of other tokens evict a's: its checkpoint goes with its block.
    run(s, make_request(list(range(20, 33)), max_tokens=1))
    assert s.kv_cache_manager.block_pool.get_cached_block(a.block_hashes[1]) is None
    assert a.block_hashes[1] not in checkpoints(s)
    assert s.kv_cache_manager.get_computed_blocks(make_request(PROMPT))[1] == 0


def test_freed_sequences_reach_the_next_step_once_collected():
    """The runner frees a hybrid model's state slots of the sequences that left (before the
    step's forks take theirs): the scheduler hands them over with the next step. A manager
    whose frees nobody collects (a draft model's) keeps no list."""
    s = make_scheduler()
    a, b = make_request([1, 2, 3], max_tokens=1), make_request([4, 5, 6], max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    assert not step(s).freed_seqs  # a finishes in this step
    assert step(s).freed_seqs == [a.seq_id]
    assert not step(s).freed_seqs
    assert KVCacheManager(8, BS).freed is None
