"""Our Llama vs HF transformers' on tiny random configs: prefill logits, greedy decoding through
the paged cache (batched, chunked prefill), bfloat16, weight loading and the registry."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from pagedllm.config import ModelArchConfig
from pagedllm.models import LlamaForCausalLM, get_model_class
from tests.models.paged_runner import PagedRunner, Req

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CONFIGS = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    # head_dim * heads != hidden_size on purpose (like Mistral-Nemo).
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),
    "tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "llama3_rope": dict(num_attention_heads=6, num_key_value_heads=3, rope_parameters=LLAMA3_ROPE),
    "linear_rope": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    ),
    "bias": dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
}
PROMPTS = [[3, 17, 42, 8, 99, 5, 61], [7, 1, 2], [11, 23, 5, 90, 64, 33, 2, 8, 77, 15, 4, 40, 9]]
MAX_NEW_TOKENS = 32
ATOL = 1e-4


def make_hf_model(name: str, seed: int = 0):
    kwargs = dict(
        vocab_size=128,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        max_position_embeddings=256,
        initializer_range=0.1,  # small weights give near-uniform attention, a weak test
        bos_token_id=None,
        eos_token_id=None,  # greedy decoding runs the full length
        pad_token_id=None,
    )
    kwargs.update(CONFIGS[name])
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).eval()
    # HF initialises norms to 1 and biases to 0: randomise them so loading them is tested.
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return hf


def arch_config(hf_config) -> ModelArchConfig:
    rope = dict(hf_config.rope_parameters)
    rope_theta = rope.pop("rope_theta")
    return ModelArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_hidden_layers=hf_config.num_hidden_layers,
        num_attention_heads=hf_config.num_attention_heads,
        num_key_value_heads=hf_config.num_key_value_heads,
        head_dim=hf_config.head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=rope_theta,
        rope_scaling=None if rope["rope_type"] == "default" else rope,
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=hf_config.tie_word_embeddings,
        attention_bias=hf_config.attention_bias,
        mlp_bias=hf_config.mlp_bias,
    )


def make_ours(hf, backend="auto", dtype=torch.float32) -> LlamaForCausalLM:
    model = LlamaForCausalLM(arch_config(hf.config), attention_backend=backend, dtype=dtype)
    model.load_weights(hf.state_dict().items())
    return model.eval()


def hf_generate(hf, prompt: list[int]):
    out = hf.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
        return_dict_in_generate=True,
        output_logits=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), [x[0] for x in out.logits]


@pytest.fixture(autouse=True)
def _inference_mode():
    with torch.inference_mode():
        yield


@functools.cache
def hf_reference(name: str):
    """(hf model, [(greedy tokens, per-step logits)] per prompt), each prompt generated alone."""
    hf = make_hf_model(name)
    return hf, [hf_generate(hf, p) for p in PROMPTS]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_logits_match_hf(name):
    hf, _ = hf_reference(name)
    model = make_ours(hf)
    runner = PagedRunner(model, block_size=4)
    # All prompts in one flattened batch; logits of every position.
    hidden = runner.step([(Req(list(p), len(p)), len(p)) for p in PROMPTS])
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (hidden.shape[0], 128)
    start = 0
    for prompt in PROMPTS:
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits[start : start + len(prompt)], expected, atol=ATOL, rtol=0)
        start += len(prompt)


# (block_size, prompt chunk sizes): whole prompts batched together, or prompts prefilled in
# 3, 2 and 3 chunks while the other requests already decode (mixed prefill + decode steps).
SCHEDULES = {"batched": (16, None), "chunked": (4, [3, 2, 5]), "block1": (1, [4, 3, 6])}


@pytest.mark.parametrize("backend", ["sdpa", "torch"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_decode_matches_hf(name, schedule, backend):
    hf, expected = hf_reference(name)
    block_size, chunk_sizes = SCHEDULES[schedule]
    runner = PagedRunner(make_ours(hf, backend), block_size=block_size, seed=len(name))
    reqs = runner.generate(PROMPTS, MAX_NEW_TOKENS, chunk_sizes)
    for i, (req, (hf_tokens, hf_logits)) in enumerate(zip(reqs, expected, strict=True)):
        assert req.token_ids[len(PROMPTS[i]) :] == hf_tokens, f"prompt {i}"
        for step, (ours, theirs) in enumerate(zip(req.logits, hf_logits, strict=True)):
            torch.testing.assert_close(
                ours, theirs, atol=ATOL, rtol=0, msg=f"prompt {i} step {step}"
            )


def test_bfloat16_close_to_float32():
    hf, _ = hf_reference("gqa")
    fp32, bf16 = make_ours(hf), make_ours(hf, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    reqs = PagedRunner(bf16, block_size=4).generate(PROMPTS, 8, chunk_sizes=[3, 2, 5])
    for req in reqs:
        # Teacher-force the fp32 model on the bf16 model's tokens and compare each step.
        seq = req.token_ids[:-1]
        hidden = PagedRunner(fp32).step([(Req(seq, len(seq)), len(seq))])
        expected = fp32.compute_logits(hidden[req.num_prompt_tokens - 1 :])
        got = torch.stack(req.logits)
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        scale = expected.abs().max()
        assert (got - expected).abs().max() < 0.05 * scale
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.75
    # Building in bf16 (what the engine does) is casting a loaded fp32 model, bit for bit.
    cast = make_ours(hf).to(torch.bfloat16)
    seq = PROMPTS[0]
    a = bf16.compute_logits(PagedRunner(bf16).step([(Req(seq, len(seq)), len(seq))]))
    b = cast.compute_logits(PagedRunner(cast).step([(Req(seq, len(seq)), len(seq))]))
    assert torch.equal(a, b)


def test_load_weights_rejects_bad_checkpoints():
    hf, _ = hf_reference("tied")
    state = hf.state_dict()
    assert "lm_head.weight" in state  # the tied copy is skipped, not an error
    model = LlamaForCausalLM(arch_config(hf.config))
    model.load_weights({**state, "model.rotary_emb.inv_freq": torch.ones(8)})  # a dict works too
    assert model.lm_head.weight is model.model.embed_tokens.weight

    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.mlp.foo.weight'"):
        model.load_weights([("model.layers.0.mlp.foo.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="k_proj.weight' has shape"):
        model.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 96))])
    partial = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.v_proj.weight"}
    with pytest.raises(ValueError, match=r"missing .*model\.layers\.1\.self_attn\.v_proj\.weight"):
        model.load_weights(partial.items())

    untied = LlamaForCausalLM(arch_config(hf_reference("gqa")[0].config))
    gqa_state = {
        k: v for k, v in hf_reference("gqa")[0].state_dict().items() if k != "lm_head.weight"
    }
    with pytest.raises(ValueError, match="missing.*lm_head.weight"):
        untied.load_weights(gqa_state.items())


def test_registry():
    assert get_model_class("LlamaForCausalLM") is LlamaForCausalLM
    assert get_model_class("MistralForCausalLM") is LlamaForCausalLM
    with pytest.raises(ValueError, match="LlamaForCausalLM, MistralForCausalLM"):
        get_model_class("GPT2LMHeadModel")
