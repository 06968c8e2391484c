"""A Q4_K_M file (llama.cpp's most common mixture) on the default integer path: its Q6_K tensors
(a tied embedding, some attn_v and ffn_down) and the qkv products that mix Q4_K with Q6_K are
int6 codes multiplied in integers, no layer stays float, and the prompt's log-probabilities
agree with the exact float32 path (`--dtype float32`: gguf's own dequantized weights) within
8-bit activations' rounding."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import random_gguf
from pagedllm import LLM, SamplingParams, kernels
from pagedllm.layers.quantization import Int8ActLinearMethod, UnquantizedLinearMethod

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")

PROMPT = {"prompt_token_ids": [(37 * j) % 49000 + 5 for j in range(40)]}


def prompt_logprobs(llm: LLM) -> np.ndarray:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    return np.array([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])


def test_a_q4_k_m_file_runs_every_layer_in_integers_close_to_float32(tmp_path):
    path = tmp_path / "tiny-q4_k_m.gguf"
    random_gguf.write_random_gguf(path, "tiny", "Q4_K_M", seed=1)  # 2 layers: layer 1 has Q6_K
    got = {}
    for dtype in ("auto", "float32"):
        llm = LLM(model=str(path), dtype=dtype, kv_cache_memory="64MiB", max_model_len=256)
        try:
            if dtype == "auto":
                model = llm.llm_engine.executor.driver_worker.model
                linear = (Int8ActLinearMethod, UnquantizedLinearMethod)
                methods = {
                    name: m.quant_method
                    for name, m in model.named_modules()
                    if isinstance(getattr(m, "quant_method", None), linear)
                }
                assert all(isinstance(m, Int8ActLinearMethod) for m in methods.values()), methods
                kinds = {name: m.kind for name, m in methods.items()}
                assert kinds["model.layers.0.self_attn.qkv_proj"] == "int4"
                assert kinds["model.layers.1.self_attn.qkv_proj"] == "int6"  # Q4_K q, k; Q6_K v
                assert kinds["model.layers.1.mlp.down_proj"] == "int6"
                assert kinds["lm_head"] == "int6"  # the tied Q6_K embedding
                assert not hasattr(model.lm_head, "int8_act_mins")  # Q6_K's: all 0
                assert model.model.embed_tokens.takes_codes  # looked up in the head's codes
            got[dtype] = prompt_logprobs(llm)
        finally:
            llm.shutdown()
    integer, exact = got["auto"], got["float32"]
    # Random weights: the log-probabilities spread by ~0.26 over the prompt; 8-bit activations
    # move them by ~0.002 (a wrong scale or code would move them by the spread).
    assert exact.std() > 0.1
    assert np.abs(integer - exact).mean() < 0.02 * exact.std()


@pytest.mark.parametrize("kind", ["int4", "int8", "int8x"])
def test_an_untied_embedding_keeps_the_checkpoints_codes(kind):
    """Its lookups dequantize the rows they need: the float rows of the whole tensor, bit for
    bit, held in the codes' bytes only."""
    import torch

    from pagedllm.layers.quantization import Int4Weight, Int8Weight, Int8xWeight
    from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding

    torch.manual_seed(7)
    vocab, hidden = 70, 64
    cls = {"int4": Int4Weight, "int8": Int8Weight, "int8x": Int8xWeight}[kind]
    codes = cls.from_float(torch.randn(vocab, hidden))
    embedding = VocabParallelEmbedding(vocab, hidden)
    embedding.take_codes()
    assert embedding.takes_codes
    embedding.weight_loader(embedding.weight, codes)
    assert embedding.weight.numel() == 0 and embedding.nbytes == codes.nbytes
    assert codes.nbytes < vocab * hidden * 4 / 2  # under half of float32's bytes
    floats = VocabParallelEmbedding(vocab, hidden)
    floats.weight_loader(floats.weight, codes.dequantize())
    ids = torch.tensor([0, 1, 15, 16, 69, 5, 5])
    assert torch.equal(embedding(ids), floats(ids))
    with pytest.raises(ValueError):
        embedding.weight_loader(embedding.weight, codes.narrow(0, 0, 32))


def test_an_untied_gguf_embedding_is_held_as_codes_with_the_same_results(tmp_path, monkeypatch):
    """A file with its own LM head: the default path's log-probabilities are the same bit for
    bit whether the embedding holds the file's Q8_0 codes or their float copy."""
    import gguf

    from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from tests.model_loader.tiny_gguf import gpt2_vocab, random_hf_weights, write_tiny_llama

    weights = random_hf_weights(len(gpt2_vocab()[0]), seed=3, lm_head=True)
    path = write_tiny_llama(tmp_path / "untied.gguf", weights, gguf.GGMLQuantizationType.Q8_0)
    prompt = {"prompt_token_ids": [(11 * j) % 120 + 3 for j in range(20)]}
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)  # fmt: skip

    def run() -> tuple[list, list, VocabParallelEmbedding]:
        llm = LLM(model=str(path), kv_cache_memory="64MiB", max_model_len=256)
        try:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            embedding = llm.llm_engine.executor.driver_worker.model.model.embed_tokens
            return out.prompt_logprobs, out.outputs[0].logprobs, embedding
        finally:
            llm.shutdown()

    *held, embedding = run()
    assert embedding.codes is not None and embedding.weight.numel() == 0
    monkeypatch.setattr(VocabParallelEmbedding, "take_codes", lambda self: None)
    *floats, embedding = run()
    assert embedding.codes is None and embedding.weight.numel() > 0
    assert held == floats
