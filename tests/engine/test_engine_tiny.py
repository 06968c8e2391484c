"""The whole engine on tiny random Llama models against HF transformers' greedy decoding."""

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import hf_greedy, runner_of, save_tiny_llama

PROMPTS = [[5, 9, 3], [17, 4, 88, 23, 6, 70, 11, 2 + 40, 9, 1, 66], [100], list(range(10, 40))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    model = save_tiny_llama(path)
    expected = [hf_greedy(model, p, 32) for p in PROMPTS]
    return str(path), expected


def run(path, **engine_kwargs):
    llm = LLM(dtype="float32", model=path, kv_cache_memory="8MiB", **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.llm_engine.scheduler.check_integrity()
    assert llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks == llm.llm_engine.num_blocks
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_batched_greedy_equals_hf_for_any_block_size(tiny, block_size):
    path, expected = tiny
    got, _ = run(path, block_size=block_size)
    assert got == expected


def test_chunked_prefill_and_tiny_budget_give_same_tokens(tiny):
    path, expected = tiny
    got, _ = run(path, max_num_batched_tokens=7, block_size=4)
    assert got == expected


def test_preemption_by_recompute_gives_same_tokens(tiny):
    path, expected = tiny
    # 80 blocks of 1 token is ~2 max-length requests: the four prompts cannot all stay resident.
    got, llm = run(path, block_size=1, num_gpu_blocks_override=80, max_model_len=80)
    assert got == expected
    assert llm.llm_engine.scheduler.num_preemptions_total > 0


def test_one_request_at_a_time_equals_batched(tiny):
    path, expected = tiny
    got, _ = run(path, max_num_seqs=1)
    assert got == expected


def test_prompt_too_long_and_bad_token_rejected_without_leaking(tiny):
    path, _ = tiny
    llm = LLM(dtype="float32", model=path, kv_cache_memory="8MiB", max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [3] * 64}, use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate({"prompt_token_ids": [3, 100000]}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    # max_tokens beyond max_model_len is capped by the context, finishing with "length".
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [3] * 60}, params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_kv_cache_too_small_for_max_model_len_fails_at_start(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="raise --num-gpu-blocks-override to at least 16 "):
        LLM(
            dtype="float32", model=path, num_gpu_blocks_override=3, block_size=16, max_model_len=256
        )
    with pytest.raises(ValueError, match=r"raise --kv-cache-memory to at least \d+MiB "):
        LLM(dtype="float32", model=path, kv_cache_memory="4KiB", block_size=16, max_model_len=256)


def test_unknown_engine_argument_is_a_type_error(tiny):
    with pytest.raises(TypeError, match="block_sise"):
        LLM(dtype="float32", model=tiny[0], block_sise=16)


def test_seeded_sampling_does_not_depend_on_the_batch(tiny):
    path, _ = tiny
    llm = LLM(dtype="float32", model=path, kv_cache_memory="8MiB")
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": PROMPTS[1]}, seeded, use_tqdm=False)[0]
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], [noise, seeded, noise, noise], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(set(tuple(o.outputs[0].token_ids) for o in batch)) > 1


def test_logprobs_match_hf_log_softmax(tiny, tmp_path):
    path, _ = tiny
    model = save_tiny_llama(tmp_path)  # same seed: the same weights as `path`
    llm = LLM(dtype="float32", model=path, kv_cache_memory="8MiB")
    # ignore_eos, not min_tokens: masking EOS would make the sampled token differ from the top-1
    # of the raw logprobs (which is what logprobs report, as in vLLM).
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    out = llm.generate({"prompt_token_ids": PROMPTS[1]}, params, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[1] + out.token_ids])).logits[0]
    ref = torch.log_softmax(logits.float(), -1)[len(PROMPTS[1]) - 1 : -1]
    assert len(out.logprobs) == 8
    for step, (token_id, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        top = torch.topk(ref[step], 3)
        assert set(entry) == set(top.indices.tolist())  # greedy: the sampled token is the top-1
        assert entry[token_id].rank == 1
        for tid, lp in entry.items():
            assert abs(lp.logprob - ref[step, tid].item()) < 1e-4
    chosen = [e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True)]
    assert abs(out.cumulative_logprob - sum(chosen)) < 1e-6


def test_profile_run_leaves_the_kv_cache_alone(tiny):
    # The CUDA memory profile runs this pass; on CPU we check it runs and restores the pool.
    llm = LLM(dtype="float32", model=tiny[0], kv_cache_memory="8MiB")
    runner = runner_of(llm.llm_engine)
    before = runner.kv_cache
    runner.profile_run(num_tokens=100, num_logits=8)
    assert runner.kv_cache is before
    assert llm.generate({"prompt_token_ids": PROMPTS[0]}, use_tqdm=False)[0].outputs[0].token_ids


def test_token_counters_count_prefill_and_sampled_tokens(tiny):
    path, _ = tiny
    llm = LLM(dtype="float32", model=path, kv_cache_memory="8MiB", enable_prefix_caching=False,
              max_num_batched_tokens=256)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats["num_prompt_tokens_total"] == sum(len(p) for p in PROMPTS)
    assert stats["num_generation_tokens_total"] == 6 * len(PROMPTS)
    sampled = SamplingParams(n=3, temperature=1, max_tokens=4, ignore_eos=True)
    llm.generate(prompts[0], sampled, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats["num_generation_tokens_total"] == 6 * len(PROMPTS) + 3 * 4
