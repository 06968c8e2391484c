"""The fused C++ decoder (models/fused_decoder.py) against the model's own modules: the same
kernels in the same order, so every logit of every step and every KV-cache slot must be equal
bit for bit, for each kind of projection and the Llama options it takes."""

from __future__ import annotations

import pytest
import torch

from pagedllm import kernels
from pagedllm.config import ModelArchConfig
from pagedllm.layers.quantization import (
    MAX_GEMV_ROWS,
    DualLinearMethod,
    QuantizationConfig,
    can_pack,
)
from pagedllm.model_loader.build import process_weights_after_loading
from pagedllm.models.fused_decoder import NotFusable
from pagedllm.models.llama import LlamaForCausalLM
from tests.models.paged_runner import PagedRunner

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")

BASE = dict(
    architecture="LlamaForCausalLM", vocab_size=160, hidden_size=64, intermediate_size=96,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=256,
)  # fmt: skip
OPTIONS = {
    "gqa": {},
    "mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "qkv_bias_one_kv_head": dict(qkv_bias=True, num_key_value_heads=1),
    "all_bias": dict(attention_bias=True, mlp_bias=True),
    "sliding_window": dict(sliding_window=5),
    "partial_rotary": dict(partial_rotary_factor=0.5, rope_theta=500.0),
    "embedding_multiplier": dict(embedding_multiplier=2.0),
    "qk_norm": dict(qk_norm=True),  # Qwen3
    # Granite's: each block's output scaled as it joins the residual stream
    "granite": dict(residual_multiplier=0.5, attention_multiplier=0.3, embedding_multiplier=3.0),
}


class EveryLayer(dict):
    """code_kinds for --quantization auto naming every layer (the float weights quantized as
    they load, in place of a GGUF's codes)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def get(self, key, default=None):
        return self.kind


# projections -> (dtype, what the layers are built as)
KINDS = {
    # codes up to 4 rows (set below), the float copy above: the 3-token chunks of 3 requests
    # (9 rows) take the copy, their decode steps the codes
    "dual_int4": (torch.float32, QuantizationConfig("auto", code_kinds=EveryLayer("int4"))),
    "dual_int8_packed": (
        torch.bfloat16,
        QuantizationConfig("auto", prepack=True, code_kinds=EveryLayer("int8")),
    ),
    "float32": (torch.float32, QuantizationConfig()),
    "packed_bf16": (torch.bfloat16, QuantizationConfig(prepack=True)),
    "int4": (torch.bfloat16, QuantizationConfig("int4")),
    "int8": (torch.float32, QuantizationConfig("int8")),
    # --deterministic: the fixed-order kernels, bfloat16 widened to float32 around each product
    "fixed_float32": (torch.float32, QuantizationConfig(fixed_order=True)),
    "fixed_bf16": (torch.bfloat16, QuantizationConfig(fixed_order=True)),
    "fixed_dual_int4_bf16": (
        torch.bfloat16,
        QuantizationConfig("auto", code_kinds=EveryLayer("int4"), fixed_order=True),
    ),
    "fixed_int8_bf16": (torch.bfloat16, QuantizationConfig("int8", fixed_order=True)),
}


def tiny_model(dtype, quant_config, **overrides) -> LlamaForCausalLM:
    """Random float32 weights (norms near 1, not all ones), loaded into a model built in
    `dtype` with quant_config's layers, then processed as build_model does."""
    config = ModelArchConfig(**{**BASE, **overrides})
    torch.manual_seed(0)
    weights = LlamaForCausalLM(config, "cpu")
    with torch.no_grad():
        for p in weights.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.2)
    model = LlamaForCausalLM(config, "cpu", dtype, quant_config).eval()
    model.load_weights(dict(weights.named_parameters()))
    process_weights_after_loading(model, quant_config)
    return model


def run(model, prompts, chunk_sizes, max_new_tokens=12, fused=None):
    runner = PagedRunner(model, block_size=4, num_blocks=96, seed=1, fused=fused)
    reqs = runner.generate(prompts, max_new_tokens, chunk_sizes)
    return [torch.stack(r.logits) for r in reqs], runner.kv_caches


def fused_and_eager(kind, options):
    dtype, quant_config = KINDS[kind]
    if quant_config.prepack and not can_pack(dtype, torch.device("cpu")):
        pytest.skip("needs oneDNN's bfloat16 path")
    eager, fused = (tiny_model(dtype, quant_config, **OPTIONS[options]) for _ in range(2))
    for model in (eager, fused):
        for module in model.modules():
            if isinstance(getattr(module, "quant_method", None), DualLinearMethod):
                module.quant_method.max_code_rows = 4
    return eager, fused, fused.fused_decoder()


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fused_decoder_equals_modules(kind, options, monkeypatch):
    eager, fused, decoder = fused_and_eager(kind, options)
    calls = []
    forward = type(decoder).__call__
    monkeypatch.setattr(type(decoder), "__call__", lambda *a: calls.append(1) or forward(*a))
    # Whole prompts (the modules' prefill), then decode; and 3-token chunks, which the kernel
    # takes, so the fused path runs with several query rows and prefill rows in one step.
    prompts = [[5, 17, 33, 2, 99, 140, 7, 7, 60], [11, 3], [150, 42, 8, 8, 1, 64, 23]]
    for chunk_sizes in (None, [3, 3, 3]):
        expected, expected_kv = run(eager, prompts, chunk_sizes)
        n = len(calls)
        got, got_kv = run(fused, prompts, chunk_sizes, fused=decoder)
        assert len(calls) > n + 10  # the fused path ran (every decode step)
        for e, g in zip(expected, got, strict=True):
            assert torch.equal(e, g)
        for (ek, ev), (gk, gv) in zip(expected_kv, got_kv, strict=True):
            assert torch.equal(ek.nan_to_num(), gk.nan_to_num())
            assert torch.equal(ev.nan_to_num(), gv.nan_to_num())


def test_prefill_and_large_quantized_batches_go_through_the_modules(monkeypatch):
    _, fused, decoder = fused_and_eager("int4", "gqa")
    calls = []
    forward = type(decoder).__call__
    monkeypatch.setattr(type(decoder), "__call__", lambda *a: calls.append(1) or forward(*a))
    run(fused, [[5, 6, 7, 8, 9, 10, 11, 12]], None, 1, decoder)  # 8 rows: SDPA's prefill
    assert calls == []
    # More decode rows than the int4 kernel multiplies directly: the modules expand the weights.
    prompts = [[i + 1] for i in range(MAX_GEMV_ROWS + 1)]
    run(fused, prompts, None, max_new_tokens=3, fused=decoder)
    assert calls == []
    run(fused, prompts[:MAX_GEMV_ROWS], None, max_new_tokens=3, fused=decoder)
    assert len(calls) == 3  # one-token prompts, then two decode steps


@pytest.mark.parametrize(
    "overrides, backend, reason",
    [
        ({}, "sdpa", "attention backend sdpa"),
    ],
)
def test_what_cannot_be_fused_says_why(overrides, backend, reason):
    model = LlamaForCausalLM(ModelArchConfig(**{**BASE, **overrides}), backend)
    with pytest.raises(NotFusable, match=reason):
        model.fused_decoder()


def test_gemma3_is_not_fused():
    from pagedllm.models.gemma3 import Gemma3ForCausalLM

    config = ModelArchConfig(**{**BASE, "architecture": "Gemma3ForCausalLM"})
    with pytest.raises(NotFusable, match="Gemma3Model"):
        Gemma3ForCausalLM(config, "cpu").fused_decoder()
