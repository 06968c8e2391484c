"""A hybrid model (a tiny random Granite 4.0-H: Mamba-2 layers among attention layers, float32)
through the engine, transformers as the oracle: each sequence's recurrent state in a slot of
the state pool, carried across prompt chunks and decode steps, alone and batched, with block
sizes 1 / 16 / 32, after preemption (by recompute: the slot is freed and the prompt recomputed
from a fresh one), and copied to each fork (n seeded samples, beam search). What hybrids cannot
do yet is refused with the reason."""

from __future__ import annotations

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


def greedy(llm, prompts=PROMPTS):
    """Greedy outputs, the block pool and state slots checked after every step."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(None, {"prompt_token_ids": p}, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.scheduler.check_integrity()
        runner_of(engine).state_pool.check_integrity()
    outs = [done[i] for i in ids]
    check_pool(llm)
    # Slots come back when the runner hears of their sequences' end, with the next step: at
    # most this call's are held (those that ended in its last step), every earlier one's went.
    assert runner_of(llm.llm_engine).state_pool.num_used <= len(prompts)
    return [o.outputs[0].token_ids for o in outs]


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
    assert small.llm_engine.config.scheduler.preemption_mode == "recompute"
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
