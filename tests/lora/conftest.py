"""LoRA adapters made with peft on tiny random Llama models (nothing downloaded)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import save_tiny_llama

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base, path, targets, r=8, alpha=16, seed=1, **config):
    """A PEFT LoRA adapter on a copy of `base`, with random A and B (B is zero in a fresh
    adapter, which would test nothing), saved to `path`; returns the peft model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **config
    )
    model = get_peft_model(copy.deepcopy(base), lora).eval()
    with torch.no_grad():  # peft's random B is small: make the adapter change the tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(8.0)
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompt, n):
    """HF's greedy tokens and each one's logprob."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones_like(ids), output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item()
                for s, t in zip(out.logits, tokens, strict=True)]  # fmt: skip
    return tokens, logprobs


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora-base")
    return str(path), save_tiny_llama(path)
