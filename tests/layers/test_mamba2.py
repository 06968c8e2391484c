"""The Mamba-2 scan: the chunked form (ssd_scan) against the recurrence token by token, across
chunk boundaries and from a carried state; and a sequence split into steps (the engine's chunked
prefill, then decode rows batched with other sequences) against the same sequence in one step."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import ModelArchConfig
from pagedllm.layers.mamba2 import MambaMixer2, ssd_scan, ssm_scan_reference
from pagedllm.layers.recurrent import RecurrentState


@pytest.mark.parametrize("length", [1, 2, 63, 64, 65, 200])
@pytest.mark.parametrize("chunk", [64, 7])
def test_chunked_scan_equals_the_recurrence(length, chunk):
    g = torch.Generator().manual_seed(length * 31 + chunk)
    heads, head_dim, state = 6, 8, 5
    x = torch.randn(length, heads, head_dim, generator=g)
    b = torch.randn(length, heads, state, generator=g)
    c = torch.randn(length, heads, state, generator=g)
    dt = torch.rand(length, heads, generator=g) * 0.5  # softplus outputs: positive
    a = -torch.rand(heads, generator=g) * 4  # -exp(A_log): negative
    h0 = torch.randn(heads, head_dim, state, generator=g)
    y, h = ssd_scan(x, b, c, dt, a, h0.clone(), chunk=chunk)
    y_ref, h_ref = ssm_scan_reference(x, b, c, dt, a, h0.clone())
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)


def _mixer(seed: int = 0) -> MambaMixer2:
    config = ModelArchConfig(
        architecture="GraniteMoeHybridForCausalLM", vocab_size=10, hidden_size=32,
        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16, layer_types=["mamba"], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=8,
    )  # fmt: skip
    mixer = MambaMixer2(config, torch.float32, None, "mamba")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return mixer


def _pool(mixer: MambaMixer2, slots: int) -> RecurrentState:
    return RecurrentState(
        torch.full((slots, mixer.conv_dim, mixer.kernel - 1), float("nan")),
        torch.full((slots, mixer.num_heads, mixer.head_dim, mixer.state_size), float("nan")),
    )


@torch.inference_mode()
def test_a_sequence_in_steps_beside_others_equals_it_in_one_step():
    mixer = _mixer()
    g = torch.Generator().manual_seed(1)
    seq = torch.randn(90, 32, generator=g)
    other = torch.randn(90, 32, generator=g)
    whole = mixer(seq, _pool(mixer, 1), [0], [0, 90], [True])
    # Steps of 50, 30, then single tokens, each beside another sequence in its own slot (the
    # singles go through the batched decode path together).
    state = _pool(mixer, 3)
    parts, done = [], 0
    for n in [50, 30] + [1] * 10:
        x = torch.cat([other[done : done + n], seq[done : done + n]])
        out = mixer(x, state, [2, 0], [0, n, 2 * n], [done == 0, done == 0])
        parts.append(out[n:])
        done += n
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("state", [128, 20])  # whole vectors, and a tail
def test_the_decode_kernel_equals_the_torch_step(state, monkeypatch):
    """The C++ one-step update against layers/mamba2.py's torch step: the states within an ulp
    (exp's own rounding may differ), y within float32 rounding (its sum adds in another order)."""
    from pagedllm import kernels

    if not kernels.available():
        pytest.skip("the C++ kernels do not build here")
    g = torch.Generator().manual_seed(state)
    rows, heads, head_dim = 5, 6, 16
    ssm = torch.randn(8, heads, head_dim, state, generator=g)
    slots = torch.tensor([3, 0, 7, 1, 5])
    x = torch.randn(rows, heads, head_dim, generator=g)
    dt = torch.rand(rows, heads, generator=g)
    a = -torch.rand(heads, generator=g) * 4
    b = torch.randn(rows, heads, state, generator=g)
    c = torch.randn(rows, heads, state, generator=g)
    want_h = ssm.clone()
    want_y = torch.empty(rows, heads, head_dim)
    for r, s in enumerate(slots.tolist()):
        h = want_h[s] * torch.exp(dt[r] * a)[:, None, None]
        h = h + (dt[r][:, None] * x[r])[..., None] * b[r][:, None, :]
        want_h[s] = h
        want_y[r] = (h * c[r][:, None, :]).sum(-1)
    y = torch.empty(rows, heads, head_dim)
    kernels.cpu_ops().mamba_state_update(ssm, slots, x, dt, a, b, c, y)
    torch.testing.assert_close(ssm, want_h, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
    untouched = [s for s in range(8) if s not in slots.tolist()]
    assert torch.equal(ssm[untouched], want_h[untouched])
