"""Shared fixtures: tiny random Llama models saved the way transformers saves them, and the real
default model loaded by transformers as the reference."""

import os

import pytest
import torch

# Without a GPU the Triton backend's kernels run on CPU tensors under Triton's interpreter; it
# is chosen when pagedllm.attention.triton_kernels is imported, so it is set before any test.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def save_tiny_llama(path, seed: int = 0, **overrides) -> "torch.nn.Module":
    """A random tiny Llama saved with save_pretrained (safetensors); returns the HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' own load of the default GGUF (dequantized to fp32) and its tokenizer."""
    from benchmarks.int8_accuracy import load_transformers

    return load_transformers(None)  # the packaged default GGUF


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `prompt`: exactly n tokens (no early end)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
            attention_mask=torch.ones_like(ids),
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def hf_chat_ids(tokenizer, question: str) -> list[int]:
    """A transformers tokenizer's token ids of a one-turn chat prompt, ready for the reply."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def runner_of(engine):
    """Rank 0's model runner of an LLMEngine (its worker lives in the engine's process)."""
    return engine.executor.driver_worker.model_runner
