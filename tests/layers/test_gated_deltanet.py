"""The Gated DeltaNet (layers/gated_deltanet.py): the chunked delta rule against the recurrence
token by token, across chunk boundaries and from a carried state; the layer against
transformers' Qwen3NextGatedDeltaNet on the same weights; a sequence split into steps (chunked
prefill, then decode rows beside other sequences) against it in one step; and llama.cpp's tiled
value-head order against transformers' grouped one."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import ModelArchConfig
from pagedllm.layers.gated_deltanet import (
    GatedDeltaNet,
    chunked_delta_rule,
    delta_rule_reference,
    delta_rule_step,
)
from pagedllm.layers.recurrent import RecurrentState


@pytest.mark.parametrize("length", [1, 2, 63, 64, 65, 200])
@pytest.mark.parametrize("chunk", [64, 7])
def test_chunked_delta_rule_equals_the_recurrence(length, chunk):
    g = torch.Generator().manual_seed(length * 31 + chunk)
    heads, dk, dv = 3, 16, 8
    q = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=g), dim=-1)
    v = torch.randn(length, heads, dv, generator=g)
    decay = -torch.rand(length, heads, generator=g) * 2  # log decays: <= 0
    beta = torch.rand(length, heads, generator=g)
    s0 = torch.randn(heads, dk, dv, generator=g)
    o, s = chunked_delta_rule(q, k, v, decay, beta, s0.clone(), chunk=chunk)
    o_ref, s_ref = delta_rule_reference(q, k, v, decay, beta, s0)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=1e-5)


def _config(k_heads=2, v_heads=4, tiled=False) -> ModelArchConfig:
    return ModelArchConfig(
        architecture="Qwen3NextForCausalLM", vocab_size=10, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
        layer_types=["linear_attention"], linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_value_heads_tiled=tiled,
    )  # fmt: skip


def _layer(config: ModelArchConfig, seed: int = 0) -> GatedDeltaNet:
    layer = GatedDeltaNet(config, torch.float32, None, "linear_attn")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer


def _pool(layer: GatedDeltaNet, slots: int) -> RecurrentState:
    """NaN-filled: a slot read before it is written turns the output into NaN."""
    kernel = layer.conv1d.weight.shape[-1]
    return RecurrentState(
        torch.full((slots, layer.conv_dim, kernel - 1), float("nan")),
        torch.full((slots, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim), float("nan")),
    )


@torch.inference_mode()
def test_the_layer_equals_transformers_on_the_same_weights():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = _config()
    ours = _layer(config)
    hf_config = Qwen3NextConfig(
        hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, num_hidden_layers=1, layer_types=["linear_attention"],
    )  # fmt: skip
    hf = Qwen3NextGatedDeltaNet(hf_config, 0).eval()
    # transformers' in_proj_qkvz / in_proj_ba interleave the heads: the model's split_weight
    # takes them apart, so build them the other way round here.
    w = ours.in_proj_qkvz.weight
    q, k, v, z = w.split([32, 32, 32, 32])
    per_head = [t.view(2, -1, 32) for t in (q, k, v, z)]
    b, a = (t.view(2, 2, 32) for t in ours.in_proj_ba.weight.split([4, 4]))
    with torch.no_grad():
        hf.in_proj_qkvz.weight.copy_(torch.cat(per_head, dim=1).reshape(-1, 32))
        hf.in_proj_ba.weight.copy_(torch.cat([b, a], dim=1).reshape(-1, 32))
        for name in ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight"):
            hf.get_parameter(name).copy_(ours.get_parameter(name))
    x = torch.randn(1, 150, 32, generator=torch.Generator().manual_seed(3))  # 3 chunks of 64
    want = hf(x)[0]
    got = ours(x[0], _pool(ours, 1), [0], [0, 150], [True])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_a_sequence_in_steps_beside_others_equals_it_in_one_step():
    layer = _layer(_config())
    g = torch.Generator().manual_seed(1)
    seq = torch.randn(90, 32, generator=g)
    other = torch.randn(90, 32, generator=g)
    whole = layer(seq, _pool(layer, 1), [0], [0, 90], [True])
    # Steps of 50, 30, then single tokens, each beside another sequence in its own slot (the
    # other's slot first, so that slots and rows differ).
    pool, outs, start = _pool(layer, 3), [], 0
    for i, size in enumerate([50, 30] + [1] * 10):
        part = seq[start : start + size]
        x = torch.cat([other[i : i + 1], part])
        out = layer(x, pool, [2, 1], [0, 1, 1 + size], [i == 0, start == 0])
        outs.append(out[1:])
        start += size
    torch.testing.assert_close(torch.cat(outs), whole, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_tiled_value_heads_compute_the_same_as_grouped_ones():
    """llama.cpp's Qwen3.5 files put value head (group g, index i) at i * groups + g: with every
    per-value-head weight permuted alike, the tiled layer's output equals the grouped one's (3
    value heads per key head: with as many as key heads, the two orders would pair alike)."""
    k_heads, r, dv = 2, 3, 8
    grouped = _layer(_config(k_heads, k_heads * r))
    tiled = _layer(_config(k_heads, k_heads * r, tiled=True))
    heads = torch.arange(k_heads * r).view(k_heads, r).T.flatten()  # tiled position -> grouped
    rows = (heads[:, None] * dv + torch.arange(dv)).flatten()
    qk = 2 * grouped.key_dim
    with torch.no_grad():
        qkv, z = grouped.in_proj_qkvz.weight.split([grouped.conv_dim, grouped.value_dim])
        tiled.in_proj_qkvz.weight.copy_(torch.cat([qkv[:qk], qkv[qk:][rows], z[rows]]))
        b, a = grouped.in_proj_ba.weight.chunk(2)
        tiled.in_proj_ba.weight.copy_(torch.cat([b[heads], a[heads]]))
        conv = grouped.conv1d.weight
        tiled.conv1d.weight.copy_(torch.cat([conv[:qk], conv[qk:][rows]]))
        tiled.dt_bias.copy_(grouped.dt_bias[heads])
        tiled.A_log.copy_(grouped.A_log[heads])
        tiled.norm.weight.copy_(grouped.norm.weight)
        tiled.out_proj.weight.copy_(grouped.out_proj.weight[:, rows])
    x = torch.randn(70, 32, generator=torch.Generator().manual_seed(2))
    want = grouped(x, _pool(grouped, 1), [0], [0, 70], [True])
    torch.testing.assert_close(tiled(x, _pool(tiled, 1), [0], [0, 70], [True]), want)


@pytest.mark.parametrize("dv", [128, 20])  # whole vectors, and a tail
def test_the_decode_kernel_equals_the_torch_step(dv):
    """The C++ one-step update against delta_rule_step, the states of the rows' slots only:
    within float32 rounding (the decay is applied after S^T k's sum there, before it here)."""
    from pagedllm import kernels

    if not kernels.available():
        pytest.skip("the C++ kernels do not build here")
    g = torch.Generator().manual_seed(dv)
    rows, heads, dk = 5, 3, 32
    ssm = torch.randn(8, heads, dk, dv, generator=g)
    slots = torch.tensor([3, 0, 7, 1, 5])
    q = torch.nn.functional.normalize(torch.randn(rows, heads, dk, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(rows, heads, dk, generator=g), dim=-1)
    v = torch.randn(rows, heads, dv, generator=g)
    decay = -torch.rand(rows, heads, generator=g) * 2
    beta = torch.rand(rows, heads, generator=g)
    want = ssm.clone()
    want_o = torch.stack([
        delta_rule_step(q[r : r + 1], k[r : r + 1], v[r : r + 1], decay[r : r + 1],
                        beta[r : r + 1], want[s][None])[0]
        for r, s in enumerate(slots.tolist())
    ])  # fmt: skip
    o = torch.empty(rows, heads, dv)
    kernels.cpu_ops().delta_rule_state_update(ssm, slots, q, k, v, decay, beta, o)
    torch.testing.assert_close(ssm, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
    untouched = [s for s in range(8) if s not in slots.tolist()]
    assert torch.equal(ssm[untouched], want[untouched])


@torch.inference_mode()
def test_decode_rows_step_alike_with_and_without_the_kernel(monkeypatch):
    """The torch path (no C++ kernels) steps each state where it lies, as the kernel does."""
    from pagedllm import kernels

    if not kernels.available():
        pytest.skip("the C++ kernels do not build here")
    layer = _layer(_config())
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(5))
    outs = []
    for fused in (True, False):
        monkeypatch.setattr(kernels, "fused_cpu_ops_apply", lambda t, fused=fused: fused)
        pool = _pool(layer, 2)
        out = [layer(x[:30], pool, [1], [0, 30], [True])]
        out += [layer(x[i : i + 1], pool, [1], [0, 1], [False]) for i in range(30, 40)]
        outs.append(torch.cat(out))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
