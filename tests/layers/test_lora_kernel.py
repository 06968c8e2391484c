"""The C++ batched LoRA kernel (kernels/csrc/lora.cpp, through layers/lora.py's LoRASlots),
and torch's path where it does not apply (float16), against a per-adapter float32 reference:
rows of several slots interleaved, rows without an adapter (-1) left bit for bit alone, each
slot's own rank (columns), output sizes that are not multiples of the vector width; and batch
invariance: a row's result is the same bit for bit alone or among any other rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import kernels
from pagedllm.layers.lora import LoRAContext, LoRAMapping, LoRASlots

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")


def _slots(dtype, ranks, d_in=96, d_out=200, max_rank=16, seed=0):
    """A LoRASlots with one random adapter per slot, of the given ranks (0: empty slot)."""
    g = torch.Generator().manual_seed(seed)
    lora = LoRASlots(LoRAContext(), len(ranks), 1, max_rank, d_in, d_out, dtype,
                     torch.device("cpu"))  # fmt: skip
    pairs = []
    for slot, r in enumerate(ranks):
        a = torch.randn(r, d_in, generator=g) / d_in**0.5
        b = torch.randn(d_out, r, generator=g) / max(r, 1) ** 0.5
        lora.set_slot(slot, a if r else None, b if r else None)
        pairs.append((a.to(dtype).float(), b.to(dtype).float()))
    return lora, pairs


def _apply(lora, y, x, slots):
    lora.context.mapping = LoRAMapping(np.asarray(slots, np.int64), torch.device("cpu"))
    out = y.clone()
    lora.apply(out, x)
    return out


# float16 has no C++ kernel: it takes torch's products per slot (the path without kernels)
@pytest.mark.parametrize(
    "dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)]
)
@pytest.mark.parametrize("slots", [[0, -1, 2, 0, 1, -1, 2, 2, 1], [1] * 11, [-1, -1]])
def test_matches_the_reference(dtype, tol, slots):
    lora, pairs = _slots(dtype, [8, 16, 3])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(slots), 96, generator=g).to(dtype)
    y = torch.randn(len(slots), 200, generator=g).to(dtype)
    out = _apply(lora, y, x, slots)
    for t, s in enumerate(slots):
        if s < 0:
            assert torch.equal(out[t], y[t])
            continue
        a, b = pairs[s]
        want = y[t].float() + (x[t].float() @ a.T) @ b.T
        torch.testing.assert_close(out[t].float(), want, atol=tol, rtol=tol)


def test_an_empty_slot_leaves_its_rows_alone():
    lora, _ = _slots(torch.float32, [4, 0])
    x, y = torch.randn(3, 96), torch.randn(3, 200)
    out = _apply(lora, y, x, [1, 0, 1])
    assert torch.equal(out[0], y[0]) and torch.equal(out[2], y[2]) and not torch.equal(out[1], y[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_alone_and_in_any_batch(dtype):
    lora, _ = _slots(dtype, [16, 8, 12], d_in=576, d_out=1600)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, 576, generator=g).to(dtype)
    y = torch.randn(37, 1600, generator=g).to(dtype)
    slots = [int(s) for s in torch.randint(-1, 3, (37,), generator=g)]
    together = _apply(lora, y, x, slots)
    for t in (0, 5, 36):
        alone = _apply(lora, y[t : t + 1], x[t : t + 1], slots[t : t + 1])
        assert torch.equal(alone[0], together[t])
