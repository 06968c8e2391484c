"""A hybrid model (a tiny random Granite 4.0-H: Mamba-2 layers among attention layers; and a
Qwen3-Next: Gated DeltaNet layers; float32) through the engine, transformers as the oracle:
each sequence's recurrent state in a slot of the state pool, carried across prompt chunks and
decode steps, alone and batched, with block sizes 1 / 16 / 32, after preemption (by recompute:
the slot is freed and the prompt recomputed from a fresh one; by swap: the state waits in the
runner's host stash while the blocks are in the swap space, and comes back into any free slot),
and copied to each fork (n seeded samples, beam search; a beam group within its width of
slots). With prefix caching, a prompt's state is checkpointed at its last full block and a
later prompt's hit restores it (its tokens and log-probabilities those of a run without the
cache). What hybrids cannot do yet is refused with the reason."""

from __future__ import annotations

import dataclasses

import pytest

from pagedllm import LLM, SamplingParams
from tests.conftest import hf_greedy, runner_of
from tests.engine.test_sequence_groups import (
    check_beams_equal_hf,
    check_forks_equal_independent_runs,
    check_pool,
    hf_beam_search,
)
from tests.models.test_architectures import ARCHS, BASE, random_hf_model

transformers = pytest.importorskip("transformers")

PROMPTS = [[(7 * i + 13 * j) % 120 + 3 for j in range(5 + (9 * i) % 17)] for i in range(6)]
NEW_TOKENS = 16


# test_architectures.py's hybrids with a third layer: the recurrent kind on both sides of
# attention. Granite 4.0-H (Mamba-2) and Qwen3-Next (Gated DeltaNet, gated attention, experts
# beside a gated shared expert); Qwen3.5's layers are Qwen3-Next's.
THIRD_LAYER = {
    "granite_hybrid": ["mamba", "attention", "mamba"],
    "qwen3_next": ["linear_attention", "full_attention", "linear_attention"],
}


@pytest.fixture(scope="module", params=sorted(THIRD_LAYER))
def tiny(request, tmp_path_factory):
    """(path, transformers model, its greedy continuation of each prompt, alone)."""
    config_cls, model_cls, fields = ARCHS[request.param]
    fields = {**BASE, **fields, "vocab_size": 128, "num_hidden_layers": 3,
              "layer_types": THIRD_LAYER[request.param]}  # fmt: skip
    hf = random_hf_model(config_cls, model_cls, fields)
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
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
    # 16 blocks of 4 for the attention layer: each sequence needs 6-10 of them. (Without
    # prefix caching: with it, a sequence may resume from its prompt's checkpoint, below.)
    llm = make_llm(path, block_size=4, num_gpu_blocks_override=16, max_num_seqs=4,
                   enable_prefix_caching=False)  # fmt: skip
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
    # 10 slots for 5 groups of 2 beams: a step's pruned beams leave before its new beams are
    # forked, so a group never holds more than its width (test_beams_fit_in_max_num_seqs_slots).
    llm = swapping_llm(path, max_num_seqs=10)
    check_beams_equal_hf(llm, hf, PROMPTS[:5], 2, [2])
    assert llm.llm_engine.scheduler.num_swap_preemptions_total > 0
    pool = runner_of(llm.llm_engine).state_pool
    pool.check_integrity()
    assert not pool.stashed


def test_the_state_and_its_checkpoints_are_counted_in_the_memory_budget(tiny):
    """And the features hybrids lack are refused."""
    path, _, _ = tiny
    small, large = (make_llm(path, block_size=4, max_num_seqs=n) for n in (4, 64))
    runner = runner_of(small.llm_engine)
    per_slot = sum(s.conv[0].nbytes + s.ssm[0].nbytes for s in runner.state_pool.layers.values())
    spec = small.llm_engine.kv_cache_spec
    # A slot per sequence, and a prefix-caching checkpoint per slot (as many again: a quarter
    # of the memory holds them).
    cache = small.llm_engine.config.cache
    assert cache.enable_prefix_caching and cache.num_state_checkpoints == 4
    assert all(c.ssm.shape[0] == 4 for c in runner.state_pool.checkpoints.values())
    slots_bytes = (64 - 4) * 2 * per_slot
    assert small.llm_engine.num_blocks - large.llm_engine.num_blocks == pytest.approx(
        slots_bytes / spec.bytes_per_block, abs=1
    )
    off = make_llm(path, block_size=4, max_num_seqs=64, enable_prefix_caching=False)
    assert off.llm_engine.config.cache.num_state_checkpoints == 0
    assert off.llm_engine.num_blocks - large.llm_engine.num_blocks == pytest.approx(
        64 * per_slot / spec.bytes_per_block, abs=1
    )
    assert small.llm_engine.config.scheduler.max_stashed_seqs is None  # recompute: no stash
    with pytest.raises(ValueError, match="hybrid models .* --speculative-config"):
        make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="hybrid models .* --tensor-parallel-size > 1"):
        make_llm(path, tensor_parallel_size=2)
    # An explicit --max-num-seqs is kept: 250 sequences' states fill the memory, and leave no
    # room for one request's blocks.
    kind = small.llm_engine.config.model.arch.recurrent_kind
    with pytest.raises(ValueError, match=f"the {kind} state of --max-num-seqs 250 .* lower --max"):
        make_llm(path, kv_cache_memory=250 * per_slot, max_num_seqs=250)
    # Left at its default, it is lowered to the states that fill half the memory; the
    # checkpoints take up to a quarter.
    config = make_llm(path, kv_cache_memory="2MiB").llm_engine.config
    assert config.scheduler.max_num_seqs == 2**20 // per_slot
    assert config.cache.num_state_checkpoints == 2**19 // per_slot
    config = make_llm(path, kv_cache_memory="2MiB", enable_prefix_caching=False).llm_engine.config
    assert config.scheduler.max_num_seqs == 2**20 // per_slot
    assert config.cache.num_state_checkpoints == 0


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


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beams_fit_in_max_num_seqs_slots(tiny, mode):
    """5 groups of 2 beams in 8 slots: a step's pruned beams give their slots back before its
    new beams are forked, so a group never holds more than its width."""
    path, hf, _ = tiny
    swap = dict(preemption_mode="swap", swap_space=0.001) if mode == "swap" else {}
    llm = make_llm(path, block_size=4, max_num_seqs=8, **swap)
    check_beams_equal_hf(llm, hf, PROMPTS[:5], 2, [2])
    pool = runner_of(llm.llm_engine).state_pool
    assert pool.num_slots == 8
    pool.check_integrity()


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-caching", "caching"])
def test_recomputed_beams_in_chunks_keep_their_states(tiny, prefix_caching):
    """Beam groups preempted by recompute come back in chunks of 5 tokens that their beams
    share: a beam that a step leaves out keeps its slot (only sequences that left lose
    theirs), its beams' scores those of a run without preemption."""
    path, _, _ = tiny
    params = SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=24)
    want = run(make_llm(path, block_size=4, enable_prefix_caching=False), PROMPTS, params)
    llm = make_llm(path, block_size=4, num_gpu_blocks_override=20, max_num_batched_tokens=5,
                   enable_prefix_caching=prefix_caching)  # fmt: skip
    got = run(llm, PROMPTS, params)
    assert tokens(got) == tokens(want)
    assert logprobs(got) == pytest.approx(logprobs(want), abs=1e-4)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0


# -- prefix caching: recurrent-state checkpoints (core/state_checkpoints.py) --------------------
COMMON = [(11 * j + 5) % 120 + 3 for j in range(40)]
FIRST = [COMMON[:37], COMMON[:20] + [5, 6, 7], [9, 8, 7] + COMMON[:30]]  # 37, 23, 33 tokens
SECOND = [p + [40 + i, 50, 60, 70, 80, 90, 100] for i, p in enumerate(FIRST)]  # next turns


def checkpointed(prompt: list[int], block_size: int) -> int:
    """Where a prompt's state is checkpointed: its last full block before its last token."""
    return (len(prompt) - 1) // block_size * block_size


def logprobs(outputs) -> list[float]:
    return [c.cumulative_logprob for o in outputs for c in o.outputs]


def tokens(outputs) -> list[list[int]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def shared(tiny):
    """transformers' greedy continuations of FIRST + SECOND."""
    _, hf, _ = tiny
    return [[hf_greedy(hf, p, NEW_TOKENS)] for p in FIRST + SECOND]


@pytest.mark.parametrize("budget", [None, 5], ids=["whole-prompts", "chunked-5"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_prefix_hits_restore_checkpoints_and_equal_transformers(tiny, shared, block_size, budget):
    """The first run checkpoints each prompt; the second hits there, for the same prompts and
    for their extensions (a chat's next turn), then computes the rest (in chunks of 5 too)."""
    path = tiny[0]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    kwargs = dict(block_size=block_size, max_num_batched_tokens=budget)
    uncached = run(make_llm(path, enable_prefix_caching=False, **kwargs), FIRST + SECOND, params)
    llm = make_llm(path, **kwargs)
    kv = llm.llm_engine.scheduler.kv_cache_manager
    first = run(llm, FIRST, params)
    assert tokens(first) == shared[:3] and kv.prefix_cache_hits == 0
    second = run(llm, FIRST + SECOND, params)
    assert tokens(second) == tokens(first) + shared[3:]
    # Each prompt hit its own checkpoint, and each next turn its first turn's: no deeper (only
    # checkpointed blocks end a hit), no shallower.
    assert kv.prefix_cache_hits == 2 * sum(checkpointed(p, block_size) for p in FIRST) > 0
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] == kv.prefix_cache_hits
    # The tokens hardly depend on the SSM state; the log-probabilities show a lost one (~1e-3).
    assert logprobs(second) == pytest.approx(logprobs(uncached), abs=1e-5)
    # The first turns' checkpoints, and the next turns' own past them (none in a prompt
    # shorter than two blocks).
    firsts = [checkpointed(p, block_size) for p in FIRST]
    nexts = [checkpointed(p, block_size) for p in SECOND]
    assert len(kv.state_checkpoints) == sum(c > 0 for c in firsts) + sum(
        n > c for n, c in zip(nexts, firsts, strict=True)
    )


def test_prefix_hits_under_seeded_samples_and_beams(tiny):
    """n = 3 seeded samples and beam search on top of checkpoint hits: each fork copies the
    restored state."""
    path, hf, _ = tiny
    samples = SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=10, ignore_eos=True,
                             logprobs=0)  # fmt: skip
    uncached = run(make_llm(path, block_size=4, enable_prefix_caching=False), FIRST, samples)
    llm = make_llm(path, block_size=4)
    kv = llm.llm_engine.scheduler.kv_cache_manager
    first = run(llm, FIRST, samples)
    assert kv.prefix_cache_hits == 0
    second = run(llm, FIRST, samples)
    assert kv.prefix_cache_hits == sum(checkpointed(p, 4) for p in FIRST)
    assert tokens(first) == tokens(second) == tokens(uncached)
    assert logprobs(second) == pytest.approx(logprobs(uncached), abs=1e-5)

    beams = SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=10,
                           stop_token_ids=[2])  # fmt: skip
    want = [hf_beam_search(hf, p, 2, 10, 1.0, False, [2]) for p in FIRST[:2]]
    hits = kv.prefix_cache_hits
    for _ in range(2):  # the samples' checkpoints, then the beams' own run's
        for out, (hyps, scores) in zip(run(llm, FIRST[:2], beams), want, strict=True):
            assert [c.token_ids for c in out.outputs] == hyps
            ours = [c.cumulative_logprob / len(c.token_ids) for c in out.outputs]
            assert ours == pytest.approx(scores, abs=1e-4)
    assert kv.prefix_cache_hits == hits + 2 * sum(checkpointed(p, 4) for p in FIRST[:2])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_resume_from_their_checkpoints(tiny, mode):
    """A sequence preempted by recompute hits its own prompt's checkpoint when readmitted (if
    its blocks are still cached); swapping keeps working beside the checkpoints."""
    path, _, want = tiny
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    swap = dict(preemption_mode="swap", swap_space=0.001) if mode == "swap" else {}
    llm = make_llm(path, block_size=4, num_gpu_blocks_override=16, max_num_seqs=4, **swap)
    got = run(llm, PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == want
    alone = run(make_llm(path, block_size=4, enable_prefix_caching=False), PROMPTS, params)
    assert logprobs(got) == pytest.approx(logprobs(alone), abs=1e-5)
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions_total > 0
    if mode == "recompute":
        assert engine.scheduler.kv_cache_manager.prefix_cache_hits > 0


def test_gated_deltanet_prefix_hits_equal_transformers(tmp_path):
    """The same checkpoints for a Qwen3-Next's Gated DeltaNet layers (a conv window and the
    delta rule's S), hits followed by chunks of 5."""
    config_cls, model_cls, fields = ARCHS["qwen3_next"]
    hf = random_hf_model(config_cls, model_cls, {**BASE, **fields, "vocab_size": 128})
    hf.save_pretrained(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = FIRST + SECOND
    uncached = run(make_llm(str(tmp_path), block_size=4, enable_prefix_caching=False), prompts,
                   params)  # fmt: skip
    llm = make_llm(str(tmp_path), block_size=4, max_num_batched_tokens=5)
    run(llm, FIRST, params)
    got = run(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [hf_greedy(hf, p, 12) for p in prompts]
    assert logprobs(got) == pytest.approx(logprobs(uncached), abs=1e-5)
    hits = llm.llm_engine.scheduler.kv_cache_manager.prefix_cache_hits
    assert hits == 2 * sum(checkpointed(p, 4) for p in FIRST)
