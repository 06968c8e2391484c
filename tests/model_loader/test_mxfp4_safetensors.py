"""gpt-oss safetensors as OpenAI released them (openai/gpt-oss-20b, -120b): the experts in MXFP4
blocks and scales (quantization_config `quant_method: mxfp4`), taken as int6 codes that are
transformers' dequantized weights exactly, the float paths on their dequantized weights."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import save_file

from pagedllm import LLM
from pagedllm.layers.quantization import Int8ActLinearMethod, Int8xWeight
from pagedllm.model_loader import load_hf_dir, load_model
from pagedllm.model_loader.hf_config import config_from_hf
from pagedllm.model_loader.loaded_model import LazyWeights
from pagedllm.model_loader.mxfp4 import codes_from_mxfp4
from tests.conftest import hf_greedy
from tests.models.test_architectures import ARCHS, BASE, random_hf_model
from tests.models.test_llama_cpp_converted import (
    NEW_TOKENS,
    PROMPTS,
    greedy,
    layer_methods,
    teacher_forced,
    tokenizer,
)

transformers = pytest.importorskip("transformers")
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

FP4 = torch.tensor(mxfp4.FP4_VALUES)  # e2m1's 16 values, by code
LLM_ARGS = dict(max_model_len=128, kv_cache_memory="8MiB")


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, K] float -> OpenAI's MXFP4 blocks uint8 [..., rows, K / 32, 16] and scales
    uint8 [..., rows, K / 32]: each block of 32 the nearest e2m1 values times 2^e, e such that
    the block's largest |w| / 2^e is in [4, 8) (e2m1's largest is 6), stored as e + 127."""
    blocks = w.float().reshape(*w.shape[:-1], -1, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    e = torch.where(top > 0, torch.floor(torch.log2(top)) - 2, torch.zeros_like(top))
    codes = (blocks / torch.exp2(e))[..., None].sub(FP4).abs().argmin(-1).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # byte j: columns 2 j (low), 2 j + 1
    return packed, (e[..., 0] + 127).to(torch.uint8)


def dequantized(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' own dequantization, float32: [E, rows, K / 32, 16] -> [E, K, rows]."""
    return mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def test_codes_are_transformers_dequantization_bit_for_bit():
    """Every byte and every scale exponent (but 255, E8M0's NaN), subnormal 2^-127 and 2^-128
    included. -0.0 (code 8) comes out +0.0, which torch.equal counts equal, as any sum does."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (1, 64, 4, 16), dtype=torch.uint8, generator=g)
    blocks[0, :16, 0] = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    scales = torch.arange(256, dtype=torch.uint8)[:255].repeat(2)[: 64 * 4].reshape(1, 64, 4)
    codes = codes_from_mxfp4(blocks[0], scales[0])
    want = dequantized(blocks, scales)[0].T  # [rows, K]
    assert isinstance(codes, Int8xWeight) and codes.q.abs().max() <= 12
    assert torch.equal(codes.dequantize(), want)
    bits = codes.dequantize().abs().view(torch.int32)  # and bit for bit, zero's sign aside
    assert torch.equal(bits, want.abs().view(torch.int32))


@functools.cache
def reference():
    """A tiny random gpt-oss (its tests/models/test_architectures.py config), with its experts
    replaced by the MXFP4 blocks they quantize to: (model on the dequantized weights, {name:
    blocks or scales} as OpenAI's files name them)."""
    config_cls, model_cls, extra = ARCHS["gpt_oss"]
    hf = random_hf_model(config_cls, model_cls, {**BASE, **extra, "vocab_size": len(tokenizer())})
    stacked = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            experts = layer.mlp.experts
            for proj in ("gate_up_proj", "down_proj"):
                param = getattr(experts, proj)  # [E, in, out]; the blocks are [E, out, in]
                blocks, scales = quantize(param.transpose(1, 2))
                param.copy_(dequantized(blocks, scales))
                stacked[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = blocks
                stacked[f"model.layers.{i}.mlp.experts.{proj}_scales"] = scales
    return hf, stacked


@pytest.fixture(scope="module")
def openai_dir(tmp_path_factory):
    """The reference written as OpenAI's checkpoint: config.json with its quantization_config,
    two shards (the experts' blocks, scales and biases in one, the rest in the other) and an
    index."""
    hf, stacked = reference()
    d = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    hf.save_pretrained(d)
    tokenizer().save_pretrained(d)
    for f in d.glob("*.safetensors*"):
        f.unlink()
    state = {k: v for k, v in hf.state_dict().items() if k.rpartition(".")[2] not in
             ("gate_up_proj", "down_proj")}  # fmt: skip
    experts = {**stacked, **{k: v for k, v in state.items() if ".experts." in k}}
    rest = {k: v.contiguous() for k, v in state.items() if k not in experts}
    save_file(experts, d / "model-00001-of-00002.safetensors")
    save_file(rest, d / "model-00002-of-00002.safetensors")
    files = {"model-00001-of-00002.safetensors": experts, "model-00002-of-00002.safetensors": rest}
    size = sum(t.nbytes for part in files.values() for t in part.values())
    index = {"metadata": {"total_size": size},
             "weight_map": {k: f for f, part in files.items() for k in part}}  # fmt: skip
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_experts_are_taken_as_exact_codes(openai_dir):
    """Each expert's gate (even rows of gate_up), up (odd rows) and down projection: codes whose
    dequantization is transformers' weight bit for bit, the same as the float weights; biases
    split alike."""
    hf, stacked = reference()
    loaded = load_hf_dir(openai_dir, keep_codes=True, with_tokenizer=False)
    assert loaded.config.architecture == "GptOssForCausalLM" and loaded.config.quantized_codes
    assert not any(k.endswith(("_blocks", "_scales", "_proj_bias")) for k in loaded.weights)
    for i, layer in enumerate(hf.model.layers):
        p = f"model.layers.{i}.mlp.experts."
        gate_up = dequantized(
            stacked[p + "gate_up_proj_blocks"], stacked[p + "gate_up_proj_scales"]
        )
        down = dequantized(stacked[p + "down_proj_blocks"], stacked[p + "down_proj_scales"])
        bias = layer.mlp.experts.gate_up_proj_bias
        for e in range(hf.config.num_local_experts):
            want = {
                "gate_proj": (gate_up[e][:, 0::2].T, bias[e][0::2]),
                "up_proj": (gate_up[e][:, 1::2].T, bias[e][1::2]),
                "down_proj": (down[e].T, layer.mlp.experts.down_proj_bias[e]),
            }
            for proj, (weight, b) in want.items():
                name = f"{p}{e}.{proj}"
                codes = loaded.quant_codes[f"{name}.weight"]
                assert loaded.quant_codes.kinds[f"{name}.weight"] is Int8xWeight
                assert isinstance(codes, Int8xWeight) and codes.q.abs().max() <= 12
                assert torch.equal(codes.dequantize(), weight), name
                assert torch.equal(loaded.weights[f"{name}.weight"], weight), name
                assert torch.equal(loaded.weights[f"{name}.bias"], b), name
    assert torch.equal(loaded.weights["model.layers.0.mlp.router.weight"],
                       hf.model.layers[0].mlp.router.weight)  # fmt: skip
    # Without keep_codes (--quantization none): the float weights alone, still lazy.
    floats = load_model(str(openai_dir), with_tokenizer=False)
    assert isinstance(floats.weights, LazyWeights) and not floats.quant_codes
    assert set(floats.weights) == set(loaded.weights)


def test_other_quantization_configs_are_clear_errors():
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "architectures": ["LlamaForCausalLM"]}  # fmt: skip
    assert not config_from_hf(base).quantized_codes
    for method in ("gptq", "awq", "bitsandbytes", "fp8"):
        cfg = {**base, "quantization_config": {"quant_method": method, "bits": 4}}
        with pytest.raises(ValueError, match=rf"'{method}' \(LlamaForCausalLM\) is not supp"):
            config_from_hf(cfg)
    with pytest.raises(ValueError, match=r"'mxfp4' \(LlamaForCausalLM\) is not supported"):
        config_from_hf({**base, "quantization_config": {"quant_method": "mxfp4"}})


def _drop_scales(stacked):
    return {k: v for k, v in stacked.items() if not k.endswith("_scales")}


def _one_expert_short(stacked):
    return {k: v[1:] if k.endswith("_scales") else v for k, v in stacked.items()}


@pytest.mark.parametrize(
    "broken, fragment",
    [
        (_drop_scales, r"down_proj_blocks has no model\.layers\.0\.mlp\.experts\.down_proj_scales"),
        (_one_expert_short, r"down_proj_blocks has shape \[4, 64, 3, 16\] and .* \[3, 64, 3\]"),
    ],
)
def test_broken_mxfp4_tensors_are_clear_errors(openai_dir, tmp_path, broken, fragment):
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((openai_dir / f).read_bytes())
    save_file(broken(reference()[1]), tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=fragment):
        load_hf_dir(tmp_path, keep_codes=True, with_tokenizer=False)


@pytest.mark.slow
def test_float32_gives_transformers_greedy_tokens_and_default_multiplies_codes(openai_dir):
    """--dtype float32: the dequantized experts, transformers' greedy tokens exactly. The
    default on CPU: the experts' codes in integers (int6 kind), close to float32's."""
    hf, _ = reference()
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    exact = LLM(model=str(openai_dir), dtype="float32", **LLM_ARGS)
    assert greedy(exact) == want
    assert not any(isinstance(m, Int8ActLinearMethod) for m in layer_methods(exact))
    llm = LLM(model=str(openai_dir), **LLM_ARGS)
    methods = layer_methods(llm, ".experts.")
    assert methods and all(isinstance(m, Int8ActLinearMethod) for m in methods)
    assert {m.kind for m in methods} == {"int6"}
    # Measured over 72 positions: 99% / 0.007 (the GGUF's MXFP4 experts: 96% / 0.011,
    # test_llama_cpp_converted.py): the weights are the file's, only the activations rounded.
    agreement, delta = teacher_forced(llm, exact)
    assert agreement >= 0.8 and delta < 0.08, (agreement, delta)


@pytest.mark.slow
def test_transformers_reads_the_written_files_as_the_reference(openai_dir):
    """The files are OpenAI's layout as transformers reads it: its own loader (dequantizing on
    CPU) gives the reference's experts."""
    hf, _ = reference()
    config = transformers.Mxfp4Config(dequantize=True)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        openai_dir, quantization_config=config, dtype=torch.float32
    )
    ours = hf.state_dict()
    for k, v in theirs.state_dict().items():
        assert torch.equal(v, ours[k]), k
