"""read_gguf_lora on LoRA files written here as llama.cpp's convert_lora_to_gguf.py writes them:
metadata keys, `<gguf name>.lora_a` [r, in] / `.lora_b` [out, r], lora_b's q/k rows permuted for
llama-family archs, F32 / F16 / BF16 / Q8_0."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.config import ModelArchConfig
from pagedllm.model_loader.gguf_lora import is_gguf_lora, read_gguf_lora

from .tiny_gguf import llama_cpp_permute

Q = gguf.GGMLQuantizationType
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 16
LLAMA = ModelArchConfig("LlamaForCausalLM", 256, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM)
QWEN2 = ModelArchConfig("Qwen2ForCausalLM", 256, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM)
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip
Q_DIM, KV_DIM = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
SHAPES = {  # (out, in)
    "self_attn.q_proj": (Q_DIM, HIDDEN), "self_attn.k_proj": (KV_DIM, HIDDEN),
    "self_attn.v_proj": (KV_DIM, HIDDEN), "self_attn.o_proj": (HIDDEN, Q_DIM),
    "mlp.gate_proj": (FFN, HIDDEN), "mlp.up_proj": (FFN, HIDDEN), "mlp.down_proj": (HIDDEN, FFN),
}  # fmt: skip


def peft_adapter(rank: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random non-zero lora_A / lora_B for every linear, named as PEFT saves them."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(LAYERS):
        for module, (n_out, n_in) in SHAPES.items():
            key = f"base_model.model.model.layers.{i}.{module}"
            out[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen)
            out[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen)
    return out


def _add(writer, name: str, array: np.ndarray, qtype) -> None:
    if qtype in (Q.F32, Q.F16):
        writer.add_tensor(name, array.astype(np.float32 if qtype == Q.F32 else np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def write_lora(path, adapter, arch="llama", alpha=16.0, qtype=Q.F32, extra=(), kind="adapter"):
    """As convert_lora_to_gguf.py lays a file out; `extra`: (name, array) written as they are."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(kind)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    if alpha is not None:
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    heads = {"self_attn.q_proj": HEADS, "self_attn.k_proj": KV_HEADS}
    for name in adapter:
        if not name.endswith(".lora_A.weight"):
            continue
        key = name.removesuffix(".lora_A.weight")
        layer, module = key.split(".")[4], key.split(".", 5)[5]
        a, b = adapter[name].numpy(), adapter[f"{key}.lora_B.weight"].numpy()
        if arch in ("llama", "granite") and module in heads:
            b = llama_cpp_permute(b, heads[module])  # the converter permutes lora_b's rows only
        stem = f"blk.{layer}.{GGUF_NAMES[module]}.weight"
        _add(writer, f"{stem}.lora_a", a, qtype)
        _add(writer, f"{stem}.lora_b", b, qtype)
    for name, array in extra:
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_f32_round_trip_undoes_the_qk_permutation(tmp_path):
    adapter = peft_adapter()
    config, got = read_gguf_lora(write_lora(tmp_path / "a.gguf", adapter), LLAMA)
    assert config == {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16.0,
        "target_modules": sorted(m.split(".")[1] for m in SHAPES),
    }
    assert set(got) == set(adapter)
    for name, original in adapter.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], original), name
    # Not vacuous: the permutation moves lora_B's rows of q and k.
    b = adapter["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].numpy()
    assert not np.array_equal(llama_cpp_permute(b, KV_HEADS), b)


@pytest.mark.parametrize(
    "qtype, tol", [(Q.F16, 1e-3), (Q.BF16, 8e-3), (Q.Q8_0, 1 / 127)], ids=["f16", "bf16", "q8_0"]
)
def test_quantized_types_read_within_a_quantization_step(tmp_path, qtype, tol):
    adapter = peft_adapter(rank=32)  # rank 32: lora_b's rows are whole Q8_0 blocks too
    _, got = read_gguf_lora(write_lora(tmp_path / "a.gguf", adapter, qtype=qtype), LLAMA)
    for name, original in adapter.items():
        assert (got[name] - original).abs().max() <= tol * original.abs().max(), name


def test_neox_rope_arch_is_not_unpermuted(tmp_path):
    adapter = peft_adapter()
    _, got = read_gguf_lora(write_lora(tmp_path / "q.gguf", adapter, arch="qwen2"), QWEN2)
    assert all(torch.equal(got[name], original) for name, original in adapter.items())


def test_absent_alpha_means_scale_one(tmp_path):
    config, _ = read_gguf_lora(write_lora(tmp_path / "a.gguf", peft_adapter(), alpha=None), LLAMA)
    assert config["lora_alpha"] == config["r"] == 8


def test_norm_vectors_are_skipped_and_mixed_ranks_give_a_rank_pattern(tmp_path):
    adapter = peft_adapter()
    key = "base_model.model.model.layers.1.mlp.down_proj"
    adapter[f"{key}.lora_A.weight"] = torch.randn(4, FFN)
    adapter[f"{key}.lora_B.weight"] = torch.randn(HIDDEN, 4)
    norm = [("blk.0.attn_norm.weight", np.ones(HIDDEN, np.float32))]
    path = write_lora(tmp_path / "a.gguf", adapter, alpha=None, extra=norm)
    config, got = read_gguf_lora(path, LLAMA)
    assert set(got) == set(adapter)
    assert config["r"] == 8
    assert config["rank_pattern"] == {"model.layers.1.mlp.down_proj": 4}
    assert config["alpha_pattern"] == {"model.layers.1.mlp.down_proj": 4.0}


def test_is_gguf_lora(tmp_path):
    assert is_gguf_lora(write_lora(tmp_path / "a.gguf", peft_adapter()))
    assert not is_gguf_lora(write_lora(tmp_path / "m.gguf", peft_adapter(), kind="model"))
    assert not is_gguf_lora(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    assert not is_gguf_lora(tmp_path / "junk.gguf")
    (tmp_path / "a.bin").write_bytes((tmp_path / "a.gguf").read_bytes())
    assert not is_gguf_lora(tmp_path / "a.bin")


def test_not_an_adapter_or_another_arch(tmp_path):
    with pytest.raises(ValueError, match="not a GGUF LoRA adapter"):
        read_gguf_lora(write_lora(tmp_path / "m.gguf", peft_adapter(), kind="model"), LLAMA)
    with pytest.raises(ValueError, match="architecture 'qwen2'; the model is LlamaForCausalLM"):
        read_gguf_lora(write_lora(tmp_path / "q.gguf", peft_adapter(), arch="qwen2"), LLAMA)
    smaller = ModelArchConfig("LlamaForCausalLM", 256, 32, FFN, LAYERS, 2, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="another model"):
        read_gguf_lora(write_lora(tmp_path / "a.gguf", peft_adapter()), smaller)
    with pytest.raises(ValueError, match="holds no LoRA tensors"):
        read_gguf_lora(write_lora(tmp_path / "empty.gguf", {}), LLAMA)


@pytest.mark.parametrize(
    "name, message",
    [
        ("token_embd.weight.lora_a", "embedding LoRA .* is not supported"),
        ("output.weight.lora_b", "LM-head LoRA .* is not supported"),
        ("blk.0.attn_q.weight.lora_c", "cannot map"),
        ("blk.0.attn_sinks.weight.lora_a", "cannot map"),
        ("blk.0.attn_q.bias.lora_a", "cannot map"),
        ("blk.7.attn_q.weight.lora_a", "past the model's 2 layers"),
    ],
)
def test_unmappable_tensors(tmp_path, name, message):
    extra = [(name, np.ones((8, HIDDEN), np.float32))]
    path = write_lora(tmp_path / "a.gguf", peft_adapter(), extra=extra)
    with pytest.raises(ValueError, match=message):
        read_gguf_lora(path, LLAMA)


def test_lora_a_without_lora_b(tmp_path):
    adapter = peft_adapter()
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    extra = [("blk.0.attn_q.weight.lora_a", adapter.pop(f"{key}.lora_A.weight").numpy())]
    del adapter[f"{key}.lora_B.weight"]
    with pytest.raises(ValueError, match="has only lora_a"):
        read_gguf_lora(write_lora(tmp_path / "a.gguf", adapter, extra=extra), LLAMA)
