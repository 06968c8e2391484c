"""prompt_logprobs equal HF transformers' log-softmax at every prompt position."""

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import save_tiny_llama

PROMPT = [(7 * i + 3) % 125 + 3 for i in range(37)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-prompt-logprobs")
    model = save_tiny_llama(path)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    return str(path), ref


@pytest.mark.parametrize(
    "engine_kwargs",
    [{}, {"max_num_batched_tokens": 8, "max_model_len": 64}],  # the prompt in 8-token chunks
    ids=["one-chunk", "chunked"],
)
def test_prompt_logprobs_equal_hf(tiny, engine_kwargs):
    path, ref = tiny
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory="4MiB", **engine_kwargs)
    # The prompt is cached first: a request asking prompt logprobs must still compute it all.
    llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
    k = 3
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, prompt_logprobs=k), use_tqdm=False)
    plp = out[0].prompt_logprobs
    assert len(plp) == len(PROMPT) and plp[0] is None
    for p in range(1, len(PROMPT)):
        row = ref[p - 1]
        token = PROMPT[p]
        assert plp[p][token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert plp[p][token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(k)
        for rank, (lp, t) in enumerate(zip(top.values, top.indices, strict=True), start=1):
            assert plp[p][int(t)].logprob == pytest.approx(lp.item(), abs=1e-4)
            if int(t) != token:
                assert plp[p][int(t)].rank == rank
        assert len(plp[p]) in (k, k + 1)  # the prompt token, unless it is among the top k
    assert out[0].outputs[0].token_ids  # the request itself still generates


def test_no_prompt_logprobs_unless_asked(tiny):
    path, _ = tiny
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory="4MiB")
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
    assert out[0].prompt_logprobs is None
