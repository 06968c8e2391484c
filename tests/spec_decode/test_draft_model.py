"""Speculative decoding's draft_model method on tiny random Llamas (float32, batch invariant):
each draft is the draft model's own greedy continuation of the sequence, computed afresh (its
paged KV cache catches up and rolls back correctly); outputs equal those without drafts; the KV
budget is split between the two pools; bad drafts are refused at start-up, naming the flag."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, EngineArgs, SamplingParams, kernels
from pagedllm.engine.arg_utils import create_engine_config
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.worker.drafter import DraftModelProposer
from tests.conftest import save_tiny_llama
from tests.spec_decode.test_speculative_engine import GREEDY, LOOPY, PROMPTS, SEEDED, generate

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")
ENGINE = dict(max_model_len=256, kv_cache_memory="16MiB", dtype="float32")


def save(path, seed):
    """A tiny Llama whose sampled tokens are often its greedy ones (LM head scaled up)."""
    model = save_tiny_llama(path, seed=seed, max_position_embeddings=512)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, draft): two tiny Llamas of one vocabulary that agree on some tokens only."""
    return (save(tmp_path_factory.mktemp("target"), 5),
            save(tmp_path_factory.mktemp("draft"), 6))  # fmt: skip


def spec(**fields):
    return {"method": "draft_model", "num_speculative_tokens": 4, "disable_by_batch_size": None,
            **fields}  # fmt: skip


def proposer_of(llm) -> DraftModelProposer:
    proposer = llm.llm_engine.executor.driver_worker.model_runner.proposer
    assert isinstance(proposer, DraftModelProposer)
    return proposer


def test_drafts_are_the_draft_models_own_greedy_continuations(tmp_path, models):
    """Stepping by hand with a draft that is int8 codes of the target (close, not equal: both
    accepted and rejected drafts): after every step, each sequence's drafts equal what the
    draft model alone generates greedily from the sequence's tokens."""
    target, _ = models
    engine = LLMEngine(EngineArgs(model=target, speculative_config=spec(quantization="int8"),
                                  block_size=4, **ENGINE))  # fmt: skip
    oracle = LLM(model=target, quantization="int8", **ENGINE)
    seqs = []
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
        seqs.append(engine.scheduler.requests[str(i)].first)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for s in seqs:
            if s.is_finished() or not s.spec_token_ids:
                continue
            params = SamplingParams(temperature=0, max_tokens=len(s.spec_token_ids),
                                    ignore_eos=True)  # fmt: skip
            out = oracle.generate([{"prompt_token_ids": s.all_token_ids}], params, use_tqdm=False)
            assert s.spec_token_ids == out[0].outputs[0].token_ids
            checked += 1
    stats = engine.scheduler.spec_decode_stats
    assert checked > 20 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    engine.scheduler.check_integrity()


@pytest.mark.parametrize(
    "fields, kwargs",
    [
        ({}, {}),  # int4 codes of the target itself
        ({"quantization": "none"}, {"num_gpu_blocks_override": 24, "block_size": 4,
                                    "max_model_len": 96}),
        ({"quantization": "int8"}, {"num_gpu_blocks_override": 24, "block_size": 4,
                                    "max_model_len": 96,
                                    "preemption_mode": "swap"}),
    ],
    ids=["self-int4", "self-none-recompute", "self-int8-swap"],
)  # fmt: skip
def test_outputs_equal_those_without_drafts(models, fields, kwargs):
    target, _ = models
    base = LLM(model=target, **{**ENGINE, **kwargs})
    llm = LLM(model=target, speculative_config=spec(**fields), **{**ENGINE, **kwargs})
    assert generate(llm, GREEDY) == generate(base, GREEDY)
    assert generate(llm, SEEDED) == generate(base, SEEDED)
    stats = llm.llm_engine.scheduler.spec_decode_stats
    assert stats.num_accepted_tokens > 0
    if fields.get("quantization") == "none":  # the draft is the target: every draft holds
        greedy_only = LLM(model=target, speculative_config=spec(**fields), **ENGINE)
        generate(greedy_only, GREEDY)
        stats = greedy_only.llm_engine.scheduler.spec_decode_stats
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    if "num_gpu_blocks_override" in kwargs:
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
    llm.llm_engine.scheduler.check_integrity()


def test_another_model_drafts_and_the_kv_budget_is_split(models):
    target, draft = models
    base = LLM(model=target, **ENGINE)
    llm = LLM(model=target, speculative_config=spec(model=draft, quantization="none"), **ENGINE)
    # Same architecture: the draft's pool has as many blocks, so each gets half the budget.
    assert llm.llm_engine.num_blocks == base.llm_engine.num_blocks // 2
    assert proposer_of(llm).kv.num_blocks == llm.llm_engine.num_blocks
    prompts = [LOOPY + [9, 9], *PROMPTS]
    assert generate(llm, GREEDY, prompts) == generate(base, GREEDY, prompts)
    # The next run's first step tells the drafter the earlier requests finished: only the
    # last one (finished in the last step) still holds draft blocks.
    generate(llm, GREEDY, [LOOPY])
    kv, seqs = proposer_of(llm).kv, proposer_of(llm).seqs
    assert len(seqs) == 1
    assert kv.num_free_blocks + len(kv.get_block_ids(next(iter(seqs)))) == kv.num_blocks


def test_bad_draft_models_are_refused_naming_the_flag(tmp_path, models):
    target, _ = models
    other_vocab = str(tmp_path / "other")
    save_tiny_llama(other_vocab, vocab_size=96)
    cases = [
        (spec(model=other_vocab), "a vocabulary of 96 tokens, the target 128"),
        (spec(model=str(tmp_path / "missing")), "the draft model"),
        (spec(quantization="int3"), "quantization must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": target}, "draft_model's"),
    ]
    for config, message in cases:
        with pytest.raises(ValueError, match="--speculative-config") as e:
            LLM(model=target, speculative_config=config, **ENGINE)
        assert message in str(e.value)
    with pytest.raises(ValueError, match="--tensor-parallel-size 1"):
        create_engine_config(EngineArgs(model=target, speculative_config=spec(),
                                        tensor_parallel_size=2, **ENGINE))  # fmt: skip


def test_drafts_stop_at_max_model_len(models):
    """A request that reaches max_model_len: the draft runs no position past it (its drafts are
    cut to what the step can keep) and the output equals the one without drafts."""
    target, _ = models
    engine = dict(ENGINE, max_model_len=64)
    llm = LLM(model=target, speculative_config=spec(quantization="none"), **engine)
    forward = proposer_of(llm)._forward
    positions = []

    def spy(feeds):
        positions.extend(s.num_computed_tokens + len(f) - 1 for s, f in feeds)
        return forward(feeds)

    proposer_of(llm)._forward = spy
    prompt = [LOOPY * 6]  # 60 tokens: four positions left
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    got = generate(llm, params, prompt)
    assert got == generate(LLM(model=target, **engine), params, prompt)
    assert len(got[0][0][0]) == 4 and positions and max(positions) < 64
