"""Mixture-of-experts models (tiny random Qwen3-MoE and gpt-oss, float32) through every scheduler
feature that touches the KV cache, transformers as the oracle: block sizes 1 / 16 / 32, alone and
batched, chunked prefill with small budgets, preemption by recompute and by swap, n = 3 seeded
samples, beam search, and prefix-cache hits. Routing is per token, so none of these may change a
token's experts: every run must give transformers' tokens."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import hf_greedy
from tests.engine.test_sequence_groups import (
    check_beams_equal_hf,
    check_forks_equal_independent_runs,
    check_pool,
)
from tests.models.test_architectures import random_hf_model

transformers = pytest.importorskip("transformers")

PROMPTS = [[(7 * i + 13 * j) % 120 + 3 for j in range(5 + (9 * i) % 17)] for i in range(6)]
NEW_TOKENS = 16


COMMON = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256,
    initializer_range=0.1, bos_token_id=None, eos_token_id=2, pad_token_id=None,
)  # fmt: skip
MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=96, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True)),
    # A sliding layer of 8 beside a full one, attention sinks, biases, the clamped SwiGLU.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        intermediate_size=32, num_local_experts=8, head_dim=16, sliding_window=8,
        swiglu_limit=2.0)),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(MODELS))
def tiny(request, tmp_path_factory):
    """(path, transformers model, its greedy continuation of each prompt, alone)."""
    config_cls, model_cls, extra = MODELS[request.param]
    hf = random_hf_model(config_cls, model_cls, {**COMMON, **extra})
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf.save_pretrained(path)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    return str(path), hf, want


def make_llm(path, **kwargs):
    kwargs.setdefault("kv_cache_memory", "4MiB")
    return LLM(model=path, dtype="float32", max_model_len=64, **kwargs)


def greedy(llm, prompts=PROMPTS):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_pool(llm)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("budget", [None, 5], ids=["whole-prompts", "chunked-5"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_greedy_equals_transformers_alone_and_batched(tiny, block_size, budget):
    path, _, want = tiny
    llm = make_llm(path, block_size=block_size, max_num_batched_tokens=budget)
    assert greedy(llm) == want  # batched, prefill chunks beside other requests' decode rows
    assert greedy(llm, PROMPTS[:1]) == want[:1]  # alone


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_gives_transformers_tokens(tiny, mode):
    path, hf, want = tiny
    # 16 blocks of 4 a layer group: each request needs 6-10 of them, the six together ~50
    # (gpt-oss has a sliding group beside the full one).
    groups = len(set(getattr(hf.config, "layer_types", None) or ["full_attention"]))
    llm = make_llm(path, block_size=4, num_gpu_blocks_override=16 * groups, preemption_mode=mode,
                   swap_space=0.001)  # fmt: skip
    assert greedy(llm) == want
    scheduler = llm.llm_engine.scheduler
    assert scheduler.num_preemptions_total > 0
    assert (scheduler.num_swap_preemptions_total > 0) == (mode == "swap")


def test_forked_seeded_samples_equal_independent_runs(tiny):
    path, _, _ = tiny
    check_forks_equal_independent_runs(make_llm(path, block_size=4), PROMPTS[1])


def test_beam_search_equals_transformers(tiny):
    path, hf, _ = tiny
    check_beams_equal_hf(make_llm(path, block_size=4), hf, [PROMPTS[2]], 3, [2])


def test_prefix_cache_hit_gives_the_same_tokens(tiny):
    path, _, want = tiny
    llm = make_llm(path, block_size=4, enable_prefix_caching=True)
    kv = llm.llm_engine.scheduler.kv_cache_manager
    assert greedy(llm) == want
    hits = kv.prefix_cache_hits
    assert greedy(llm) == want  # every prompt's full blocks come from the cache
    assert kv.prefix_cache_hits - hits >= sum(len(p) // 4 for p in PROMPTS)


def test_attention_adapters_apply_and_expert_adapters_are_refused(tiny, tmp_path):
    """A peft adapter on the attention projections gives peft's tokens; the experts take none
    (an adapter for an MLP inside a mixture is refused by name)."""
    from safetensors.torch import save_file

    from pagedllm import LoRARequest
    from tests.lora.conftest import hf_greedy as hf_greedy_logprobs
    from tests.lora.conftest import make_adapter

    path, hf, want = tiny
    peft_model = make_adapter(hf, tmp_path / "attn", ["q_proj", "v_proj", "o_proj"])
    expected = hf_greedy_logprobs(peft_model, PROMPTS[0], NEW_TOKENS)[0]
    assert expected != want[0]  # the adapter changes the tokens
    llm = make_llm(path, block_size=4, enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    lora = LoRARequest("attn", 1, str(tmp_path / "attn"))
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, lora_request=lora, use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected
    # An MLP projection's pair as a dense model's adapter holds it (peft makes none for experts).
    (tmp_path / "mlp").mkdir()
    (tmp_path / "mlp/adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    prefix = "base_model.model.model.layers.0.mlp.gate_proj"
    pair = {
        f"{prefix}.lora_A.weight": torch.zeros(4, 64),
        f"{prefix}.lora_B.weight": torch.zeros(96, 4),
    }
    save_file(pair, tmp_path / "mlp/adapter_model.safetensors")
    with pytest.raises(ValueError, match="in a mixture of experts"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False,
                     lora_request=LoRARequest("mlp", 2, str(tmp_path / "mlp")))  # fmt: skip
    check_pool(llm)
