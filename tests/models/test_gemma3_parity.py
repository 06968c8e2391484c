"""Our Gemma 3 vs HF transformers' on tiny random configs saved with save_pretrained, loaded from
the directory (safetensors) and from a GGUF written as llama.cpp does: prefill logits and greedy
decoding through the paged cache, with sliding windows shorter than the sequences."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.gemma3 import modeling_gemma3

from pagedllm.model_loader import load_model
from pagedllm.model_loader.hf_config import config_from_hf
from pagedllm.models import Gemma3ForCausalLM, get_model_class
from tests.model_loader.tiny_gguf import write_gemma3_gguf
from tests.models.paged_runner import PagedRunner, Req

S, F = "sliding_attention", "full_attention"
CONFIGS = {
    # Mixed layers, a local RoPE base and a scaled global one, query_pre_attn_scalar != head_dim.
    "mixed": dict(
        num_hidden_layers=4,
        layer_types=[S, F, S, S],
        sliding_window=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        query_pre_attn_scalar=24,
        rope_parameters={
            S: {"rope_type": "default", "rope_theta": 100.0},
            F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        },
    ),
    # Both soft-caps (small, so they bite), MQA, untied lm_head, a full layer first.
    "softcap": dict(
        num_hidden_layers=3,
        layer_types=[F, S, S],
        sliding_window=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        final_logit_softcapping=2.0,
        attn_logit_softcapping=1.0,
        tie_word_embeddings=False,
    ),
    # What a llama.cpp GGUF can describe: one full layer in 6, local base 10000,
    # query_pre_attn_scalar == head_dim, linear scaling on the global RoPE.
    "llama_cpp": dict(
        num_hidden_layers=6,
        sliding_window=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        query_pre_attn_scalar=32,
        rope_parameters={
            S: {"rope_type": "default", "rope_theta": 10000.0},
            F: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        },
    ),
}
PROMPTS = [[3, 17, 42, 8, 99, 5, 61], [7, 1, 2], [11, 23, 5, 90, 64, 33, 2, 8, 77, 15, 4, 40, 9]]
MAX_NEW_TOKENS = 32
ATOL = 1e-4


def _softcapped_eager(module, query, key, value, attention_mask, **kwargs):
    # HF's Gemma3Attention never passes attn_logit_softcapping to the attention function (Gemma
    # 3 checkpoints leave it null); the reference applies it with HF's own eager soft-capping.
    kwargs["softcap"] = module.config.attn_logit_softcapping
    return modeling_gemma3.eager_attention_forward(
        module, query, key, value, attention_mask, **kwargs
    )


transformers.AttentionInterface.register("softcapped_eager", _softcapped_eager)
AttentionMaskInterface.register("softcapped_eager", eager_mask)


def make_hf_model(name: str, seed: int = 0):
    kwargs = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        head_dim=32,
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,  # greedy decoding runs the full length
        pad_token_id=None,
    )
    kwargs.update(CONFIGS[name])
    config = transformers.Gemma3TextConfig(**kwargs)
    if config.attn_logit_softcapping is not None:
        config._attn_implementation = "softcapped_eager"
    torch.manual_seed(seed)
    hf = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises Gemma norms to 0 (a weight of 1): randomise them
        for pname, p in hf.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn_like(p))
    return hf


@functools.cache
def hf_reference(name: str):
    """(hf model, [(greedy tokens, per-step logits)] per prompt), each prompt generated alone."""
    hf = make_hf_model(name)
    results = []
    for prompt in PROMPTS:
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
                return_dict_in_generate=True,
                output_logits=True,
            )
        results.append((out.sequences[0, len(prompt) :].tolist(), [x[0] for x in out.logits]))
    return hf, results


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (directory with config.json + safetensors, the same model as a GGUF file)."""

    def save(name):
        hf, _ = hf_reference(name)
        directory = tmp_path_factory.mktemp(name)
        hf.save_pretrained(directory)
        gguf_path = directory.parent / f"{name}.gguf"
        return directory, write_gemma3_gguf(gguf_path, hf, all_keys=name != "llama_cpp")

    return functools.cache(save)


def load_ours(path, backend="auto") -> Gemma3ForCausalLM:
    loaded = load_model(str(path))
    model = get_model_class(loaded.config.architecture)(loaded.config, attention_backend=backend)
    model.load_weights(loaded.weights.items())
    return model.eval()


def prefill_logits(model, prompts) -> list[torch.Tensor]:
    runner = PagedRunner(model, block_size=4)
    hidden = runner.step([(Req(list(p), len(p)), len(p)) for p in prompts])
    logits = model.compute_logits(hidden)
    return list(logits.split([len(p) for p in prompts]))


# The llama_cpp GGUF has only the keys llama.cpp's converter writes; the others all of them.
FORMATS = [
    ("mixed", "safetensors"),
    ("softcap", "safetensors"),
    ("llama_cpp", "gguf"),
    ("mixed", "gguf"),
    ("softcap", "gguf"),
]


@pytest.mark.parametrize(("name", "fmt"), FORMATS)
def test_config_loaded(saved, name, fmt):
    directory, gguf_path = saved(name)
    hf = hf_reference(name)[0]
    c = load_model(str(directory if fmt == "safetensors" else gguf_path)).config
    assert c.architecture == "Gemma3ForCausalLM"
    assert c.layer_types == hf.config.layer_types and c.sliding_window == hf.config.sliding_window
    assert c.rope_local_base_freq == hf.config.rope_parameters[S]["rope_theta"]
    assert c.rope_theta == hf.config.rope_parameters[F]["rope_theta"]
    assert c.query_pre_attn_scalar == pytest.approx(hf.config.query_pre_attn_scalar, rel=1e-6)
    assert c.final_logit_softcapping == hf.config.final_logit_softcapping
    assert c.attn_logit_softcapping == hf.config.attn_logit_softcapping
    assert c.tie_word_embeddings == hf.config.tie_word_embeddings


@pytest.mark.parametrize(("name", "fmt"), FORMATS)
def test_prefill_logits_match_hf(saved, name, fmt):
    hf, _ = hf_reference(name)
    directory, gguf_path = saved(name)
    model = load_ours(directory if fmt == "safetensors" else gguf_path)
    with torch.inference_mode():
        ours = prefill_logits(model, PROMPTS)
        for prompt, got in zip(PROMPTS, ours, strict=True):
            expected = hf(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_sliding_window_and_softcaps_matter(saved):
    """The tests above would not notice a window, a RoPE table or a cap being ignored, unless
    ignoring it changed the logits: check that it does."""
    directory, _ = saved("softcap")
    loaded = load_model(str(directory))
    with torch.inference_mode():
        base = prefill_logits(load_ours(directory), PROMPTS[2:])[0]
        for change in (
            dict(sliding_window=None),
            dict(attn_logit_softcapping=None),
            dict(final_logit_softcapping=None),
            dict(rope_local_base_freq=5000.0),
        ):
            config = loaded.config.__class__(**{**vars(loaded.config), **change})
            model = Gemma3ForCausalLM(config)
            model.load_weights(loaded.weights.items())
            assert (prefill_logits(model, PROMPTS[2:])[0] - base).abs().max() > 1e-2, change


def test_built_in_bfloat16_is_the_float32_model_cast(saved):
    """Built in bfloat16 (the engine's way: the rotary tables and the embedding scale made in
    it) is the float32 model cast to it (the way before), bit for bit."""
    directory, _ = saved("mixed")
    loaded = load_model(str(directory))
    cast = Gemma3ForCausalLM(loaded.config)
    cast.load_weights(loaded.weights.items())
    cast = cast.to(torch.bfloat16).eval()
    built = Gemma3ForCausalLM(loaded.config, dtype=torch.bfloat16).eval()
    built.load_weights(loaded.weights.items())
    assert built.model.embed_scale.dtype == torch.bfloat16
    with torch.inference_mode():
        for a, b in zip(prefill_logits(built, PROMPTS), prefill_logits(cast, PROMPTS), strict=True):
            assert torch.equal(a, b)


# (block_size, prompt chunk sizes): whole prompts batched together, or prompts prefilled in
# chunks while the other requests already decode (mixed prefill + decode steps).
SCHEDULES = {"batched": (16, None), "chunked": (4, [3, 2, 5]), "block1": (1, [4, 3, 6])}


@pytest.mark.parametrize("backend", ["sdpa", "torch"])
@pytest.mark.parametrize("schedule", ["chunked", "block1"])
@pytest.mark.parametrize(("name", "fmt"), FORMATS)
def test_greedy_decode_matches_hf(saved, name, fmt, schedule, backend):
    hf, expected = hf_reference(name)
    directory, gguf_path = saved(name)
    block_size, chunk_sizes = SCHEDULES[schedule]
    model = load_ours(directory if fmt == "safetensors" else gguf_path, backend)
    reqs = PagedRunner(model, block_size=block_size).generate(PROMPTS, MAX_NEW_TOKENS, chunk_sizes)
    for i, (req, (hf_tokens, hf_logits)) in enumerate(zip(reqs, expected, strict=True)):
        assert req.token_ids[len(PROMPTS[i]) :] == hf_tokens, f"prompt {i}"
        for step, (ours, theirs) in enumerate(zip(req.logits, hf_logits, strict=True)):
            torch.testing.assert_close(
                ours, theirs, atol=ATOL, rtol=0, msg=f"prompt {i} step {step}"
            )


def test_bfloat16_close_to_hf(saved):
    """bfloat16 weights and activations (the embedding scale rounded to bfloat16 too, as HF)."""
    hf, _ = hf_reference("mixed")
    hf16 = make_hf_model("mixed").to(torch.bfloat16)
    model = load_ours(saved("mixed")[0]).to(torch.bfloat16)
    with torch.inference_mode():
        for prompt, got in zip(PROMPTS, prefill_logits(model, PROMPTS), strict=True):
            expected = hf16(torch.tensor([prompt])).logits[0].float()
            assert got.dtype == torch.float32
            assert (got - expected).abs().max() < 0.05 * expected.abs().max()


def test_config_from_a_transformers_4_config():
    """Older config.json files: flat rope_theta / rope_scaling for the global layers,
    rope_local_base_freq for the sliding ones, and a sliding_window_pattern for the layer types."""
    cfg = dict(
        architectures=["Gemma3ForCausalLM"],
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window=512,
        sliding_window_pattern=6,
        query_pre_attn_scalar=256,
    )
    c = config_from_hf(cfg)
    assert c.layer_types == ([S] * 5 + [F]) * 2
    assert [c.layer_sliding_window(i) for i in (0, 5)] == [512, None]
    assert (c.rope_theta, c.rope_local_base_freq) == (1000000.0, 10000.0)
    assert c.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert c.tie_word_embeddings and c.final_logit_softcapping is None
    multimodal = dict(cfg, architectures=["Gemma3ForConditionalGeneration"])
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration.*not supported"):
        config_from_hf(multimodal)


def test_gguf_defaults_follow_llama_cpp():
    """Without the optional keys: one full layer in 6, local base 10000, the attention scaled by
    head_dim ** -0.5, except for the 27B model (62 layers) where llama.cpp uses hidden / heads."""
    from pagedllm.config import ModelArchConfig
    from pagedllm.model_loader.gguf_config import _gemma3_config

    config = ModelArchConfig("Gemma3ForCausalLM", 262144, 5376, 21504, 62, 32, 16, 128)
    _gemma3_config({"gemma3.attention.sliding_window": 1024}, config)
    assert config.layer_types[:6] == [S] * 5 + [F] and len(config.layer_types) == 62
    assert (config.sliding_window, config.rope_local_base_freq) == (1024, 10000.0)
    assert config.query_pre_attn_scalar == 168
    config = ModelArchConfig("Gemma3ForCausalLM", 262144, 1152, 6912, 26, 4, 1, 256)
    _gemma3_config({"gemma3.attention.sliding_window": 512}, config)
    assert config.query_pre_attn_scalar == 256
    with pytest.raises(ValueError, match="sliding_window"):
        _gemma3_config({}, config)
