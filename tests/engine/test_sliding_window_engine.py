"""Sliding-window layers through the whole engine: their blocks are released as requests move on,
so a pool too small for full attention serves long requests, with HF transformers' greedy
tokens. A tiny Qwen2 with two full-attention and two sliding layers (window 8)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.core.kv_cache_manager import NULL_BLOCK
from pagedllm.core.kv_cache_spec import cdiv
from pagedllm.engine.llm_engine import LLMEngine
from tests.conftest import hf_greedy

transformers = pytest.importorskip("transformers")

WINDOW, BLOCK, CHUNK = 8, 4, 8
PROMPTS = [[(7 * i + 3) % 250 + 1 for i in range(30)], [(11 * i + 5) % 250 + 1 for i in range(23)]]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
        initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("qwen2_sliding")
    hf.save_pretrained(path)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    return path, expected


def run(model_dir, num_blocks):
    path, _ = model_dir
    engine = LLMEngine(
        EngineArgs(
            model=str(path), dtype="float32", block_size=BLOCK, num_gpu_blocks_override=num_blocks,
            max_num_batched_tokens=CHUNK, max_model_len=72,
        )
    )  # fmt: skip
    kv = engine.scheduler.kv_cache_manager
    assert [g.sliding_window for g in kv.groups] == [None, WINDOW]  # layers 0-1 | 2-3
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    outputs, peak_used = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        kv.check_integrity()
        peak_used = max(peak_used, num_blocks - kv.num_free_blocks)
        for seq_id, table in kv.groups[1].req_to_blocks.items():
            live = [b for b in table if b is not NULL_BLOCK]
            assert len(live) <= cdiv(WINDOW - 1 + CHUNK, BLOCK) + 1, seq_id
    assert kv.num_free_blocks == num_blocks
    return [outputs[str(i)] for i in range(len(PROMPTS))], peak_used, engine


def test_a_pool_too_small_for_full_attention_gives_hf_tokens(model_dir):
    _, expected = model_dir
    # Full attention would hold 2 x 18 + 2 x 16 = 68 blocks at the end; the sliding group keeps
    # at most 5 per request, so 48 blocks run both at once, without preemption.
    tokens, peak_used, engine = run(model_dir, num_blocks=48)
    assert tokens == expected
    assert engine.scheduler.num_preemptions_total == 0
    assert peak_used <= 18 + 16 + 2 * 5
    # A pool that must preempt and recompute still gives the same tokens.
    tokens, _, engine = run(model_dir, num_blocks=26)
    assert tokens == expected
    assert engine.scheduler.num_preemptions_total > 0
