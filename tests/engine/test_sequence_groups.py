"""Sequence groups end to end on a tiny random Llama: n seeded samples forked off one prompt,
best_of, beam search against HF transformers, mixed batches, preemption, and the K/V that
copy-on-write copies."""

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.selector import copy_blocks_torch
from pagedllm.config import ModelArchConfig
from pagedllm.worker.kv_cache import KVCache, kv_cache_spec
from tests.conftest import runner_of, save_tiny_llama

EOS = 2
PROMPT_MID = [17, 4, 88, 23, 6, 70, 11, 42, 9, 1]  # 10 tokens: ends mid-block for 4 and 16
PROMPT_16 = [(5 * i + 7) % 120 + 3 for i in range(16)]  # ends on a block boundary for 1, 4, 16
# Prompts (found on this model) whose beams emit EOS (2), and a third one that needs an extra
# stop token for that.
BEAM_PROMPTS = {
    "eos": [100, 7, 33, 64, 12, 9],
    "a": [5, 9, 3, 17, 4, 88, 23, 6, 70, 11],
    "b": list(range(40, 53)),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-groups")
    model = save_tiny_llama(path)
    return str(path), model


def make_llm(path, **kwargs):
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("kv_cache_memory", "4MiB")
    return LLM(model=path, dtype="float32", **kwargs)


def generate(llm, prompts, params):
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_pool(llm)
    return outs


def check_pool(llm):
    engine = llm.llm_engine
    engine.scheduler.check_integrity()
    kv = engine.scheduler.kv_cache_manager
    assert not kv.req_to_blocks
    assert kv.num_free_blocks == engine.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def summary(output):
    """What must match: per completion its index, tokens, finish reason."""
    return [(c.index, c.token_ids, c.finish_reason) for c in output.outputs]


# -- n samples ------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_forked_samples_equal_independent_runs_with_seeds(tiny, block_size, prefix_caching):
    path, _ = tiny
    llm = make_llm(path, block_size=block_size, enable_prefix_caching=prefix_caching)
    n, seed = 3, 1234
    prompts = [PROMPT_MID, PROMPT_16]
    params = SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=10, ignore_eos=True)
    forked = generate(llm, prompts, params)
    runner = runner_of(llm.llm_engine)
    copies = runner.kv_cache.num_copied_blocks
    # Every sample writes its first token into the prompt's last block: mid-block, n - 1 of them
    # copy it; on a boundary nobody does (and with block size 1 never).
    mid = [len(p) % block_size != 0 for p in prompts]
    assert copies == sum(n - 1 for m in mid if m)

    independent = generate(
        llm,
        [p for p in prompts for _ in range(n)],
        [
            SamplingParams(seed=seed + i, temperature=1.0, max_tokens=10, ignore_eos=True)
            for _ in prompts
            for i in range(n)
        ],
    )
    for j, out in enumerate(forked):
        assert [c.index for c in out.outputs] == list(range(n))
        expected = [independent[j * n + i].outputs[0] for i in range(n)]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in expected]
        assert [c.finish_reason for c in out.outputs] == ["length"] * n
        assert len({tuple(c.token_ids) for c in out.outputs}) == n  # the samples differ
    assert (
        runner.kv_cache.num_copied_blocks == copies
    )  # independent requests share nothing mid-block


def test_forked_samples_with_stops_and_stop_tokens(tiny):
    """Samples ending at different times (a stop token the model emits often): each still equals
    its independent run, and the ones that stopped free their blocks at once."""
    path, _ = tiny
    llm = make_llm(path)
    seed, n = 7, 4
    kw = dict(temperature=1.0, max_tokens=24, stop_token_ids=[21, 81, 5])
    (out,) = generate(llm, [PROMPT_MID], SamplingParams(n=n, seed=seed, **kw))
    alone = generate(llm, [PROMPT_MID] * n, [SamplingParams(seed=seed + i, **kw) for i in range(n)])
    assert summary(out) == [(i, o.outputs[0].token_ids, o.outputs[0].finish_reason)
                            for i, o in enumerate(alone)]  # fmt: skip
    assert {c.finish_reason for c in out.outputs} >= {"stop"}


def test_best_of_returns_the_n_most_likely_samples(tiny):
    path, _ = tiny
    llm = make_llm(path)
    n, best_of, seed = 2, 5, 99
    kw = dict(temperature=1.0, max_tokens=8)
    (out,) = generate(llm, [PROMPT_MID], SamplingParams(n=n, best_of=best_of, seed=seed, **kw))
    alone = generate(
        llm,
        [PROMPT_MID] * best_of,
        [SamplingParams(seed=seed + i, logprobs=0, **kw) for i in range(best_of)],
    )
    candidates = sorted((o.outputs[0] for o in alone), key=lambda c: -c.cumulative_logprob)
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in candidates[:n]]
    got = [c.cumulative_logprob for c in out.outputs]
    assert got == pytest.approx([c.cumulative_logprob for c in candidates[:n]], abs=1e-4)
    assert got == sorted(got, reverse=True)
    assert out.outputs[0].logprobs is None  # ranked internally, not asked for


# -- beam search ----------------------------------------------------------------------------------
def hf_beam_search(model, prompt, k, max_tokens, length_penalty, early_stopping, stop_ids):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=k,
        num_return_sequences=k,
        do_sample=False,
        max_new_tokens=max_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=stop_ids,
        output_scores=True,
        return_dict_in_generate=True,
    )
    hyps = []
    for seq in out.sequences[:, len(prompt) :].tolist():
        end = next((i + 1 for i, t in enumerate(seq) if t in stop_ids), len(seq))
        hyps.append(seq[:end])
    return hyps, out.sequences_scores.tolist()


def check_forks_equal_independent_runs(llm, prompt: list[int], n: int = 3, seed: int = 77):
    """n seeded samples forked off one prompt equal n requests seeded seed, seed + 1, ... (and
    differ from each other); the pool is whole after."""
    params = SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=10, ignore_eos=True)
    forked = generate(llm, [prompt], params)[0]
    alone = [
        generate(llm, [prompt], SamplingParams(
            seed=seed + i, temperature=1.0, max_tokens=10, ignore_eos=True))[0].outputs[0].token_ids
        for i in range(n)
    ]  # fmt: skip
    assert [c.token_ids for c in forked.outputs] == alone
    assert len({tuple(t) for t in alone}) == n  # the samples differ


def check_beams_equal_hf(llm, model, prompts: list[list[int]], width: int, stop: list[int]):
    """Beam search of width `width` (10 tokens) on each prompt, batched: transformers' beams and
    scores (length penalty 1); the pool is whole after."""
    params = SamplingParams(n=width, use_beam_search=True, temperature=0, max_tokens=10,
                            stop_token_ids=stop)  # fmt: skip
    for prompt, out in zip(prompts, generate(llm, prompts, params), strict=True):
        hyps, scores = hf_beam_search(model, prompt, width, 10, 1.0, False, stop)
        assert [c.token_ids for c in out.outputs] == hyps
        ours = [c.cumulative_logprob / len(c.token_ids) for c in out.outputs]
        assert ours == pytest.approx(scores, abs=1e-4)


BEAM_CASES = [  # prompt, width, length_penalty, early_stopping, extra stop token ids
    ("eos", 2, 1.0, False, []),
    ("eos", 3, 1.0, "never", []),
    ("eos", 3, 0.0, True, []),
    ("a", 3, 0.5, True, [114]),
    ("a", 4, 2.0, "never", []),
    ("b", 3, 0.0, False, [38]),
    ("b", 2, 1.0, False, []),
]
BEAM_MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hf_beams(tiny):
    _, model = tiny
    return [
        hf_beam_search(model, BEAM_PROMPTS[name], k, BEAM_MAX_TOKENS, lp, es, [EOS, *extra])
        for name, k, lp, es, extra in BEAM_CASES
    ]


@pytest.mark.parametrize("block_size", [4, 1, 16])
def test_beam_search_equals_hf(tiny, hf_beams, block_size):
    path, _ = tiny
    llm = make_llm(path, block_size=block_size)
    max_tokens = BEAM_MAX_TOKENS
    expected = hf_beams
    params = [
        SamplingParams(n=k, use_beam_search=True, temperature=0, max_tokens=max_tokens,
                       length_penalty=lp, early_stopping=es, stop_token_ids=extra)
        for _, k, lp, es, extra in BEAM_CASES
    ]  # fmt: skip
    # All in one batch: each group's beams advance in lockstep next to the others.
    outs = generate(llm, [BEAM_PROMPTS[c[0]] for c in BEAM_CASES], params)
    num_stopped = 0
    for case, out, (hyps, scores) in zip(BEAM_CASES, outs, expected, strict=True):
        _, k, lp, _, extra = case
        assert [c.index for c in out.outputs] == list(range(k))
        assert [c.token_ids for c in out.outputs] == hyps, case
        ours = [c.cumulative_logprob / len(c.token_ids) ** lp for c in out.outputs]
        assert ours == pytest.approx(scores, abs=1e-4), case
        for c in out.outputs:
            stopped = c.token_ids[-1] in (EOS, *extra)
            assert c.finish_reason == ("stop" if stopped else "length")
            assert stopped or len(c.token_ids) == max_tokens
            num_stopped += stopped
    assert num_stopped >= 3  # EOS really was produced, and ended hypotheses early


def test_beam_search_n_smaller_than_width(tiny):
    path, model = tiny
    llm = make_llm(path)
    prompt = BEAM_PROMPTS["eos"]
    hyps, scores = hf_beam_search(model, prompt, 4, 10, 1.0, False, [EOS])
    (out,) = generate(
        llm, [prompt],
        SamplingParams(n=2, best_of=4, use_beam_search=True, temperature=0, max_tokens=10),
    )  # fmt: skip
    assert [c.token_ids for c in out.outputs] == hyps[:2]
    assert [c.cumulative_logprob / len(c.token_ids) for c in out.outputs] == pytest.approx(
        scores[:2], abs=1e-4
    )


# -- mixed batches, preemption ------------------------------------------------------------------
MIXED_PROMPTS = [PROMPT_MID, PROMPT_16, BEAM_PROMPTS["eos"], [3, 1, 4, 1, 5, 9, 2, 6, 5],
                 BEAM_PROMPTS["a"]]  # fmt: skip
MIXED_PARAMS = [
    SamplingParams(temperature=0, max_tokens=14),  # greedy
    SamplingParams(n=3, seed=11, temperature=0.9, max_tokens=14),
    SamplingParams(n=3, use_beam_search=True, temperature=0, max_tokens=12),
    SamplingParams(n=2, best_of=3, seed=5, temperature=1.2, max_tokens=13),
    SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=11, length_penalty=0.5),
]


def results(outs):
    return [summary(o) + [round(c.cumulative_logprob or 0.0, 4) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def alone(tiny):
    """Each mixed request run by itself on a fresh engine."""
    path, _ = tiny
    return [
        results(generate(make_llm(path), [p], params))[0]
        for p, params in zip(MIXED_PROMPTS[:3], MIXED_PARAMS[:3], strict=True)
    ]


def test_mixed_batch_equals_each_request_alone(tiny, alone):
    path, _ = tiny
    llm = make_llm(path)
    together = results(generate(llm, MIXED_PROMPTS[:3], MIXED_PARAMS[:3]))
    assert together == alone
    assert runner_of(llm.llm_engine).kv_cache.num_copied_blocks > 0


def test_step_with_as_many_fork_rows_as_beam_rows_samples_the_right_logits(tiny):
    """One step holding two decoding beams (2 rows out of sampling) and a group's first token
    (n=3: 2 rows in): the row count is unchanged, yet every row must keep its own logits."""
    path, _ = tiny
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    forks = SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True)
    beams = SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [PROMPT_MID, PROMPT_16, BEAM_PROMPTS["a"]]
    want = [summary(o) for o in generate(make_llm(path), prompts, [greedy, forks, beams])]
    llm = make_llm(path)
    engine = llm.llm_engine
    engine.add_request("beam", {"prompt_token_ids": prompts[2]}, beams)
    engine.step()  # prefill: the first beam step leaves two beams
    engine.step()
    assert len(engine.scheduler.requests["beam"].seqs) == 2
    engine.add_request("greedy", {"prompt_token_ids": prompts[0]}, greedy)
    engine.add_request("forks", {"prompt_token_ids": prompts[1]}, forks)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    got = [summary(done[r]) for r in ("greedy", "forks", "beam")]
    assert got == want
    check_pool(llm)


@pytest.mark.parametrize("delta", [False, True])
def test_beam_search_has_one_output_when_it_finishes(tiny, delta):
    """Beams are ranked only at the end: no output before it (not even an empty one), where the
    beam width equals n and where it exceeds it."""
    path, _ = tiny
    engine = make_llm(path).llm_engine
    for best_of in (None, 3):
        params = SamplingParams(n=2, best_of=best_of, use_beam_search=True, temperature=0,
                                max_tokens=5, ignore_eos=True)  # fmt: skip
        engine.add_request("beam", {"prompt_token_ids": BEAM_PROMPTS["a"]}, params, delta=delta)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        (output,) = outputs
        assert output.finished and [c.index for c in output.outputs] == [0, 1]
        assert all(len(c.token_ids) == 5 for c in output.outputs)


@pytest.fixture(scope="module")
def large_pool(tiny):
    """The mixed requests' outputs with a pool large enough for all at once, per block size."""
    path, _ = tiny
    cache = {}

    def get(block_size):
        if block_size not in cache:
            big = make_llm(path, max_model_len=64, block_size=block_size)
            cache[block_size] = results(generate(big, MIXED_PROMPTS, MIXED_PARAMS))
            assert big.llm_engine.scheduler.num_preemptions_total == 0
        return cache[block_size]

    return get


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize(
    "kwargs",
    # The smallest pools the engine accepts for these groups (n=3 of up to 30 tokens): the
    # groups are preempted and resumed, several times.
    [dict(block_size=4, num_gpu_blocks_override=24),
     dict(block_size=4, num_gpu_blocks_override=24, max_num_batched_tokens=9),
     dict(block_size=1, num_gpu_blocks_override=90)],
    ids=["bs4", "bs4-chunked", "bs1"],
)  # fmt: skip
def test_small_pool_preempts_groups_and_gives_the_same_outputs(
    tiny, large_pool, prefix_caching, kwargs
):
    path, _ = tiny
    expected = large_pool(kwargs["block_size"])
    small = make_llm(path, max_model_len=64, enable_prefix_caching=prefix_caching, **kwargs)
    scheduler = small.llm_engine.scheduler
    preempted, preempt = [], scheduler._preempt

    def record(group):
        preempted.append(len(group.seqs))
        return preempt(group)

    scheduler._preempt = record
    got = results(generate(small, MIXED_PROMPTS, MIXED_PARAMS))
    assert scheduler.num_preemptions_total > 0
    assert max(preempted) > 1  # whole groups of several sequences went and came back
    assert got == expected


def test_groups_that_could_never_run_are_rejected(tiny):
    path, _ = tiny
    # Lockstep: all n sequences of a group decode in the same step.
    llm = make_llm(path, max_num_batched_tokens=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(n=5), use_tqdm=False)
    # 4 sequences of up to 64 tokens need 4 x 16 blocks of 4 (after a preemption, with nothing
    # shared); the pool has 40.
    llm = make_llm(path, num_gpu_blocks_override=40, max_model_len=64)
    params = SamplingParams(n=4, max_tokens=None)
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    beam = SamplingParams(n=3, use_beam_search=True, temperature=0, max_tokens=60)
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], beam, use_tqdm=False)
    # What fits runs: 4 x cdiv(3 + 37, 4) = 40 blocks.
    (out,) = generate(llm, [[1, 2, 3]], SamplingParams(n=4, max_tokens=37, ignore_eos=True))
    assert [len(c.token_ids) for c in out.outputs] == [37] * 4


# -- the K/V that copy-on-write copies ------------------------------------------------------------
def test_copy_blocks_copies_every_layer_k_and_v_and_nothing_else():
    config = ModelArchConfig("LlamaForCausalLM", 10, 16, 16, 3, 2, 2, 8)  # 3 layers, 2 x 8
    kv = KVCache(kv_cache_spec(config, 4, torch.float32), 3, 10, 0, torch.float32,
                 torch.device("cpu"), copy_blocks_torch)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    kv.pool.copy_(torch.randn(kv.pool.shape, generator=g))
    before = kv.pool.clone()
    pairs = [(2, 7), (5, 1), (2, 9)]  # one source copied twice
    kv.copy(pairs)
    pool = kv.pool
    for src, dst in pairs:
        for layer, (k, v) in enumerate(kv.layers):
            assert torch.equal(k[dst], before[layer, 0, src])
            assert torch.equal(v[dst], before[layer, 1, src])
    untouched = [b for b in range(10) if b not in {d for _, d in pairs}]
    assert torch.equal(pool[:, :, untouched], before[:, :, untouched])
    assert kv.num_copied_blocks == 3
    # The per-layer views the model writes through are still views of the pool.
    assert kv.layers[1][0].data_ptr() == pool[1, 0].data_ptr()


def test_copy_on_write_block_holds_the_prompt_kv_of_its_source(tiny):
    path, _ = tiny
    llm = make_llm(path, block_size=4)
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    params = SamplingParams(n=2, seed=3, temperature=1.0, max_tokens=6, ignore_eos=True)
    engine.add_request("cow", {"prompt_token_ids": PROMPT_MID}, params)
    engine.step()  # prefill; the group forks on its first tokens
    group = engine.scheduler.requests["cow"]
    a, b = group.seqs
    assert kv.get_block_ids(a.seq_id) == kv.get_block_ids(b.seq_id)
    src = kv.get_block_ids(a.seq_id)[2]  # tokens 8..11: the prompt's 8, 9 and the first token
    pool = runner_of(engine).kv_cache.pool
    prompt_kv = pool[:, :, src, :2].clone()
    engine.step()  # both write their first token: one copies block 2 first
    ta, tb = kv.get_block_ids(a.seq_id), kv.get_block_ids(b.seq_id)
    assert ta[:2] == tb[:2]  # the full prompt blocks stay shared
    assert ta[2] != tb[2] and src in (ta[2], tb[2])
    assert runner_of(engine).kv_cache.num_copied_blocks == 1
    for blocks in (ta, tb):
        # Positions 8 and 9 (the prompt's last two) hold the same K/V in both copies, in
        # every layer, K and V.
        assert torch.equal(pool[:, :, blocks[2], :2], prompt_kv)
        assert pool[:, :, blocks[2], 2].abs().sum() > 0  # position 10: each sample's own
    if a.output_token_ids[0] != b.output_token_ids[0]:
        assert not torch.equal(pool[:, :, ta[2], 2], pool[:, :, tb[2], 2])
    # The same K/V as an unshared request with the same prompt computes.
    alone = make_llm(path, block_size=4).llm_engine
    alone.add_request("x", {"prompt_token_ids": PROMPT_MID}, SamplingParams(max_tokens=2))
    alone.step()
    block = alone.scheduler.kv_cache_manager.get_block_ids("x")[2]
    torch.testing.assert_close(runner_of(alone).kv_cache.pool[:, :, block, :2], prompt_kv)
    while engine.has_unfinished_requests():
        engine.step()
    check_pool(llm)
