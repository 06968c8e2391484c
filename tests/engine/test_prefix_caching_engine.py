"""Prefix caching end to end on a tiny random Llama: cached blocks are read, never recomputed,
and greedy output equals HF's and the engine's own output without caching."""

import pytest

from pagedllm import LLM, SamplingParams
from tests.conftest import save_tiny_llama
from tests.engine.test_engine_tiny import hf_greedy

COMMON = [(7 * i + 3) % 120 + 3 for i in range(40)]
PROMPTS = [
    COMMON + [11, 12, 13],  # the first: fills the cache
    COMMON[:32],  # the whole prompt hits on a block boundary (32 = 2 x 16 = 8 x 4)
    COMMON + [11, 12, 13],  # the same prompt again
    COMMON[:37] + [90, 91, 92, 93, 94],  # diverges mid-block: a hit ending mid-prompt
    COMMON[:21] + [5, 6],  # a short one
    [100, 101, 102],  # shares nothing
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-prefix")
    model = save_tiny_llama(path)
    return str(path), [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def make_llm(path, **kwargs):
    return LLM(dtype="float32", model=path, kv_cache_memory="8MiB", **kwargs)


def generate(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def check_pool(llm):
    engine = llm.llm_engine
    engine.scheduler.check_integrity()
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == engine.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    return kv


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_size=4),
        dict(block_size=16),
        dict(block_size=1),
        dict(block_size=4, max_num_batched_tokens=24),  # chunked prefill on top of hits
    ],
    ids=["bs4", "bs16", "bs1", "bs4-chunked"],
)
def test_prefix_caching_output_equals_hf_and_uncached(tiny, kwargs):
    path, expected = tiny
    off = make_llm(path, enable_prefix_caching=False, **kwargs)
    assert generate(off, PROMPTS) == expected
    assert check_pool(off).prefix_cache_hits == 0

    # All in one batch: later requests hit blocks the first one writes in the very same step.
    on = make_llm(path, **kwargs)
    assert generate(on, PROMPTS) == expected
    kv = check_pool(on)
    batched_hits = kv.prefix_cache_hits
    assert batched_hits > 0

    # One after another on a fresh engine: each request finds the previous ones' freed blocks.
    seq = make_llm(path, **kwargs)
    got = [generate(seq, [p])[0] for p in PROMPTS]
    assert got == expected
    kv = check_pool(seq)
    bs = kwargs["block_size"]
    # The repeated prompt hits all its full blocks but the one holding its last token.
    assert kv.prefix_cache_hits >= (len(PROMPTS[2]) - 1) // bs * bs
    assert kv.prefix_cache_hits > 0
    assert kv.block_pool.num_cached_blocks > 0

    # Again on the warm cache, then after a reset: the same tokens.
    assert generate(seq, PROMPTS) == expected
    assert seq.reset_prefix_cache() is True
    assert kv.block_pool.num_cached_blocks == 0
    assert generate(seq, PROMPTS[:2]) == expected[:2]
    check_pool(seq)


def test_preemption_with_prefix_caching_gives_same_tokens(tiny):
    path, expected = tiny
    # A small pool of 1-token blocks: requests are preempted and resume from their cached blocks.
    llm = make_llm(path, block_size=1, num_gpu_blocks_override=90, max_model_len=80)
    assert generate(llm, PROMPTS) == expected
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    check_pool(llm)


def test_cache_salt_blocks_sharing(tiny):
    path, expected = tiny
    llm = make_llm(path, block_size=4)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    kv = engine.scheduler.kv_cache_manager
    outputs = []
    for salt in ["a", "b", "a"]:
        before = kv.prefix_cache_hits
        rid = engine.add_request(None, {"prompt_token_ids": PROMPTS[0]}, params, cache_salt=salt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id == rid:
                    outputs.append(out.outputs[0].token_ids)
        outputs_hit = kv.prefix_cache_hits - before
        assert (outputs_hit > 0) == (salt == "a" and len(outputs) == 3)
    assert outputs == [expected[0]] * 3
    check_pool(llm)
