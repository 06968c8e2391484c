"""load_gguf on tiny llama GGUF files written here: quant types, q/k un-permutation, config."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.model_loader import load_gguf, load_model

from .tiny_gguf import (
    FFN,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    gpt2_vocab,
    llama_cpp_permute,
    llama_cpp_rope_freqs,
    random_hf_weights,
    write_tiny_llama,
)

Q = gguf.GGMLQuantizationType
VOCAB = len(gpt2_vocab()[0])

# Worst error allowed relative to the tensor's largest magnitude: about one quantization step.
QUANT_TOLERANCE = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 8e-3,
    Q.Q8_0: 1 / 127,
    Q.Q5_0: 1 / 15,
    Q.Q5_1: 1 / 15,
    Q.Q4_0: 1 / 7,
    Q.Q4_1: 1 / 7,
}


@pytest.fixture(scope="module")
def hf_weights():
    return random_hf_weights(VOCAB, seed=0)


def test_f32_round_trip_undoes_qk_permutation(tmp_path, hf_weights):
    model = load_gguf(write_tiny_llama(tmp_path / "f32.gguf", hf_weights))
    assert set(model.weights) == set(hf_weights)  # tied: no lm_head
    for name, original in hf_weights.items():
        got = model.weights[name]
        assert got.dtype == torch.float32
        assert torch.equal(got, torch.from_numpy(original)), name


def test_without_unpermute_q_and_k_would_differ(tmp_path, hf_weights):
    # Guards the round trip above against a vacuous pass: the permutation really moves rows.
    q = hf_weights["model.layers.0.self_attn.q_proj.weight"]
    k = hf_weights["model.layers.0.self_attn.k_proj.weight"]
    assert not np.array_equal(llama_cpp_permute(q, HEADS), q)
    assert not np.array_equal(llama_cpp_permute(k, KV_HEADS), k)


@pytest.mark.parametrize("qtype", list(QUANT_TOLERANCE), ids=lambda q: q.name)
def test_quantized_types_dequantize_within_quantization_error(tmp_path, hf_weights, qtype):
    model = load_gguf(write_tiny_llama(tmp_path / f"{qtype.name}.gguf", hf_weights, qtype))
    for name, original in hf_weights.items():
        got = model.weights[name].numpy()
        assert got.shape == original.shape and got.dtype == np.float32, name
        if original.ndim == 1:  # norms are stored F32
            np.testing.assert_array_equal(got, original)
            continue
        err = np.abs(got - original)
        scale = np.abs(original).max()
        assert err.max() <= QUANT_TOLERANCE[qtype] * scale + 1e-7, (name, err.max() / scale)
        # Exactly the gguf package's reference dequantization, in HF row order.
        if qtype != Q.F32:
            ref = gguf.quants.dequantize(
                gguf.quants.quantize(_gguf_layout(name, original), qtype), qtype
            )
            np.testing.assert_array_equal(_gguf_layout(name, got), ref, err_msg=name)


def _gguf_layout(name: str, w: np.ndarray) -> np.ndarray:
    if "q_proj" in name:
        return llama_cpp_permute(w, HEADS)
    if "k_proj" in name:
        return llama_cpp_permute(w, KV_HEADS)
    return w


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K], ids=lambda q: q.name)
def test_k_quants_use_reference_dequantization(tmp_path, hf_weights, qtype):
    """gguf can't quantize K-quants, so write valid-looking raw blocks and check the loader hands
    back exactly the reference dequantization, un-permuted for q/k."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(1)
    raw = {}
    for name, shape in [
        ("blk.0.attn_q.weight", (HEADS * HEAD_DIM, HIDDEN)),
        ("blk.1.attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
        ("blk.0.ffn_down.weight", (HIDDEN, FFN)),
    ]:
        # Bytes below 0x40 keep every embedded f16 scale finite and small.
        raw[name] = (
            rng.integers(0, 0x40, (shape[0], shape[1] // block * type_size), dtype=np.uint8),
            qtype,
        )
    path = write_tiny_llama(tmp_path / f"{qtype.name}.gguf", hf_weights, raw_tensors=raw)
    model = load_gguf(path)
    for gname, hname, heads in [
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", HEADS),
        ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight", KV_HEADS),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", None),
    ]:
        ref = gguf.quants.dequantize(raw[gname][0], qtype)
        got = model.weights[hname].numpy()
        assert np.isfinite(ref).all() and np.abs(ref).max() > 0
        np.testing.assert_array_equal(llama_cpp_permute(got, heads) if heads else got, ref)


def test_config_from_metadata(tmp_path, hf_weights):
    cfg = load_gguf(write_tiny_llama(tmp_path / "m.gguf", hf_weights)).config
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (VOCAB, HIDDEN, FFN)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        LAYERS,
        HEADS,
        KV_HEADS,
    )
    assert cfg.head_dim == HEAD_DIM
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 512
    assert cfg.tie_word_embeddings is True
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2]


def test_end_of_turn_token_is_an_eos(tmp_path, hf_weights):
    path = write_tiny_llama(tmp_path / "eot.gguf", hf_weights, eot_token_id=0)
    assert load_gguf(path).config.eos_token_ids == [2, 0]


def test_untied_lm_head(tmp_path):
    weights = random_hf_weights(VOCAB, seed=3, lm_head=True)
    model = load_gguf(write_tiny_llama(tmp_path / "untied.gguf", weights))
    assert model.config.tie_word_embeddings is False
    assert torch.equal(model.weights["lm_head.weight"], torch.from_numpy(weights["lm_head.weight"]))


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path, hf_weights):
    freqs = llama_cpp_rope_freqs(HEAD_DIM, 500000.0, 8.0, 1.0, 4.0, 8192)
    assert 1 < len(set(freqs.tolist())) and ((freqs > 1) & (freqs < 8)).sum() >= 2
    model = load_gguf(write_tiny_llama(tmp_path / "l3.gguf", hf_weights, rope_freqs=freqs))
    scaling = model.config.rope_scaling
    assert scaling["rope_type"] == "llama3"
    assert scaling["factor"] == pytest.approx(8.0)
    assert scaling["low_freq_factor"] == pytest.approx(1.0)
    assert scaling["high_freq_factor"] == pytest.approx(4.0)
    assert scaling["original_max_position_embeddings"] == 8192
    assert "rope_freqs.weight" not in model.weights


def test_other_llama3_ramp_is_recovered(tmp_path, hf_weights):
    freqs = llama_cpp_rope_freqs(HEAD_DIM, 500000.0, 32.0, 2.0, 8.0, 8192)
    scaling = load_gguf(write_tiny_llama(tmp_path / "l3b.gguf", hf_weights, rope_freqs=freqs))
    scaling = scaling.config.rope_scaling
    assert (scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]) == (
        pytest.approx(32.0),
        pytest.approx(2.0),
        pytest.approx(8.0),
    )


def test_unsupported_architecture_is_a_clear_error(tmp_path, hf_weights):
    path = write_tiny_llama(tmp_path / "g.gguf", hf_weights, arch="mamba")
    with pytest.raises(ValueError, match=r"architecture 'mamba'.*supported.*llama"):
        load_gguf(path)


def test_load_model_on_a_directory_with_one_gguf(tmp_path, hf_weights):
    write_tiny_llama(tmp_path / "only.gguf", hf_weights)
    model = load_model(str(tmp_path))
    assert model.name == "only" and model.config.hidden_size == HIDDEN
    write_tiny_llama(tmp_path / "second.gguf", hf_weights)
    with pytest.raises(ValueError, match="2 .gguf files"):
        load_model(str(tmp_path))


@pytest.fixture(scope="module")
def tiny_gguf_dir(tmp_path_factory, hf_weights):
    d = tmp_path_factory.mktemp("hf_ref")
    write_tiny_llama(d / "tiny.gguf", hf_weights, Q.Q8_0)
    return d


def test_matches_transformers_loading_the_same_file(tiny_gguf_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_gguf_dir, gguf_file="tiny.gguf", dtype=torch.float32
    )
    ours = load_gguf(tiny_gguf_dir / "tiny.gguf")
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied copy
    assert set(state) == set(ours.weights)
    for name, tensor in state.items():
        assert torch.equal(ours.weights[name], tensor), name
    assert ours.config.rms_norm_eps == hf.config.rms_norm_eps
    assert ours.config.rope_theta == hf.config.rope_parameters["rope_theta"]
