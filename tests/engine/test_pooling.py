"""The pooling runner (embeddings) against HF transformers' hidden states on the same weights
(float32): LAST, MEAN and CLS pooling of prompts split over several chunked-prefill steps, in
a pool too small for all at once, and served from the prefix cache where that is right; normalize
and dimensions; the runner refusing the other kind of request; the pool empty afterwards."""

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.pooling_params import PoolingParams
from tests.conftest import save_tiny_llama

# Prompts of 5 to 70 tokens: several 16-token chunks for the longer ones.
PROMPTS = [[(7 * i + 3 * j) % 900 + 100 for i in range(n)] for j, n in enumerate([5, 37, 70, 16])]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-pooling")
    model = save_tiny_llama(path, vocab_size=1024, max_position_embeddings=256)
    with torch.no_grad():
        hidden = [model.model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]
    return str(path), hidden


def reference(hidden: torch.Tensor, kind: str) -> torch.Tensor:
    return {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[kind]


def make_llm(path, kind, **kwargs):
    kwargs = {"max_num_batched_tokens": 16, "max_model_len": 128, "block_size": 4, **kwargs}
    return LLM(path, dtype="float32", runner="pooling", pooling_type=kind, **kwargs)


def embed(llm, params=None, prompts=PROMPTS):
    return llm.embed([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def check_free(llm):
    kv = llm.llm_engine.scheduler.kv_cache_manager
    assert not llm.llm_engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_pooled_hidden_states_equal_hf(tiny, kind):
    path, hidden = tiny
    llm = make_llm(path, kind)
    outputs = embed(llm, PoolingParams(normalize=False))
    for output, prompt, h in zip(outputs, PROMPTS, hidden, strict=True):
        assert output.finished and output.prompt_token_ids == prompt
        torch.testing.assert_close(output.outputs.data, reference(h, kind), atol=2e-5, rtol=1e-5)
    # Normalized (the default) and cut to 16 dimensions first, as OpenAI's `dimensions`
    cut = embed(llm, PoolingParams(dimensions=16))
    for output, h in zip(cut, hidden, strict=True):
        expected = torch.nn.functional.normalize(reference(h, kind)[:16], dim=-1)
        torch.testing.assert_close(output.outputs.data, expected, atol=2e-5, rtol=1e-5)
        assert output.outputs.embedding == output.outputs.data.tolist()
    check_free(llm)
    # A generation runner's model: the stats say no token was generated.
    assert llm.llm_engine.get_stats()["num_generation_tokens_total"] == 0


@pytest.mark.parametrize("kind", ["MEAN", "LAST"])
def test_tight_pool(tiny, kind):
    """12 blocks (48 tokens) for 12 prompts of up to 37 tokens: they queue for blocks, chunked
    at the budget's edge, and each still pools its own prompt."""
    path, hidden = tiny
    prompts = [p for p in PROMPTS if len(p) <= 48]
    llm = make_llm(path, kind, num_gpu_blocks_override=12, max_model_len=48)
    outputs = embed(llm, PoolingParams(normalize=False), prompts * 4)
    expected = [h for p, h in zip(PROMPTS, hidden, strict=True) if len(p) <= 48] * 4
    for output, h in zip(outputs, expected, strict=True):
        torch.testing.assert_close(output.outputs.data, reference(h, kind), atol=2e-5, rtol=1e-5)
    check_free(llm)


def test_prefix_cache_only_where_it_is_right(tiny):
    """LAST pooling reads only the last position: a repeated prompt takes its cached blocks.
    MEAN needs every position's hidden state: it computes the whole prompt again."""
    path, hidden = tiny
    for kind, hits in (("LAST", True), ("MEAN", False)):
        llm = make_llm(path, kind, enable_prefix_caching=True)
        embed(llm, prompts=PROMPTS[2:3])
        again = embed(llm, PoolingParams(normalize=False), PROMPTS[2:3])[0]
        assert (llm.llm_engine.get_stats()["prefix_cache_hits"] > 0) == hits
        torch.testing.assert_close(again.outputs.data, reference(hidden[2], kind), atol=2e-5,
                                   rtol=1e-5)  # fmt: skip


def test_refusals(tiny):
    path, _ = tiny
    llm = make_llm(path, "LAST")
    with pytest.raises(ValueError, match="pooling runner"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="hidden size 64"):
        embed(llm, PoolingParams(dimensions=65), PROMPTS[:1])
    with pytest.raises(ValueError, match=r"maximum context length is 128 tokens \(max_model_len\)"):
        embed(llm, None, [[5] * 129])
    assert embed(llm, None, [[5] * 128])[0].finished  # a full-length input fits: no output
    with pytest.raises(ValueError, match="dimensions must be an integer"):
        PoolingParams(dimensions=0)
    check_free(llm)
    generator = LLM(path, dtype="float32", max_model_len=128)
    with pytest.raises(ValueError, match="--runner pooling"):
        generator.embed([[1, 2, 3]], use_tqdm=False)
