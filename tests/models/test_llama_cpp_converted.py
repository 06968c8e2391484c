"""Mixture-of-experts and hybrid models in GGUF files written by llama.cpp's own converter
(convert_hf_to_gguf.py: tests/model_loader/llama_cpp_convert.py), as users download them: a tiny
random transformers model saved with the default model's tokenizer, converted to F32 and Q8_0.
The F32 file holds transformers' weights exactly, and pagedllm's float32 greedy output equals
transformers' token for token; the Q8_0 file runs its experts on their codes by default."""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil

import gguf
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.quantization import Int8ActLinearMethod, Int8xWeight
from pagedllm.model_loader import load_gguf, resolve_model
from pagedllm.models import get_model_class
from tests.conftest import hf_greedy, runner_of
from tests.model_loader.llama_cpp_convert import convert
from tests.model_loader.tiny_gguf import requantize
from tests.models.test_architectures import (
    ARCHS,
    BASE,
    add_mtp_layer,
    checkpoint_state,
    random_hf_model,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

# test_architectures.py's tiny configs, changed where a GGUF cannot hold them: llama.cpp
# fixes gpt-oss's SwiGLU limit at 7 (the file stores none); the hybrids get a third layer
# (Mamba on both sides of the attention layer), the MoE one a shared MLP of 64 (Q8_0's rows are
# whole blocks of 32).
THIRD_LAYER = dict(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"])
LINEAR_THIRD = dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
                                                      "linear_attention"])  # fmt: skip
CHANGES = {
    "qwen3_moe": {},
    "mixtral": {},
    "gpt_oss": dict(swiglu_limit=7.0),
    "granite_hybrid": THIRD_LAYER,
    "granite_hybrid_moe": dict(THIRD_LAYER, shared_intermediate_size=64),
    "qwen3_next": dict(LINEAR_THIRD, shared_expert_intermediate_size=64),
    "qwen3_5": LINEAR_THIRD,
    "qwen3_5_moe": dict(LINEAR_THIRD, shared_expert_intermediate_size=64),
}
MODELS = {name: (*ARCHS[name][:2], {**BASE, **ARCHS[name][2], **change})
          for name, change in CHANGES.items()}  # fmt: skip
ARCHITECTURES = {  # what each loads as from a GGUF (llama.cpp writes Mixtral as "llama")
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "LlamaForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "granite_hybrid": "GraniteMoeHybridForCausalLM",
    "granite_hybrid_moe": "GraniteMoeHybridForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
}
PROMPTS = [[3, 17, 42, 8, 99, 5, 61], [7, 1, 2, 400, 5000], [11, 23, 5, 90, 64, 33, 2, 8, 77]]
NEW_TOKENS = 24


@functools.cache
def tokenizer():
    path = resolve_model(None)  # the packaged default model's tokenizer, as a saved one
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=path)


@pytest.fixture(scope="module", params=sorted(MODELS))
def converted(request, tmp_path_factory):
    """(name, transformers model, its directory, {outtype: GGUF path})."""
    config_cls, model_cls, extra = MODELS[request.param]
    hf = random_hf_model(config_cls, model_cls, {**extra, "vocab_size": len(tokenizer())})
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d / "hf")
    tokenizer().save_pretrained(d / "hf")
    saved = json.loads((d / "hf/config.json").read_text())
    if "layer_types" in extra:  # as IBM's configs name them (the converter reads these names)
        saved["layer_types"] = extra["layer_types"]
    if request.param == "qwen3_5_moe":  # else transformers gives the converter Qwen3.5's own
        saved["model_type"] = "qwen3_next"  # tokenizer class, not the saved tokenizer
    (d / "hf/config.json").write_text(json.dumps(saved))
    # A random transformers model has no multi-token-prediction layers, which the converter
    # expects of Qwen3-Next and Qwen3.5 unless told.
    options = ["--no-mtp"] if request.param.startswith(("qwen3_next", "qwen3_5")) else []
    files = {t: convert(d / "hf", d / f"model-{t}.gguf", t, *options) for t in ("f32", "q8_0")}
    return request.param, hf, d / "hf", files


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_f32_file_holds_the_weights_and_gives_transformers_greedy_tokens(converted):
    name, hf, _, files = converted
    loaded = load_gguf(files["f32"], with_tokenizer=False)
    c = loaded.config
    assert c.architecture == ARCHITECTURES[name]
    experts = getattr(hf.config, "num_experts", None) or getattr(hf.config, "num_local_experts", 0)
    assert c.num_experts == experts
    assert c.num_experts_per_tok == (hf.config.num_experts_per_tok if experts else 0)
    model = get_model_class(c.architecture)(c)
    state = checkpoint_state(hf.state_dict(), model)
    weights = checkpoint_state(loaded.weights, model)
    assert set(weights) == set(state)
    state = tile_value_heads(state, c) if c.linear_value_heads_tiled else state
    offset = c.norm_weight_offset
    for k, v in state.items():  # llama's q/k rows permuted by the converter, restored
        if k.endswith("A_log"):  # stored as -exp(A_log): log(-A) is A_log within rounding
            torch.testing.assert_close(weights[k], v, atol=0, rtol=1e-6)
        elif offset and k.endswith("norm.weight") and ".linear_attn." not in k:
            assert torch.equal(weights[k] + offset, v + offset), k  # stored as 1 + w
        else:
            assert torch.equal(weights[k], v), k

    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    llm = LLM(
        model=str(files["f32"]), dtype="float32", max_model_len=128, block_size=16,
        kv_cache_memory="8MiB", max_num_batched_tokens=8,
    )  # fmt: skip
    assert greedy(llm) == want


def tile_value_heads(state: dict, c) -> dict:
    """transformers' Gated DeltaNet weights with the value heads in the order llama.cpp's
    converter writes Qwen3.5's: [g0 h0, g1 h0, ..., g0 h1, ...] for key head groups g."""
    k_heads, r = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads

    def tile(t, dim, size, start=0):
        head = t.narrow(dim, start, t.shape[dim] - start)
        shape = (*t.shape[:dim], k_heads, r, size, *t.shape[dim + 1 :])
        tiled = head.reshape(shape).transpose(dim, dim + 1).reshape(head.shape)
        return torch.cat([t.narrow(dim, 0, start), tiled], dim)

    dv, qk = c.linear_value_head_dim, 2 * k_heads * c.linear_key_head_dim
    out = dict(state)
    for k, v in state.items():
        if ".linear_attn." not in k:
            continue
        if k.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            out[k] = tile(v, 0, dv, qk)
        elif k.endswith("in_proj_z.weight"):
            out[k] = tile(v, 0, dv)
        elif k.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            out[k] = tile(v, 0, 1)
        elif k.endswith("out_proj.weight"):
            out[k] = tile(v, 1, dv)
    return out


def layer_methods(llm: LLM, within: str = ".layers.") -> list:
    """The quant methods of the decoder's linear layers (`within` their names)."""
    model = runner_of(llm.llm_engine).model
    return [m.quant_method for n, m in model.named_modules()
            if within in n and hasattr(m, "quant_method")]  # fmt: skip


def teacher_forced(llm: LLM, exact: LLM) -> tuple[float, float]:
    """(top-1 agreement, mean |delta logprob|) of `llm` against `exact` (float32) on exact's
    greedy continuations of PROMPTS, fed back."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    deltas, agree = [], []
    for prompt, tokens in zip(PROMPTS, greedy(exact), strict=True):
        ids = prompt + tokens
        got = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        ref = exact.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        for pos in range(len(prompt), len(ids)):
            a, b = got.prompt_logprobs[pos][ids[pos]], ref.prompt_logprobs[pos][ids[pos]]
            deltas.append(abs(a.logprob - b.logprob))
            agree.append(a.rank == 1)
    return sum(agree) / len(agree), sum(deltas) / len(deltas)


def test_q8_0_experts_multiply_their_codes_by_default(converted):
    """The default dtype on CPU: each expert's projections take the file's Q8_0 codes in
    integers (int8_act), and the output stays close to float32's (teacher-forced)."""
    name, _, _, files = converted
    llm = LLM(model=str(files["q8_0"]), max_model_len=128, kv_cache_memory="8MiB")
    methods = layer_methods(llm)  # the experts', a recurrent layer's projections, ...
    assert methods and all(isinstance(m, Int8ActLinearMethod) for m in methods)
    exact = LLM(
        model=str(files["q8_0"]), dtype="float32", max_model_len=128, kv_cache_memory="8MiB"
    )
    # Measured over 72 positions: 100% / 0.012 (qwen3_moe), 90% / 0.034 (mixtral), 97% / 0.011
    # (gpt_oss), 94% / 0.005 (granite_hybrid), 97% / 0.011 (granite_hybrid_moe), 86% / 0.061
    # (qwen3_next), 92% / 0.027 (qwen3_5), 76% / 0.088 (qwen3_5_moe). A random tiny model's
    # distributions are flat, so near-ties flip; a wrong expert's codes would leave next to no
    # agreement. Qwen3.5-MoE's is transformers' own bfloat16 error (89% / 0.042 against its
    # float32) with the 8-bit activations of its Gated DeltaNet's q, k and v on top (86% / 0.031
    # with those in float): its 8-dim key heads are L2-normalised, so their rounding tells.
    agreement, delta = teacher_forced(llm, exact)
    floor, ceiling = (0.7, 0.12) if name == "qwen3_5_moe" else (0.8, 0.08)
    assert agreement >= floor and delta < ceiling, (agreement, delta)


@pytest.mark.parametrize("converted", ["gpt_oss"], indirect=True)
def test_gpt_oss_mxfp4_experts_are_taken_exactly(converted, tmp_path):
    """gpt-oss's experts in MXFP4 (as OpenAI released them and llama.cpp keeps them): held as
    int6 codes that are the file's weights exactly, so float32 equals transformers' greedy tokens
    on the dequantized weights, and the default multiplies the codes in integers."""
    _, hf, _, files = converted
    path = requantize(files["f32"], tmp_path / "mxfp4.gguf", gguf.GGMLQuantizationType.MXFP4,
                      "_exps.weight")  # fmt: skip
    loaded = load_gguf(path, keep_codes=True, with_tokenizer=False)
    expert = "model.layers.0.mlp.experts.1.up_proj.weight"
    codes = loaded.quant_codes[expert]
    assert isinstance(codes, Int8xWeight) and torch.equal(
        codes.dequantize(), loaded.weights[expert]
    )
    hf_mx = copy.deepcopy(hf)  # transformers on the file's (dequantized) weights
    with torch.no_grad():
        for e in range(hf.config.num_local_experts):
            for layer in range(hf.config.num_hidden_layers):
                p = f"model.layers.{layer}.mlp.experts.{e}."
                gate, up = (
                    loaded.weights[p + "gate_proj.weight"],
                    loaded.weights[p + "up_proj.weight"],
                )
                fused = hf_mx.model.layers[layer].mlp.experts
                fused.gate_up_proj[e, :, 0::2] = gate.T
                fused.gate_up_proj[e, :, 1::2] = up.T
                fused.down_proj[e] = loaded.weights[p + "down_proj.weight"].T
    want = [hf_greedy(hf_mx, p, NEW_TOKENS) for p in PROMPTS]
    exact = LLM(model=str(path), dtype="float32", max_model_len=128, kv_cache_memory="8MiB")
    assert greedy(exact) == want
    llm = LLM(model=str(path), max_model_len=128, kv_cache_memory="8MiB")
    methods = layer_methods(llm, ".experts.")
    assert methods and all(isinstance(m, Int8ActLinearMethod) for m in methods)
    assert {m.kind for m in methods} == {"int6"}
    # Measured: 96% / 0.011: the weights are the file's, only the activations are rounded.
    agreement, delta = teacher_forced(llm, exact)
    assert agreement >= 0.8 and delta < 0.08, (agreement, delta)


@pytest.mark.parametrize("converted", ["qwen3_next"], indirect=True)
def test_multi_token_prediction_blocks_are_left_unread(converted, tmp_path):
    """Released Qwen3-Next / Qwen3.5 checkpoints carry a multi-token-prediction block, which
    llama.cpp's converter appends as one more block (nextn_predict_layers): the model is the
    blocks before it, and its greedy tokens are transformers'."""
    _, hf, hf_dir, _ = converted
    mtp_dir = tmp_path / "hf"
    shutil.copytree(hf_dir, mtp_dir)
    add_mtp_layer(mtp_dir, 1)
    path = convert(mtp_dir, tmp_path / "mtp.gguf", "f32")
    reader = gguf.GGUFReader(path)
    assert reader.fields["qwen3next.nextn_predict_layers"].contents() == 1
    assert any(t.name.startswith("blk.3.") for t in reader.tensors)
    loaded = load_gguf(path, with_tokenizer=False)
    assert loaded.config.num_hidden_layers == 3
    assert not any(name.startswith("model.layers.3.") for name in loaded.weights)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, kv_cache_memory="8MiB")
    assert greedy(llm) == [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
