"""A hybrid model (a tiny random Granite 4.0-H: Mamba-2 layers among attention layers, float32)
through the engine, transformers as the oracle: each sequence's recurrent state in a slot of
the state pool, carried across prompt chunks and decode steps, alone and batched, with block
sizes 1 / 16 / 32, after preemption (by recompute: the slot is freed and the prompt recomputed
from a fresh one; by swap: the state waits in the runner's host stash while the blocks are in
the swap space, and comes back into any free slot), and copied to each fork (n seeded samples,
beam search). What hybrids cannot do yet is refused with the reason."""

from __future__ import annotations

import dataclasses

import pytest

from pagedllm import LLM, SamplingParams
from tests.conftest import hf_greedy, runner_of
from tests.engine.test_sequence_groups import (
    check_beams_equal_hf,
    check_forks_equal_independent_runs,
    check_pool,
)
from tests.models.test_architectures import ARCHS, BASE, random_hf_model

transformers = pytest.importorskip("transformers")

PROMPTS = [[(7 * i + 13 * j) % 120 + 3 for j in range(5 + (9 * i) % 17)] for i in range(6)]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, transformers model, its greedy continuation of each prompt, alone)."""
    # test_architectures.py's Granite hybrid with a third layer: Mamba on both sides of attention
    config_cls, model_cls, fields = ARCHS["granite_hybrid"]
    fields = {**BASE, **fields, "vocab_size": 128, "num_hidden_layers": 3,
              "layer_types": ["mamba", "attention", "mamba"]}  # fmt: skip
    hf = random_hf_model(config_cls, model_cls, fields)
    path = tmp_path_factory.mktemp("tiny-granite-hybrid")
    hf.save_pretrained(path)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    return str(path), hf, want


def make_llm(path, **kwargs):
    kwargs.setdefault("kv_cache_memory", "16MiB")  # 256 sequences' states (5 MiB) and blocks
    kwargs.setdefault("max_num_seqs", 256)
    return LLM(model=path, dtype="float32", max_model_len=64, **kwargs)


def run(llm, prompts, params, stashed=None):
    """Every request's outputs; the block pool and state slots checked after every step, and
    the state stash holding exactly the swapped-out sequences. `stashed`, a list, receives the
    stash's size after every step."""
    engine, pool = llm.llm_engine, runner_of(llm.llm_engine).state_pool
    ids = [engine.add_request(None, {"prompt_token_ids": p}, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.scheduler.check_integrity()
        pool.check_integrity()
        assert pool.stashed == {q.seq_id for g in engine.scheduler.swapped for q in g.seqs}
        if stashed is not None:
            stashed.append(len(pool.stashed))
    check_pool(llm)
    assert not pool.stashed
    # Slots come back when the runner hears of their sequences' end, with the next step: at
    # most this call's are held (those that ended in its last step), every earlier one's went.
    assert pool.num_used <= sum(len(done[i].outputs) for i in ids)
    return [done[i] for i in ids]


def greedy(llm, prompts=PROMPTS, stashed=None):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in run(llm, prompts, params, stashed)]


@pytest.mark.parametrize("budget", [None, 5], ids=["whole-prompts", "chunked-5"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_greedy_equals_transformers_alone_and_batched(tiny, block_size, budget):
    path, _, want = tiny
    llm = make_llm(path, block_size=block_size, max_num_batched_tokens=budget)
    assert greedy(llm) == want  # batched: prompt chunks beside other sequences' decode rows
    assert greedy(llm, PROMPTS[3:4]) == want[3:4]  # alone, in a slot another sequence used


def test_preemption_recomputes_from_a_fresh_state(tiny):
    path, _, want = tiny
    # 16 blocks of 4 for the attention layer: each sequence needs 6-10 of them.
    llm = make_llm(path, block_size=4, num_gpu_blocks_override=16, max_num_seqs=4)
    assert greedy(llm) == want
    assert llm.llm_engine.scheduler.num_preemptions_total > 0


def swapping_llm(path, num_blocks=16, **kwargs):
    """A pool of `num_blocks` blocks of 4, preempting by swap (0.001 GiB: the swap space is
    capped to the pool)."""
    return make_llm(path, block_size=4, num_gpu_blocks_override=num_blocks,
                    preemption_mode="swap", swap_space=0.001, **kwargs)  # fmt: skip


def test_preemption_by_swap_stashes_the_state_and_restores_it(tiny):
    path, _, want = tiny
    llm = swapping_llm(path, max_num_seqs=4)
    engine = llm.llm_engine
    assert engine.config.scheduler.max_stashed_seqs == 4  # a bound of its own: max_num_seqs
    stashed = []
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    got = [o.outputs[0] for o in run(llm, PROMPTS, params, stashed)]
    assert [c.token_ids for c in got] == want
    # The tiny model's tokens hardly depend on the SSM state (its values are ~1% of the conv
    # state's): the log-probabilities do, where a lost state shows (by ~1e-3).
    alone = [o.outputs[0] for o in run(make_llm(path, block_size=4), PROMPTS, params)]
    assert [c.cumulative_logprob for c in got] == pytest.approx(
        [c.cumulative_logprob for c in alone], abs=1e-5
    )
    scheduler, kv_cache = engine.scheduler, runner_of(engine).kv_cache
    assert scheduler.num_swap_preemptions_total == scheduler.num_preemptions_total > 0
    assert max(stashed) > 0  # states waited in the stash, and came back (run checks it)
    assert kv_cache.num_swapped_out_blocks == kv_cache.num_swapped_in_blocks > 0


def test_a_full_stash_falls_back_to_recompute(tiny):
    """One stashed sequence at most: a second group swapped out meanwhile is recomputed."""
    path, _, want = tiny
    llm = swapping_llm(path, max_num_seqs=4)
    scheduler = llm.llm_engine.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, max_stashed_seqs=1)
    stashed = []
    assert greedy(llm, stashed=stashed) == want
    assert 0 < scheduler.num_swap_preemptions_total < scheduler.num_preemptions_total
    assert max(stashed) == 1


def test_swapped_forked_seeded_samples_equal_an_unconstrained_run(tiny):
    """n = 3 seeded samples of several requests (each sample's tokens its own, whatever the
    batch: test_forked_seeded_samples_equal_independent_runs), with whole groups swapped out
    and back in: each fork's state is stashed and restored, not another's."""
    path, _, _ = tiny
    params = SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=10, ignore_eos=True)
    prompts = PROMPTS[:4]
    want = [[c.token_ids for c in o.outputs] for o in run(make_llm(path), prompts, params)]
    llm = swapping_llm(path, num_blocks=24, max_num_seqs=9)  # a group needs up to 18
    stashed = []
    assert [[c.token_ids for c in o.outputs] for o in run(llm, prompts, params, stashed)] == want
    assert llm.llm_engine.scheduler.num_swap_preemptions_total > 0
    assert max(stashed) > 1  # a forked group's states went out together


def test_swapped_beams_equal_transformers(tiny):
    """Beam groups swapped out and back in whole: each beam's state is its own."""
    path, hf, _ = tiny
    # 20 slots for 5 groups of 2 beams: a step's new beams are forked before the pruned ones
    # leave, so a group holds up to twice its width for that moment.
    llm = swapping_llm(path, max_num_seqs=20)
    check_beams_equal_hf(llm, hf, PROMPTS[:5], 2, [2])
    assert llm.llm_engine.scheduler.num_swap_preemptions_total > 0
    pool = runner_of(llm.llm_engine).state_pool
    pool.check_integrity()
    assert not pool.stashed


def test_the_state_is_counted_in_the_memory_budget_and_features_it_lacks_are_refused(tiny):
    path, _, _ = tiny
    small, large = (make_llm(path, block_size=4, max_num_seqs=n) for n in (4, 64))
    runner = runner_of(small.llm_engine)
    per_slot = sum(s.conv[0].nbytes + s.ssm[0].nbytes for s in runner.state_pool.layers.values())
    spec = small.llm_engine.kv_cache_spec
    slots_bytes = (64 - 4) * per_slot
    assert small.llm_engine.num_blocks - large.llm_engine.num_blocks == pytest.approx(
        slots_bytes / spec.bytes_per_block, abs=1
    )
    cache = small.llm_engine.config.cache
    assert not cache.enable_prefix_caching
    assert small.llm_engine.config.scheduler.max_stashed_seqs is None  # recompute: no stash
    with pytest.raises(ValueError, match="hybrid models .* --speculative-config"):
        make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="hybrid models .* --tensor-parallel-size > 1"):
        make_llm(path, tensor_parallel_size=2)
    # An explicit --max-num-seqs is kept: 250 sequences' states (5 MiB) leave no room for one
    # request's blocks in 5 MiB.
    with pytest.raises(ValueError, match="the Mamba state of --max-num-seqs 250 .* lower --max"):
        make_llm(path, kv_cache_memory="5MiB", max_num_seqs=250)
    # Left at its default, it is lowered to the states that fill half the memory.
    llm = make_llm(path, kv_cache_memory="2MiB")
    assert llm.llm_engine.config.scheduler.max_num_seqs == 2**20 // per_slot


def test_forked_seeded_samples_equal_independent_runs(tiny):
    """n = 3: each fork gets a copy of the prompt's state (a shared one would mix them)."""
    path, _, _ = tiny
    check_forks_equal_independent_runs(make_llm(path, block_size=4), PROMPTS[1])


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_transformers(tiny, width):
    """Beams fork and are pruned every step: each keeps its own copy of the state."""
    path, hf, _ = tiny
    llm = make_llm(path, block_size=4)
    check_beams_equal_hf(llm, hf, [PROMPTS[2], PROMPTS[4]], width, [2])
    pool = runner_of(llm.llm_engine).state_pool
    pool.check_integrity()
    assert pool.num_used <= 2 * width  # pruned beams' slots went back
