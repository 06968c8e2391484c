"""A hybrid model (a tiny random Granite 4.0-H: Mamba-2 layers among attention layers, float32)
through the engine, transformers as the oracle: each sequence's recurrent state in a slot of
the state pool, carried across prompt chunks and decode steps, alone and batched, with block
sizes 1 / 16 / 32, after preemption (by recompute: the slot is freed and the prompt recomputed
from a fresh one), and copied to each fork (n seeded samples, beam search). What hybrids cannot
do yet is refused with the reason."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import runner_of
from tests.engine.test_sequence_groups import check_pool, hf_beam_search

transformers = pytest.importorskip("transformers")

PROMPTS = [[(7 * i + 13 * j) % 120 + 3 for j in range(5 + (9 * i) % 17)] for i in range(6)]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, transformers model, its greedy continuation of each prompt, alone)."""
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=0, shared_intermediate_size=96,
        layer_types=["mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=16, max_position_embeddings=256, initializer_range=0.1,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,  # never stops early
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.GraniteMoeHybridForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-granite-hybrid")
    hf.save_pretrained(path)
    with torch.inference_mode():
        want = [
            hf.generate(
                torch.tensor([p]), do_sample=False, max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
            )[0, len(p) :].tolist()
            for p in PROMPTS
        ]  # fmt: skip
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
    llm = make_llm(path, block_size=4)
    n, seed = 3, 77
    params = SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=10, ignore_eos=True)
    forked = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)[0]
    alone = [
        llm.generate(
            [{"prompt_token_ids": PROMPTS[1]}],
            SamplingParams(seed=seed + i, temperature=1.0, max_tokens=10, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
        for i in range(n)
    ]
    assert [c.token_ids for c in forked.outputs] == alone
    assert len({tuple(t) for t in alone}) == n  # the samples differ
    check_pool(llm)


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_transformers(tiny, width):
    """Beams fork and are pruned every step: each keeps its own copy of the state."""
    path, hf, _ = tiny
    llm = make_llm(path, block_size=4)
    prompts = [PROMPTS[2], PROMPTS[4]]
    params = SamplingParams(n=width, use_beam_search=True, temperature=0, max_tokens=10,
                            stop_token_ids=[2])  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        hyps, scores = hf_beam_search(hf, prompt, width, 10, 1.0, False, [2])
        assert [c.token_ids for c in out.outputs] == hyps
        ours = [c.cumulative_logprob / len(c.token_ids) for c in out.outputs]
        assert ours == pytest.approx(scores, abs=1e-4)
    check_pool(llm)
    pool = runner_of(llm.llm_engine).state_pool
    pool.check_integrity()
    assert pool.num_used <= 2 * width  # pruned beams' slots went back
