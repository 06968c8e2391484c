"""load_hf_dir on tiny random models saved by transformers itself."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.model_loader import load_hf_dir, load_hf_tokenizer, load_model
from pagedllm.model_loader.hf_config import config_from_hf

from .tiny_gguf import random_hf_weights, write_tiny_llama

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=[2, 5],
)


def _save(path, max_shard_size=None, **overrides):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, **overrides})
    model = transformers.LlamaForCausalLM(config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return model


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_weights_and_config_match_state_dict(tmp_path, sharded):
    model = _save(tmp_path, max_shard_size="20KB" if sharded else None)
    if sharded:
        assert (tmp_path / "model.safetensors.index.json").exists()
        assert len(list(tmp_path.glob("*.safetensors"))) > 2
    loaded = load_hf_dir(tmp_path)
    state = model.state_dict()
    assert set(loaded.weights) == set(state)
    for name, tensor in state.items():
        assert torch.equal(loaded.weights[name], tensor), name
    cfg = loaded.config
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (300, 64, 96)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (3, 4, 2)
    assert cfg.head_dim == 16 and cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 10000.0
    assert cfg.rope_scaling is None and cfg.max_position_embeddings == 128
    assert cfg.tie_word_embeddings is False
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2, 5]
    assert loaded.tokenizer is None and loaded.name == tmp_path.name


def test_tied_embeddings_and_llama3_rope(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    model = _save(tmp_path, tie_word_embeddings=True, rope_parameters=rope, head_dim=32)
    loaded = load_hf_dir(tmp_path)
    assert loaded.config.tie_word_embeddings is True
    assert "lm_head.weight" not in loaded.weights
    assert torch.equal(loaded.weights["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    assert loaded.config.head_dim == 32
    assert loaded.config.rope_theta == 500000.0
    assert loaded.config.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}


def test_transformers4_style_config():
    cfg = config_from_hf(
        {
            "architectures": ["MistralForCausalLM"],
            "sliding_window": None,
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "rope_theta": 1e6,
            "rope_scaling": {"type": "linear", "factor": 2.0},
            "eos_token_id": 2,
        }
    )
    assert cfg.architecture == "MistralForCausalLM"
    assert cfg.num_key_value_heads == 2 and cfg.head_dim == 4
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.eos_token_ids == [2]


def test_unsupported_configs_are_clear_errors():
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16}
    base |= {"num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported.*LlamaForCausalLM"):
        config_from_hf({**base, "architectures": ["GPT2LMHeadModel"]})


def test_mistral_sliding_window_slides_every_layer():
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16}
    base |= {"num_hidden_layers": 2, "num_attention_heads": 2}
    cfg = config_from_hf({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert [cfg.layer_sliding_window(i) for i in range(2)] == [4096, 4096]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    """A tokenizer saved by transformers (tokenizer.json + tokenizer_config.json + template)."""
    d = tmp_path_factory.mktemp("tok")
    write_tiny_llama(d / "t.gguf", random_hf_weights(279))
    hf = transformers.AutoTokenizer.from_pretrained(d, gguf_file="t.gguf")
    out = d / "saved"
    hf.save_pretrained(out)
    return out


def test_tokenizer_from_saved_transformers_tokenizer(hf_tokenizer_dir):
    hf = transformers.AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    ours = load_hf_tokenizer(hf_tokenizer_dir)
    assert (ours.bos_token, ours.eos_token) == (hf.bos_token, hf.eos_token)
    assert ours.chat_template == hf.chat_template and ours.chat_template
    for text in ["hello world", "<|im_start|>user\n 12 é 🎉<|im_end|>", "  the\n\n\n"]:
        assert ours.encode(text) == hf.encode(text)
        assert ours.decode(ours.encode(text)) == hf.decode(
            hf.encode(text), skip_special_tokens=True
        )
    chat = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(chat) == hf.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )


def test_tokenizer_config_sources(hf_tokenizer_dir, tmp_path):
    ours = load_hf_tokenizer(hf_tokenizer_dir)
    d = tmp_path / "t"
    d.mkdir()
    ours.backend.save(str(d / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
        "chat_template": [
            {"name": "default", "template": "D"},
            {"name": "tool_use", "template": "T"},
        ],
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_hf_tokenizer(d)
    assert tok.bos_token == "<|im_start|>" and tok.add_bos_token is True
    assert tok.encode("hello")[0] == tok.bos_token_id
    assert tok.chat_template == "D"
    (d / "chat_template.jinja").write_text("J")
    assert load_hf_tokenizer(d).chat_template == "J"


def test_load_model_with_separate_tokenizer(tmp_path, hf_tokenizer_dir):
    _save(tmp_path)
    loaded = load_model(str(tmp_path), tokenizer=str(hf_tokenizer_dir))
    assert loaded.tokenizer is not None and loaded.tokenizer.eos_token == "<|im_end|>"
