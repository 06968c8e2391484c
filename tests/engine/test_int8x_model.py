"""A Q4_K_M file (llama.cpp's most common mixture) on the default integer path: its Q6_K tensors
(a tied embedding, some attn_v and ffn_down) and the qkv products that mix Q4_K with Q6_K are
int8x codes multiplied in integers, no layer stays float, and the prompt's log-probabilities
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
                assert kinds["model.layers.1.self_attn.qkv_proj"] == "int8x"  # Q4_K q, k; Q6_K v
                assert kinds["model.layers.1.mlp.down_proj"] == "int8x"
                assert kinds["lm_head"] == "int8x"  # the tied Q6_K embedding
                assert model.model.embed_tokens.takes_codes  # looked up in the head's codes
            got[dtype] = prompt_logprobs(llm)
        finally:
            llm.shutdown()
    integer, exact = got["auto"], got["float32"]
    # Random weights: the log-probabilities spread by ~0.26 over the prompt; 8-bit activations
    # move them by ~0.002 (a wrong scale or code would move them by the spread).
    assert exact.std() > 0.1
    assert np.abs(integer - exact).mean() < 0.02 * exact.std()
