"""The packaged SmolLM2-135M-Instruct GGUF vs transformers loading the very same file."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm.model_loader import DEFAULT_MODEL, load_model, resolve_model

from .test_tokenizer import TEXTS

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

MORE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "   ",
    "\n",
    "x=1;y=22;z=333;print(x+y*z)",
    "It's a test: don't, won't, I'll, we've, they're.",
    "한국어 문장입니다. 띄어쓰기  두 번.",
    "<|endoftext|>after <|im_end|><|im_start|>",
    "<|im_start |> not special",
    "https://example.com/path?q=1&r=2#frag",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": "Arr, ahoy!"},
        {"role": "user", "content": "Where's the treasure?\n  Tell me."},
    ],
    [{"role": "user", "content": "안녕 🎉"}, {"role": "assistant", "content": "hi"}],
]


@pytest.fixture(scope="module")
def ours():
    return load_model(None)


@pytest.fixture(scope="module")
def hf_tokenizer():
    path = resolve_model(None)
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )


@pytest.fixture(scope="module")
def hf_model():
    path = resolve_model(None)
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )


def test_config_matches(ours, hf_model):
    ref, cfg = hf_model.config, ours.config
    assert ours.name == DEFAULT_MODEL
    assert cfg.architecture == "LlamaForCausalLM" and ref.model_type == "llama"
    for field in [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
    ]:
        assert getattr(cfg, field) == getattr(ref, field), field
    assert cfg.rope_theta == ref.rope_parameters["rope_theta"] == 100000.0
    assert cfg.rope_scaling is None and ref.rope_parameters["rope_type"] == "default"
    assert cfg.eos_token_ids == [ref.eos_token_id] == [2]
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers) == (9, 3, 30)


def test_every_weight_matches(ours, hf_model):
    state = hf_model.state_dict()
    assert set(ours.weights) == set(state) - {"lm_head.weight"}
    for name, ref in state.items():
        if name == "lm_head.weight":  # tied: transformers shares the embedding
            assert torch.equal(ref, ours.weights["model.embed_tokens.weight"])
            continue
        got = ours.weights[name]
        assert got.dtype == torch.float32 and got.shape == ref.shape, name
        assert torch.equal(got, ref), name


@pytest.mark.parametrize("text", TEXTS + MORE_TEXTS)
def test_encode_matches(ours, hf_tokenizer, text):
    assert ours.tokenizer.encode(text) == hf_tokenizer.encode(text)
    ids = ours.tokenizer.encode(text)
    assert ours.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert ours.tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens(ours, hf_tokenizer):
    tok = ours.tokenizer
    assert (tok.bos_token, tok.eos_token) == (hf_tokenizer.bos_token, hf_tokenizer.eos_token)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.add_bos_token is False
    assert set(hf_tokenizer.all_special_ids) <= tok.all_special_ids
    assert tok.vocab_size == len(hf_tokenizer) == 49152
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user", "system", "unicode"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches(ours, hf_tokenizer, conversation, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    text = ours.tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt
    )
    assert text == expected
    ids = ours.tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    assert ids == hf_tokenizer.encode(expected, add_special_tokens=False)
