"""Speculative decoding in the engine, on a tiny random Llama (float32, batch invariant: a row's
logits are the same bit for bit whether it is verified beside drafts or decoded alone, so
outputs must match exactly): greedy and seeded outputs equal those without drafts, token for
token and logprob for logprob, whatever the proposer, batch, chunking, caching or preemption;
unseeded samples follow the same distribution (chi-square); rejected drafts give their blocks
back and never enter the prefix cache."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams, kernels
from pagedllm.core.block_hash import update_block_hashes
from pagedllm.core.kv_cache_spec import cdiv
from tests.conftest import save_tiny_llama

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")

# The tiny model falls into loops quickly, where the proposers' drafts are right; before that,
# they are mostly wrong: both branches of verification run.
LOOPY = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
PROMPTS = [LOOPY, [(11 * j) % 120 + 3 for j in range(37)], [9, 40, 9, 40, 9, 77, 3]]
METHODS = {  # drafts at any batch size (the sampling test runs 800 sequences at once)
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None},
    "suffix": {"method": "suffix", "num_speculative_tokens": 6, "disable_by_batch_size": None},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The LM head scaled up: the same greedy tokens, but a sampled token is often the greedy
    one (probabilities of 0.3-0.9 in its loops instead of about 1/128), so that sampled
    requests accept drafts too."""
    path = tmp_path_factory.mktemp("tiny-llama-spec")
    model = save_tiny_llama(path, seed=5, max_position_embeddings=512)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    model.save_pretrained(path)
    return str(path)


def make_llm(tiny, method=None, **kwargs):
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("kv_cache_memory", "16MiB")
    kwargs.setdefault("dtype", "float32")  # not the default dtype: bfloat16 on some CPUs
    return LLM(model=tiny, speculative_config=METHODS.get(method), **kwargs)


def generate(llm, params, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs] for o in outs]


def spec_stats(llm):
    return llm.llm_engine.scheduler.spec_decode_stats


def assert_both_branches(llm):
    """Drafts were accepted and rejected (the test exercised verification)."""
    stats = spec_stats(llm)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.fixture(scope="module")
def base(tiny):
    return make_llm(tiny)


GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
SEEDED = [
    SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=40, ignore_eos=True, logprobs=1)
    for s in (1, 2, 3)
]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_and_seeded_outputs_equal_those_without_drafts(tiny, base, method):
    llm = make_llm(tiny, method)
    assert generate(llm, GREEDY) == generate(base, GREEDY)
    assert generate(llm, SEEDED) == generate(base, SEEDED)
    # n > 1: each sample speculates on its own, from its own seeded generator.
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=30, ignore_eos=True)
    assert generate(llm, params) == generate(base, params)
    assert_both_branches(llm)
    llm.llm_engine.scheduler.check_integrity()
    assert llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks == llm.llm_engine.num_blocks


def test_rejected_drafts_free_their_blocks_and_are_never_cached(tiny):
    """Stepping by hand with blocks of 2 tokens: between steps a sequence holds blocks for its
    computed tokens only, and every block named in the prefix cache holds verified tokens."""
    llm = make_llm(tiny, "ngram", block_size=2)
    engine = llm.llm_engine
    scheduler, kv = engine.scheduler, engine.scheduler.kv_cache_manager
    seqs = []
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
        seqs.append(scheduler.requests[str(i)].first)
    while engine.has_unfinished_requests():
        engine.step()
        scheduler.check_integrity()
        verified = {h for s in seqs for h in update_block_hashes(s, 2)}
        cached = set(kv.block_pool.cached_block_hash_to_block)
        assert cached <= verified, "a block holding a rejected draft entered the prefix cache"
        for s in seqs:
            if s.is_finished():
                continue
            held = len(kv.get_block_ids(s.seq_id))
            assert held <= cdiv(s.num_computed_tokens, 2), "a rejected draft's block was kept"
    assert_both_branches(llm)
    assert kv.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_batched_tokens": 8, "enable_chunked_prefill": True},  # drafts compete
        {"num_gpu_blocks_override": 24, "block_size": 4, "preemption_mode": "recompute"},
        {"num_gpu_blocks_override": 24, "block_size": 4, "preemption_mode": "swap"},
    ],
    ids=["small-budget", "recompute", "swap"],
)
def test_chunked_preempted_and_cached_outputs_equal_those_without_drafts(tiny, base, kwargs):
    llm = make_llm(tiny, "ngram", max_model_len=96, **kwargs)
    prompts = [*PROMPTS, LOOPY + [9, 9]]  # a prefix-cache hit on the first
    assert generate(llm, GREEDY, prompts) == generate(base, GREEDY, prompts)
    assert generate(llm, SEEDED[0], prompts) == generate(base, SEEDED[0], prompts)
    if "preemption_mode" in kwargs:
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert spec_stats(llm).num_accepted_tokens > 0
    llm.llm_engine.scheduler.check_integrity()


def test_max_tokens_and_stop_tokens_are_never_passed(tiny, base):
    """A step that accepts several tokens keeps only those up to the one that ends the
    sequence; drafts are cut to what max_tokens leaves."""
    prompt = [LOOPY + generate(base, GREEDY, [LOOPY])[0][0][0][:13]]  # inside the loop
    loop = generate(base, GREEDY, prompt)[0][0][0]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3, 5, 13)
    ] + [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[loop[2]])]
    llm = make_llm(tiny, "ngram")
    for p in params:
        got = generate(llm, p, prompt)
        assert got == generate(base, p, prompt)
        length = p.max_tokens if p.max_tokens < 40 else 3  # ends on the stop token
        assert len(got[0][0][0]) == length
    assert spec_stats(llm).num_accepted_tokens > 0


def _chi_square_p(counts_a: list[int], counts_b: list[int]) -> float:
    """p-value of a two-sample chi-square test of homogeneity (torch's regularised incomplete
    gamma is the chi-square survival function)."""
    a, b = torch.tensor(counts_a, dtype=torch.float64), torch.tensor(counts_b, dtype=torch.float64)
    total = a + b
    keep = total > 0
    a, b, total = a[keep], b[keep], total[keep]
    expected_a, expected_b = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    stat = ((a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b).sum()
    dof = len(total) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2))


def test_unseeded_samples_follow_the_target_distribution(tiny, base):
    """Tokens 2-4 of many unseeded samples (the ones drafts can decide), with and without
    speculation: a chi-square test of the same distribution, per position. Drafts of the
    loop the greedy path takes are accepted in many samples and rejected in many others."""
    llm = make_llm(tiny, "ngram")
    params = SamplingParams(n=200, temperature=1.0, max_tokens=4, ignore_eos=True)
    loop = generate(base, GREEDY, [LOOPY])[0][0][0][:13]  # into the greedy path's loop
    prompts = [LOOPY + loop] * 4
    runs = {}
    for name, engine in (("spec", llm), ("base", base)):
        runs[name] = [c[0] for out in generate(engine, params, prompts) for c in out]
    assert_both_branches(llm)
    for position in (1, 2, 3):
        counts = {
            name: [sum(1 for s in samples if s[position] == t) for t in range(128)]
            for name, samples in runs.items()
        }
        p = _chi_square_p(counts["spec"], counts["base"])
        assert p > 1e-3, f"position {position}: p = {p:.2g}"
    # The test can fail: samples that always kept the draft would not pass it.
    forced = [[*s[:2], s[1], s[1]] for s in runs["base"]]
    skewed = [sum(1 for s in forced if s[3] == t) for t in range(128)]
    base_counts = [sum(1 for s in runs["base"] if s[3] == t) for t in range(128)]
    assert _chi_square_p(skewed, base_counts) < 1e-3
