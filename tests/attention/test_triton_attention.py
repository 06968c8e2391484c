"""The Triton backend's kernels against the torch reference and dense attention.

On a machine without a GPU they run on CPU tensors under Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1); with one, on CUDA. Caches start full of NaN and block tables are
shuffled (build_batch), so a kernel reading a slot it should not poisons its output. Sizes are
small: the interpreter runs every program of a launch one after another.
"""

from __future__ import annotations

import functools

import pytest
import torch

from pagedllm.attention import get_attention_backend, paged_attention_ref, write_kv_cache
from pagedllm.attention.selector import resolve_backend_name
from pagedllm.attention.triton_attention import (
    BLOCK_N,
    copy_blocks_triton,
    paged_attention_triton,
    write_kv_cache_triton,
)
from tests.attention.test_paged_attention import (
    _attend_paged,
    build_batch,
    dense_causal_attention,
    scenario,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (num_heads, num_kv_heads): GQA ratios 1, 3 and 8
HEADS = [(2, 2), (6, 2), (16, 2)]


def _check(out, b, scale, atol, window=None, soft_cap=None):
    meta = b["meta"]
    assert out.shape == b["query"].shape and out.dtype == b["query"].dtype
    for i, (q, k, v) in enumerate(b["dense"]):
        rows = out[meta.query_start_loc_cpu[i] : meta.query_start_loc_cpu[i + 1]].float().cpu()
        expected = dense_causal_attention(q, k, v, scale, window, soft_cap).float()
        torch.testing.assert_close(rows, expected, atol=atol, rtol=0, msg=f"request {i}")


def _batch(reqs, block_size, heads, head_dim, seed, dtype=torch.float32):
    b = build_batch(reqs, block_size, *heads, head_dim, dtype=dtype, seed=seed, device=DEVICE)
    write_kv_cache_triton(b["key"], b["value"], b["k_cache"], b["v_cache"], b["meta"].slot_mapping)
    return b


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"gqa{h[0] // h[1]}")
def test_mixed_batch_matches_dense(block_size, head_dim, heads):
    """Decode, fresh prompts and chunks with cached context in one batch."""
    seed = block_size * 1000 + head_dim + heads[0]
    b = _batch(scenario("mixed", block_size, seed), block_size, heads, head_dim, seed)
    scale = head_dim**-0.5
    _check(paged_attention_triton(b["query"], b["k_cache"], b["v_cache"], b["meta"], scale),
           b, scale, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("partition_size", [16, 48, 512])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"gqa{h[0] // h[1]}")
def test_decode_split_across_programs_matches_dense(block_size, partition_size, heads):
    """Contexts that end on, just before and just after block, tile (BLOCK_N) and split
    boundaries; partition 16 cuts the longest into 16 splits, some of them empty for the
    shorter requests in the step."""
    lens = [1, block_size, block_size + 1, BLOCK_N - 1, BLOCK_N, BLOCK_N + 1, 3 * BLOCK_N + 7]
    reqs = [(n - 1, 1) for n in lens]
    b = _batch(reqs, block_size, heads, 64, seed=partition_size + block_size)
    out = paged_attention_triton(b["query"], b["k_cache"], b["v_cache"], b["meta"], 0.125,
                                 partition_size=partition_size)  # fmt: skip
    _check(out, b, 0.125, atol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 33, 70])
@pytest.mark.parametrize("soft_cap", [None, 5.0])
@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_sliding_window_and_soft_cap_match_dense(window, soft_cap, kind):
    """Blocks wholly before the first query's window are NaN (released by a sliding layer)."""
    block_size = 4
    reqs = scenario(kind, block_size, window)
    if kind == "decode":
        reqs.append((150, 1))  # long enough for several splits, most outside the window
    b = _batch(reqs, block_size, (6, 2), 64, seed=window)
    tables = b["meta"].block_tables.tolist()
    for i, (num_computed, _) in enumerate(reqs):
        for block_id in tables[i][: max(0, num_computed - window + 1) // block_size]:
            b["k_cache"][block_id] = float("nan")
            b["v_cache"][block_id] = float("nan")
    out = paged_attention_triton(b["query"], b["k_cache"], b["v_cache"], b["meta"], 0.125,
                                 sliding_window=window, logits_soft_cap=soft_cap,
                                 partition_size=16)  # fmt: skip
    _check(out, b, 0.125, atol=1e-5, window=window, soft_cap=soft_cap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_half_precision_matches_reference(dtype, kind):
    """bfloat16/float16 caches: as close to the float32 reference on the same inputs as one
    rounding of the output allows (decode steps split the 101-token context in 8)."""
    reqs = scenario(kind, 8, 3) + [(100, 1)]
    b = _batch(reqs, 8, (16, 2), 128, seed=3, dtype=dtype)
    args = b["query"], b["k_cache"], b["v_cache"], b["meta"], 128**-0.5
    out = paged_attention_triton(*args, partition_size=16)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), paged_attention_ref(*args).float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_write_kv_cache_equals_reference(dtype, block_size):
    """From strided views (a fused QKV projection's K and V columns), with a padding token
    (slot -1) that must write nothing: bit for bit what the reference writes."""
    b = build_batch(scenario("mixed", block_size, 5), block_size, 6, 2, 64, dtype=dtype, seed=5,
                    device=DEVICE)  # fmt: skip
    n = b["key"].shape[0]
    qkv = torch.randn(n + 1, 3, 2, 64, device=DEVICE).to(dtype)
    qkv[:n, 1], qkv[:n, 2] = b["key"], b["value"]
    key, value = qkv[:, 1], qkv[:, 2]  # rows strided by the QKV width
    slots = torch.cat([b["meta"].slot_mapping, torch.tensor([-1], device=DEVICE)])
    ref_k, ref_v = b["k_cache"].clone(), b["v_cache"].clone()
    write_kv_cache(b["key"], b["value"], ref_k, ref_v, b["meta"].slot_mapping)
    write_kv_cache_triton(key, value, b["k_cache"], b["v_cache"], slots)
    torch.testing.assert_close(b["k_cache"], ref_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(b["v_cache"], ref_v, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("block_size", [1, 16])
def test_copy_blocks_within_a_pool_and_through_staging(block_size):
    """Copy-on-write moves blocks inside the pool; swapping gathers blocks into a staging
    buffer and scatters them back: every layer's K and V, and nothing else."""
    g = torch.Generator().manual_seed(block_size)
    pool = torch.randn(3, 2, 12, block_size, 2, 64, generator=g).to(DEVICE)
    src = torch.tensor([5, 0, 11, 5], device=DEVICE)
    dst = torch.tensor([1, 7, 3, 9], device=DEVICE)
    expected = pool.clone()
    expected[:, :, dst] = pool[:, :, src]
    copy_blocks_triton(pool, pool, src, dst)
    assert torch.equal(pool, expected)

    staging = torch.zeros(3, 2, 4, block_size, 2, 64, device=DEVICE)
    copy_blocks_triton(pool, staging, src, torch.arange(4, device=DEVICE))
    assert torch.equal(staging, pool[:, :, src])
    restored = torch.zeros_like(pool)
    copy_blocks_triton(staging, restored, torch.arange(4, device=DEVICE), dst)
    assert torch.equal(restored[:, :, dst], pool[:, :, src])
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[dst.cpu()] = False
    assert not restored[:, :, untouched.to(DEVICE)].any()


@pytest.mark.parametrize("kwargs", [{}, {"sliding_window": 9}])
def test_deterministic_row_is_the_same_whatever_the_step(kwargs):
    """deterministic: a query row's output is bit for bit the same in its prompt's prefill, in
    a chunk, as a decode step alone, beside a long request (which splits decode steps across
    programs otherwise) and with blocks of 1, 16 or 32 tokens (docs/determinism.md)."""
    if DEVICE != "cpu":
        pytest.skip("the shared helper builds CPU tensors")
    context, q_len = 70, 9
    g = torch.Generator().manual_seed(7)
    q = torch.randn(q_len, 6, 64, generator=g)
    k, v = (torch.randn(context + q_len, 2, 64, generator=g) for _ in range(2))
    attend = functools.partial(paged_attention_triton, partition_size=16, deterministic=True)
    prefill = _attend_paged(q, k, v, 16, attend=attend, **kwargs)  # the whole prompt at once
    dense = dense_causal_attention(q, k, v, 64**-0.5, kwargs.get("sliding_window")).float()
    torch.testing.assert_close(prefill, dense, atol=1e-5, rtol=0)
    for r in (0, q_len - 1):
        p = context + r + 1
        for block_size, others in [(16, ()), (1, ()), (32, ((150, 1), (40, 5)))]:
            alone = _attend_paged(q[r : r + 1], k[:p], v[:p], block_size, others, seed=r,
                                  attend=attend, **kwargs)  # fmt: skip
            assert torch.equal(alone[0], prefill[r]), (r, block_size, others)
        chunk = _attend_paged(q[r:], k, v, 16, ((150, 1),), attend=attend, **kwargs)
        assert torch.equal(chunk[0], prefill[r]), r


def test_backend_selection(monkeypatch):
    backend = get_attention_backend("triton", DEVICE)
    assert backend.forward is paged_attention_triton
    fixed = get_attention_backend("triton", DEVICE, deterministic=True)
    assert fixed.forward.keywords == {"deterministic": True}
    assert backend.write_kv_cache is write_kv_cache_triton
    assert backend.copy_blocks is copy_blocks_triton
    assert resolve_backend_name("auto", "cuda") == "triton"  # the default on a GPU
    assert resolve_backend_name("auto", "cpu") != "triton"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend_name("triton", "cpu")
