"""The engine with contiguous KV reservations (--kv-allocation max|pow2|oracle) computes the
same tokens as with paged blocks: only memory management differs."""

import pytest

from pagedllm import LLM, SamplingParams
from tests.conftest import save_tiny_llama

PROMPTS = [[5, 9, 3], [17, 4, 88, 23, 6, 70, 11, 42, 9, 1, 66], [100], list(range(10, 40))]
OUTPUT_LENS = [20, 5, 33, 12]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path)
    return str(path)


def generate(path, **engine_kwargs):
    llm = LLM(model=path, block_size=4, max_model_len=96, **engine_kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in OUTPUT_LENS]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.num_blocks
    return [o.outputs[0].token_ids for o in outputs], engine


def test_contiguous_policies_give_the_paged_tokens(tiny):
    # 64 blocks of 4: room for 2 Max reservations (96 tokens = 24 blocks each) at a time.
    expected, _ = generate(tiny, num_gpu_blocks_override=64)
    assert [len(t) for t in expected] == OUTPUT_LENS
    for policy in ("max", "pow2", "oracle"):
        got, engine = generate(tiny, num_gpu_blocks_override=64, kv_allocation=policy)
        assert got == expected, policy
        assert engine.scheduler.num_preemptions_total == 0


def test_contiguous_policies_refuse_sequence_groups(tiny):
    llm = LLM(model=tiny, block_size=4, max_model_len=96, kv_allocation="oracle")
    with pytest.raises(ValueError, match="one sequence per request"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(n=2), use_tqdm=False)


def test_unknown_kv_allocation_is_refused(tiny):
    with pytest.raises(ValueError, match="kv_allocation must be one of"):
        LLM(model=tiny, kv_allocation="contiguous")
