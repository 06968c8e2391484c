"""The engine with the Triton attention backend against the torch reference backend.

On CPU the kernels run under Triton's interpreter (tests/conftest.py), on a GPU on CUDA. The
workloads make every kernel work: prompts and decode (attention and the cache write), n > 1
and shared prefixes (copy-on-write block copies), a pool too small for the batch (swapping
through the block copy kernel).
"""

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import runner_of, save_tiny_llama
from tests.engine.test_preemption import check_pools, run_engine

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[(7 * i + 13 * j) % 120 + 3 for j in range(4 + (7 * i) % 12)] for i in range(8)]
SHARED = list(range(20, 45))  # a common prefix of 25 tokens (6 blocks of 4 and one partial)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-triton")
    # head_dim 16, GQA 2: the kernels' smallest tile sizes
    save_tiny_llama(path, num_attention_heads=4, num_key_value_heads=2)
    return str(path)


def make_llm(path, backend, **kwargs):
    return LLM(model=path, dtype="float32", device=DEVICE, attention_backend=backend,
               block_size=4, max_model_len=96, **kwargs)  # fmt: skip


def generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_pools(llm)
    return [[(c.token_ids, [next(iter(lp.values())).logprob for lp in c.logprobs])
             for c in o.outputs] for o in outs]  # fmt: skip


def assert_same(got, expected):
    """Tokens equal; each token's logprob within float32 reordering of the same sums."""
    for g, e in zip(got, expected, strict=True):
        assert [tokens for tokens, _ in g] == [tokens for tokens, _ in e]
        for (_, lp_g), (_, lp_e) in zip(g, e, strict=True):
            torch.testing.assert_close(lp_g, lp_e, atol=1e-4, rtol=0)


def test_greedy_and_parallel_sampling_equal_the_torch_backend(tiny):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    sampled = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=12, ignore_eos=True,
                             logprobs=0)  # fmt: skip
    prompts = PROMPTS + [SHARED + [3], SHARED + [9, 9]]
    results = {}
    for backend in ("torch", "triton"):
        llm = make_llm(tiny, backend, enable_prefix_caching=True)
        results[backend] = (generate(llm, prompts, greedy), generate(llm, prompts[:4], sampled))
        # the n=3 forks copied their last partial block
        assert runner_of(llm.llm_engine).kv_cache.num_copied_blocks > 0
    assert llm.llm_engine.executor.driver_worker.attention_backend == "triton"
    assert runner_of(llm.llm_engine).model.model.layers[0].self_attn.attn.backend.name == "triton"
    assert_same(results["triton"][0], results["torch"][0])
    assert_same(results["triton"][1], results["torch"][1])


def test_swap_preemption_equals_the_torch_backend(tiny):
    params = [SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]  # fmt: skip
    results = {}
    for backend in ("torch", "triton"):
        llm = make_llm(tiny, backend, num_gpu_blocks_override=24, preemption_mode="swap",
                       swap_space=0.001)  # fmt: skip
        results[backend] = run_engine(llm, PROMPTS, params)
        assert llm.llm_engine.scheduler.num_swap_preemptions_total > 0
        assert runner_of(llm.llm_engine).kv_cache.num_swapped_in_blocks > 0
    assert results["triton"] == results["torch"]
