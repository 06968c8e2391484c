"""Layers against their HF counterparts, bit for bit where the arithmetic is the same."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from pagedllm import kernels
from pagedllm.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from pagedllm.layers.rotary import compute_inv_freq

HEAD_DIM = 64
ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
}


def hf_config(rope: dict) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        max_position_embeddings=1024,
        rope_parameters={**rope, "rope_theta": 500000.0},
    )


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_inv_freq_matches_hf(rope):
    cfg = hf_config(ROPES[rope])
    if rope == "default":
        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope](cfg)
    ours, _ = compute_inv_freq(HEAD_DIM, 500000.0, ROPES[rope], 1024)
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rotary_matches_hf_exactly(rope, dtype):
    cfg = hf_config(ROPES[rope])
    hf_rope = LlamaRotaryEmbedding(cfg)
    ours = RotaryEmbedding(HEAD_DIM, 1024, 500000.0, ROPES[rope])
    positions = torch.tensor([0, 1, 2, 517, 5, 1023, 3, 300])  # flattened, unordered
    q = torch.randn(len(positions), 4 * HEAD_DIM).to(dtype)  # [T, H * d], as the model has it
    k = torch.randn(len(positions), 2, HEAD_DIM).to(dtype)  # [T, kv_heads, d]
    cos, sin = hf_rope(q, positions[None])
    hf_q, _ = apply_rotary_pos_emb(
        q.view(1, -1, 4, HEAD_DIM), q.view(1, -1, 4, HEAD_DIM), cos, sin, 2
    )
    hf_k, _ = apply_rotary_pos_emb(k[None], k[None], cos, sin, 2)
    our_q, our_k = ours(positions, q, k)
    assert our_q.shape == q.shape and our_k.shape == k.shape
    torch.testing.assert_close(our_q, hf_q.view_as(q), atol=0, rtol=0)
    torch.testing.assert_close(our_k, hf_k[0], atol=0, rtol=0)


def test_rope_scaling_types():
    default, n = compute_inv_freq(HEAD_DIM, 10000.0, None, 1024)
    assert n == 1024
    same, _ = compute_inv_freq(HEAD_DIM, 10000.0, {"type": "default"}, 1024)  # legacy key
    assert torch.equal(same, default)
    linear, n = compute_inv_freq(HEAD_DIM, 10000.0, {"type": "linear", "factor": 2.0}, 1024)
    assert n == 2048 and torch.allclose(linear, default / 2)
    dynamic, n = compute_inv_freq(HEAD_DIM, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, 1024)
    assert n == 2048 and dynamic[0] == 1 and (dynamic[1:] < default[1:]).all()
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'longrope'"):
        RotaryEmbedding(HEAD_DIM, 1024, 10000.0, {"rope_type": "longrope", "factor": 4.0})


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_tables_equal_transformers(truncate):
    """cos and sin (YaRN's attention factor in them) as gpt-oss's rotary embedding makes them,
    the correction range rounded to whole dims or not."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from pagedllm.model_loader.hf_config import _rope

    rope = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=truncate,
                original_max_position_embeddings=256, rope_theta=150000.0)  # fmt: skip
    config = GptOssConfig(head_dim=64, hidden_size=256, num_attention_heads=4,
                          max_position_embeddings=8192, rope_parameters=rope)  # fmt: skip
    hf = GptOssRotaryEmbedding(config)
    theta, scaling, _ = _rope(config.to_dict())
    ours = RotaryEmbedding(64, 8192, theta, scaling)
    positions = torch.arange(0, 8192, 37)
    cos, sin = hf(torch.zeros(1), positions[None])
    assert hf.attention_scaling > 1.3  # the factor is there to be checked
    assert torch.equal(ours.cos_cache[positions], cos[0])
    assert torch.equal(ours.sin_cache[positions], sin[0])


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf(dtype, fused, monkeypatch):
    """Exactly, but for the fused C++ kernel in float32: its sum of squares adds in another
    order than torch's vectorised reduction, so the scale may differ in the last bit."""
    if not fused:
        monkeypatch.setattr(kernels, "fused_cpu_ops_apply", lambda x: False)
    hf = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    ours = RMSNorm(96, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96))
        ours.weight.copy_(hf.weight)
    x = (3 * torch.randn(7, 96)).to(dtype)
    tol = 2e-7 if fused and dtype == torch.float32 else 0
    torch.testing.assert_close(ours(x), hf(x), atol=tol * 10, rtol=tol)
    # With a residual: (norm(x + residual), x + residual), the sum rounded to dtype.
    residual = torch.randn(7, 96).to(dtype)
    out, new_residual = ours(x, residual.clone())
    torch.testing.assert_close(new_residual, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(out, hf(x + residual), atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, HEAD_DIM // 2])
def test_fused_rotary_equals_the_torch_path(dtype, rotary_dim, monkeypatch):
    """The C++ rotary (in place, on strided q/k slices of a fused qkv) gives the torch code's
    values exactly: it rounds each product and sum to dtype where torch does."""
    rope = RotaryEmbedding(HEAD_DIM, 512, 10000.0, rotary_dim=rotary_dim).to(dtype)
    positions = torch.tensor([0, 5, 511, 17, 3])
    qkv = torch.randn(5, 6 * HEAD_DIM).to(dtype)
    q, k = qkv[:, : 4 * HEAD_DIM], qkv[:, 4 * HEAD_DIM : 5 * HEAD_DIM]
    monkeypatch.setattr(kernels, "fused_cpu_ops_apply", lambda x: False)
    want_q, want_k = rope.apply(q.clone(), k.clone(), rope.cos_sin(positions, dtype))
    monkeypatch.undo()
    cos_sin = rope.cos_sin(positions, dtype)
    assert cos_sin[0] is None  # the fused path
    v_before = qkv[:, 5 * HEAD_DIM :].clone()
    got_q, got_k = rope.apply(q, k, cos_sin)
    torch.testing.assert_close(got_q, want_q, atol=0, rtol=0)
    torch.testing.assert_close(got_k, want_k, atol=0, rtol=0)
    assert torch.equal(qkv[:, 5 * HEAD_DIM :], v_before)  # v untouched


def test_silu_and_mul():
    x = torch.randn(5, 2 * 32)
    gate, up = x[:, :32], x[:, 32:]
    torch.testing.assert_close(SiluAndMul()(x), gate * torch.sigmoid(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [1536, 100, 7])
def test_fused_silu_and_mul_equals_the_torch_path(dtype, d, monkeypatch):
    """Bit for bit, but where torch's own silu finishes a row's tail with scalar std::exp (a
    float32 row whose length is not whole vectors): there within one float32 rounding."""
    if not kernels.available():
        pytest.skip("the C++ kernels do not build here")
    x = (torch.randn(6, 2 * d) * 4).to(dtype)
    fused = SiluAndMul()(x)
    monkeypatch.setattr(kernels, "fused_cpu_ops_apply", lambda x: False)
    want = SiluAndMul()(x)
    tol = 1e-6 if dtype == torch.float32 and d % kernels.cpu_ops().vec_size else 0
    torch.testing.assert_close(fused, want, atol=tol, rtol=tol)


@pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")
def test_fused_elementwise_kernels_give_a_row_its_result_whatever_the_rows():
    """RMSNorm (with and without the residual), rotary and SiLU-and-mul compute each row on its
    own: a row alone equals the same row among 257 (batch invariance, docs/determinism.md)."""
    torch.manual_seed(0)
    norm, act = RMSNorm(576, eps=1e-5), SiluAndMul()
    norm.weight.data.normal_()
    rotary = RotaryEmbedding(64, 512, 10000.0)
    x, res, gate_up = torch.randn(257, 576), torch.randn(257, 576), torch.randn(257, 3072)
    positions = torch.randint(0, 512, (257,))
    q = torch.randn(257, 9 * 64)
    full = (norm(x), norm(x, res.clone()), act(gate_up), rotary(positions, q.clone(), q.clone()))
    for i in (0, 16, 256):
        one = slice(i, i + 1)
        assert torch.equal(norm(x[one])[0], full[0][i])
        out, residual = norm(x[one], res[one].clone())
        assert torch.equal(out[0], full[1][0][i]) and torch.equal(residual[0], full[1][1][i])
        assert torch.equal(act(gate_up[one])[0], full[2][i])
        q_one, k_one = rotary(positions[one], q[one].clone(), q[one].clone())
        assert torch.equal(q_one[0], full[3][0][i]) and torch.equal(k_one[0], full[3][1][i])
