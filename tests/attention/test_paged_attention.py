"""Paged attention backends vs dense causal attention on contiguous tensors.

Caches start full of NaN, so reading any slot that was not written (past a context's end, a
padded block table entry, another request's block) poisons the output and fails the test.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from pagedllm.attention import (
    AttentionMetadata,
    get_attention_backend,
    paged_attention_ref,
    paged_attention_sdpa,
    write_kv_cache,
)
from pagedllm.attention.cpu import paged_attention_cpu, write_kv_cache_cpu

# The CPU backend's hand-off of long prompts to SDPA (`--no-deterministic`), at a threshold
# these small batches reach (the default is 2048 rows).
HANDOFF = 8
BACKENDS = {
    "torch": paged_attention_ref,
    "sdpa": paged_attention_sdpa,
    # The C++ kernel alone, and with the hand-off (prefill chunks of HANDOFF rows or more
    # through SDPA).
    "cpu-kernel": functools.partial(paged_attention_cpu, min_sdpa_query_len=0),
    "cpu": functools.partial(paged_attention_cpu, min_sdpa_query_len=HANDOFF),
}
# (num_heads, num_kv_heads): MHA, GQA ratio 3, GQA ratio 8, MQA
HEADS = [(4, 4), (9, 3), (16, 2), (8, 1)]


def dense_causal_attention(q, k, v, scale, sliding_window=None, soft_cap=None, sinks=None):
    """q [q_len, H, d], k/v [seq_len, kv_heads, d]: q are the last q_len positions. `sinks`
    [H]: a logit per head in the softmax's sum that no value goes with (gpt-oss)."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - q_len)
    if sliding_window is not None:  # HF: key position > query position - window
        mask &= ~torch.ones_like(mask).tril(diagonal=seq_len - q_len - sliding_window)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(-1, q_len, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.double())


def build_batch(
    reqs, block_size, num_heads, num_kv_heads, head_dim, dtype=torch.float32, seed=0, device="cpu"
):
    """reqs: [(num_computed_tokens, q_len)]. Returns everything a backend call needs (on
    `device`) plus the dense per-request tensors (on CPU). Physical blocks are a random
    permutation handed out round-robin, so requests' blocks interleave and no table is
    contiguous."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in reqs]
    blocks_needed = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3  # a few spare blocks nobody owns
    free = torch.randperm(num_blocks, generator=g).tolist()
    block_tables = [[] for _ in reqs]
    for j in range(max(blocks_needed)):
        for i, n in enumerate(blocks_needed):
            if j < n:
                block_tables[i].append(free.pop())
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)

    dense, queries, new_k, new_v, slot_mapping = [], [], [], [], []
    for (num_computed, q_len), table, seq_len in zip(reqs, block_tables, seq_lens, strict=True):
        q = torch.randn(q_len, num_heads, head_dim, generator=g).to(dtype)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        for p in range(num_computed):  # earlier steps' K/V, already in the cache
            k_cache[slots[p] // block_size, slots[p] % block_size] = k[p]
            v_cache[slots[p] // block_size, slots[p] % block_size] = v[p]
        dense.append((q, k, v))
        queries.append(q)
        new_k.append(k[num_computed:])
        new_v.append(v[num_computed:])
        slot_mapping += slots[num_computed:]

    width = max(blocks_needed) + 1  # an extra padded column that must never be read
    tables = np.zeros((len(reqs), width), np.int32)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = table
    meta = AttentionMetadata.build(
        block_size, slot_mapping, tables, [q for _, q in reqs], seq_lens, device
    )
    return dict(
        query=torch.cat(queries).to(device),
        key=torch.cat(new_k).to(device),
        value=torch.cat(new_v).to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        meta=meta,
        dense=dense,
    )


def scenario(kind: str, block_size: int, seed: int) -> list[tuple[int, int]]:
    """[(num_computed_tokens, q_len)] per request; lengths cross block boundaries."""
    g = torch.Generator().manual_seed(seed)

    def rand(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=g))

    bs = block_size
    decode = [(0, 1), (bs - 1, 1), (bs, 1), (2 * bs + rand(1, bs), 1), (rand(1, 40), 1)]
    prefill = [(0, 1 + bs), (0, rand(2, 40)), (0, 2)]
    chunked = [(bs, bs + 1), (rand(1, 30), rand(2, 20)), (bs - 1, 2)]
    if kind == "decode":
        reqs = decode
    elif kind == "prefill":
        reqs = prefill
    else:
        reqs = decode + prefill + chunked
    order = torch.randperm(len(reqs), generator=g).tolist()
    return [reqs[i] for i in order]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_mixed_batch_matches_dense(backend, block_size, head_dim, heads):
    num_heads, num_kv_heads = heads
    seed = block_size * 1000 + head_dim + num_heads
    reqs = scenario("mixed", block_size, seed)
    _check_against_dense(BACKENDS[backend], reqs, block_size, heads, head_dim, seed)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_uniform_batch_matches_dense(backend, kind, block_size):
    reqs = scenario(kind, block_size, seed=7)
    _check_against_dense(BACKENDS[backend], reqs, block_size, (9, 3), 64, seed=7)


def _check_against_dense(attn_fn, reqs, block_size, heads, head_dim, seed, atol=1e-5):
    num_heads, num_kv_heads = heads
    b = build_batch(reqs, block_size, num_heads, num_kv_heads, head_dim, seed=seed)
    meta = b["meta"]
    write_kv_cache(b["key"], b["value"], b["k_cache"], b["v_cache"], meta.slot_mapping)
    scale = head_dim**-0.5
    out = attn_fn(b["query"], b["k_cache"], b["v_cache"], meta, scale)
    assert out.shape == b["query"].shape and out.dtype == b["query"].dtype
    for i, (q, k, v) in enumerate(b["dense"]):
        rows = out[meta.query_start_loc_cpu[i] : meta.query_start_loc_cpu[i + 1]]
        expected = dense_causal_attention(q, k, v, scale).float()
        torch.testing.assert_close(rows, expected, atol=atol, rtol=0, msg=f"request {i} {reqs[i]}")


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_bfloat16_close_to_dense(backend):
    reqs = scenario("mixed", 4, seed=3)
    b = build_batch(reqs, 4, 8, 2, 64, dtype=torch.bfloat16, seed=3)
    meta = b["meta"]
    write_kv_cache(b["key"], b["value"], b["k_cache"], b["v_cache"], meta.slot_mapping)
    out = BACKENDS[backend](b["query"], b["k_cache"], b["v_cache"], meta, 0.125)
    assert out.dtype == torch.bfloat16
    for i, (q, k, v) in enumerate(b["dense"]):
        rows = out[meta.query_start_loc_cpu[i] : meta.query_start_loc_cpu[i + 1]].float()
        torch.testing.assert_close(
            rows, dense_causal_attention(q, k, v, 0.125).float(), atol=3e-2, rtol=0
        )


@pytest.mark.parametrize("writer", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_write_kv_cache_puts_each_token_in_its_slot(block_size, dtype, writer):
    reqs = scenario("mixed", block_size, seed=11)
    b = build_batch(reqs, block_size, 6, 2, 64, dtype=dtype, seed=11)
    k_cache, v_cache, meta = b["k_cache"], b["v_cache"], b["meta"]
    untouched_before = k_cache.isnan().all(-1).all(-1)  # [num_blocks, block_size]
    write = write_kv_cache if writer == "torch" else write_kv_cache_cpu
    write(b["key"], b["value"], k_cache, v_cache, meta.slot_mapping)
    written = torch.zeros_like(untouched_before)
    for t, slot in enumerate(meta.slot_mapping.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(k_cache[block, offset], b["key"][t])
        assert torch.equal(v_cache[block, offset], b["value"][t])
        written[block, offset] = True
    # Nothing else changed: slots that were empty and not targeted are still NaN.
    assert k_cache.isnan().all(-1).all(-1)[untouched_before & ~written].all()
    assert v_cache.isnan().all(-1).all(-1)[untouched_before & ~written].all()
    # Each token's slot is where the block table says position p lives.
    tables = meta.block_tables.tolist()
    t = 0
    for i, (num_computed, q_len) in enumerate(reqs):
        for p in range(num_computed, num_computed + q_len):
            expected = tables[i][p // block_size] * block_size + p % block_size
            assert meta.slot_mapping[t] == expected
            t += 1


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 33])
@pytest.mark.parametrize("soft_cap", [None, 5.0])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_sliding_window_and_soft_cap_match_dense(backend, block_size, window, soft_cap,
                                                 with_sinks):  # fmt: skip
    """Blocks wholly before the first query's window are NaN (released and reused by a sliding
    layer): reading one would poison the output. With attention sinks (gpt-oss's sliding
    layers have them), large enough to take much of the weight."""
    seed = block_size * 100 + window
    sinks = (
        torch.randn(9, generator=torch.Generator().manual_seed(seed)) * 2 if with_sinks else None
    )
    extra = {} if sinks is None else {"sinks": sinks}
    reqs = scenario("mixed", block_size, seed)
    b = build_batch(reqs, block_size, 9, 3, 64, seed=seed)
    meta = b["meta"]
    write_kv_cache(b["key"], b["value"], b["k_cache"], b["v_cache"], meta.slot_mapping)
    tables = meta.block_tables.tolist()
    for i, (num_computed, _) in enumerate(reqs):
        first_visible = max(0, num_computed - window + 1)
        for block_id in tables[i][: first_visible // block_size]:
            b["k_cache"][block_id] = float("nan")
            b["v_cache"][block_id] = float("nan")
    out = BACKENDS[backend](
        b["query"], b["k_cache"], b["v_cache"], meta, 0.125,
        sliding_window=window, logits_soft_cap=soft_cap, **extra,
    )  # fmt: skip
    for i, (q, k, v) in enumerate(b["dense"]):
        rows = out[meta.query_start_loc_cpu[i] : meta.query_start_loc_cpu[i + 1]]
        expected = dense_causal_attention(q, k, v, 0.125, window, soft_cap, sinks).float()
        torch.testing.assert_close(rows, expected, atol=1e-5, rtol=0, msg=f"request {i} {reqs[i]}")


def test_backend_selection():
    assert get_attention_backend("torch").forward is paged_attention_ref
    assert get_attention_backend("sdpa").forward is paged_attention_sdpa
    assert get_attention_backend("cpu").forward is paged_attention_cpu
    # The kernel builds on this machine (make setup builds it), so auto picks it on CPU.
    assert get_attention_backend("auto").forward is paged_attention_cpu
    with pytest.raises(ValueError, match="not cuda"):
        get_attention_backend("cpu", device="cuda")
    # --deterministic: every request through the kernel, which alone has the fixed order
    fixed = get_attention_backend("auto", deterministic=True)
    assert fixed.name == "cpu" and fixed.forward.keywords == {"min_sdpa_query_len": 0}
    with pytest.raises(ValueError, match="needs the cpu or triton attention backend"):
        get_attention_backend("sdpa", deterministic=True)
    with pytest.raises(ValueError, match="auto, cpu, sdpa, torch, triton"):
        get_attention_backend("flash")


@pytest.mark.parametrize("backend", ["sdpa", "cpu"])
@pytest.mark.parametrize("window", [None, 7])
def test_fresh_prompts_read_this_steps_kv(backend, window):
    """Given this step's K/V, prompts with no cached context attend to them directly: the
    result is the same, and their slots in the cache are not read (they are NaN here)."""
    reqs = [(0, 40), (0, 9), (17, 12), (30, 1)]
    b = build_batch(reqs, 4, 9, 3, 64, seed=5)
    meta = b["meta"]
    write_kv_cache(b["key"], b["value"], b["k_cache"], b["v_cache"], meta.slot_mapping)
    tables = meta.block_tables.tolist()
    for i in (0, 1):  # the fresh prompts' blocks
        for block_id in tables[i][: -(-reqs[i][1] // 4)]:
            b["k_cache"][block_id] = float("nan")
            b["v_cache"][block_id] = float("nan")
    # The CPU backend's hand-off of long prompts to SDPA (bfloat16's; float32 keeps every row
    # in the kernel, which reads the cache this step wrote).
    attention = (
        BACKENDS["sdpa"]
        if backend == "sdpa"
        else functools.partial(paged_attention_cpu, min_sdpa_query_len=HANDOFF)
    )
    out = attention(
        b["query"], b["k_cache"], b["v_cache"], meta, 0.125, sliding_window=window,
        key=b["key"], value=b["value"],
    )  # fmt: skip
    for i, (q, k, v) in enumerate(b["dense"]):
        rows = out[meta.query_start_loc_cpu[i] : meta.query_start_loc_cpu[i + 1]]
        expected = dense_causal_attention(q, k, v, 0.125, window).float()
        torch.testing.assert_close(rows, expected, atol=1e-5, rtol=0, msg=f"request {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(6))
def test_cpu_kernel_matches_the_reference_on_random_batches(dtype, seed):
    """The oracle on random shapes: block sizes, head dims, GQA ratios, query lengths (across
    the kernel's 16-row query tiles), windows, soft caps and shuffled block tables."""
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (), generator=g))]

    block_size = pick([1, 2, 8, 16, 32])
    num_kv_heads, group = pick([1, 2, 4]), pick([1, 3, 8])
    head_dim = pick([32, 64, 80, 128])
    reqs = [
        (int(torch.randint(0, 70, (), generator=g)), pick([1, 1, 2, 5, 16, 17, 40]))
        for _ in range(int(torch.randint(1, 7, (), generator=g)))
    ]
    window, cap = pick([None, None, 3, 20]), pick([None, 30.0])
    b = build_batch(reqs, block_size, num_kv_heads * group, num_kv_heads, head_dim, dtype, seed)
    meta = b["meta"]
    write_kv_cache(b["key"], b["value"], b["k_cache"], b["v_cache"], meta.slot_mapping)
    args = (b["query"], b["k_cache"], b["v_cache"], meta, head_dim**-0.5)
    kwargs = dict(sliding_window=window, logits_soft_cap=cap)
    if seed % 2:
        kwargs["sinks"] = torch.randn(num_kv_heads * group, generator=g)
    expected = paged_attention_ref(*args, **kwargs).float()
    out = paged_attention_cpu(*args, **kwargs, min_sdpa_query_len=0)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0, msg=f"{reqs}")


# Contexts around the kernel's 512-token partitions: just under, at and past a boundary, several
# boundaries, and query tiles whose rows straddle one (a chunk from 1020 to 1037).
LONG_REQS = [(510, 1), (511, 1), (512, 1), (1030, 1), (2100, 1), (1020, 17), (500, 40)]


@pytest.mark.parametrize(
    ("window", "cap", "sinks"),
    [(None, None, False), (700, None, False), (None, 30.0, False), (700, None, True)],
)
@pytest.mark.parametrize("block_size", [16, 7])
def test_cpu_kernel_splits_long_contexts_exactly(window, cap, sinks, block_size):
    """Long contexts are split into partitions whose softmax states are merged (the sinks
    counted once, in the merge): the reference's result, and each request's rows bit for bit
    the same alone as in the batch."""
    b = build_batch(LONG_REQS, block_size, 9, 3, 64, seed=11)
    meta = b["meta"]
    write_kv_cache(b["key"], b["value"], b["k_cache"], b["v_cache"], meta.slot_mapping)
    args = (b["query"], b["k_cache"], b["v_cache"], meta, 64**-0.5)
    kwargs = dict(sliding_window=window, logits_soft_cap=cap)
    if sinks:
        kwargs["sinks"] = torch.linspace(-3, 3, 9)
    expected = paged_attention_ref(*args, **kwargs)
    out = paged_attention_cpu(*args, **kwargs, min_sdpa_query_len=0)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    qsl = meta.query_start_loc_cpu
    for i in range(len(LONG_REQS)):
        rows = slice(qsl[i], qsl[i + 1])
        alone = AttentionMetadata.build(
            block_size, meta.slot_mapping[rows].numpy(), meta.block_tables[i : i + 1].numpy(),
            [rows.stop - rows.start], [meta.seq_lens_cpu[i]],
        )  # fmt: skip
        got = paged_attention_cpu(b["query"][rows], b["k_cache"], b["v_cache"], alone,
                                  64**-0.5, **kwargs, min_sdpa_query_len=0)  # fmt: skip
        assert torch.equal(got, out[rows]), LONG_REQS[i]


def test_cpu_backend_falls_back_to_sdpa_for_head_dims_the_kernel_cannot_vectorise():
    reqs = [(5, 1), (0, 3), (9, 2)]
    b = build_batch(reqs, 4, 4, 2, 40, seed=1)  # 40: not a multiple of 16 (AVX-512) lanes
    meta = b["meta"]
    write_kv_cache(b["key"], b["value"], b["k_cache"], b["v_cache"], meta.slot_mapping)
    out = paged_attention_cpu(b["query"], b["k_cache"], b["v_cache"], meta, 0.125)
    for i, (q, k, v) in enumerate(b["dense"]):
        rows = out[meta.query_start_loc_cpu[i] : meta.query_start_loc_cpu[i + 1]]
        torch.testing.assert_close(
            rows, dense_causal_attention(q, k, v, 0.125).float(), atol=1e-5, rtol=0
        )


def test_cpu_cache_write_refuses_a_slot_outside_the_pool():
    k_cache = torch.zeros(2, 4, 1, 16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(1, 1, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        write_kv_cache_cpu(key, key, k_cache, v_cache, torch.tensor([8]))
    assert not k_cache.any()


def _attend_paged(q, k, v, block_size, others=(), seed=0, attend=None, **kwargs):
    """The CPU kernel's output (or `attend`'s, a backend's forward) for one request whose
    context is k/v [S, kv_heads, d] and whose queries q [Q, heads, d] are its last Q positions,
    its blocks shuffled in a pool of `block_size`-token blocks, after the requests `others`
    [(context, q_len)] in the batch."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, d = q.shape[1], k.shape[1], k.shape[2]
    reqs = [*others, (k.shape[0] - q.shape[0], q.shape[0])]
    lens = [c + n for c, n in reqs]
    needed = [math.ceil(s / block_size) for s in lens]
    perm = torch.randperm(sum(needed), generator=g).tolist()
    tables, start = np.zeros((len(reqs), max(needed)), np.int32), 0
    for i, n in enumerate(needed):
        tables[i, :n] = perm[start : start + n]
        start += n
    shape = (sum(needed), block_size, kv_heads, d)
    k_cache, v_cache = torch.zeros(shape, dtype=k.dtype), torch.zeros(shape, dtype=k.dtype)
    queries = []
    for i, s in enumerate(lens):
        last = i == len(reqs) - 1
        kk = k if last else torch.randn(s, kv_heads, d, generator=g).to(k.dtype)
        vv = v if last else torch.randn(s, kv_heads, d, generator=g).to(k.dtype)
        queries.append(q if last else torch.randn(reqs[i][1], heads, d, generator=g).to(q.dtype))
        for p in range(s):
            k_cache[tables[i, p // block_size], p % block_size] = kk[p]
            v_cache[tables[i, p // block_size], p % block_size] = vv[p]
    meta = AttentionMetadata.build(block_size, [0] * sum(n for _, n in reqs), tables,
                                   [n for _, n in reqs], lens)  # fmt: skip
    if attend is None:
        attend = functools.partial(paged_attention_cpu, min_sdpa_query_len=0)
    out = attend(torch.cat(queries), k_cache, v_cache, meta, d**-0.5, **kwargs)
    return out[-q.shape[0] :]


@pytest.mark.parametrize(("context", "q_len"), [(37, 21), (590, 40)])
@pytest.mark.parametrize("kwargs", [{}, {"sliding_window": 9}, {"logits_soft_cap": 30.0}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_row_is_the_same_whatever_the_batch_chunk_and_block_size(
    context, q_len, kwargs, dtype
):
    """Every row through the kernel (--deterministic): a query row's output is bit for bit the
    same as a prompt's chunk, as a decode step alone, beside other requests, and with blocks of
    1, 16 or 32 tokens (batch invariance: docs/determinism.md)."""
    g = torch.Generator().manual_seed(context)
    q = torch.randn(q_len, 9, 64, generator=g).to(dtype)
    k, v = (
        torch.randn(context + q_len, 3, 64, generator=g).to(dtype),
        torch.randn(context + q_len, 3, 64, generator=g).to(dtype),
    )
    chunk = _attend_paged(q, k, v, 16, **kwargs)
    for r in (0, q_len // 2, q_len - 1):
        p = context + r + 1  # the row's context, itself included
        for block_size, others in [(16, ()), (1, ()), (32, ((5, 1), (40, 17)))]:
            alone = _attend_paged(q[r : r + 1], k[:p], v[:p], block_size, others, seed=r, **kwargs)
            assert torch.equal(alone[0], chunk[r]), (r, block_size, others)
