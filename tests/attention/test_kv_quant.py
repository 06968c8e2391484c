"""KV caches of int8 / fp8 codes with a scale per row (--kv-cache-dtype): the format's error
bounds, the C++ writer against the torch one byte for byte, every backend against the
reference on the same quantized cache, and block copies and swaps carrying the scales."""

from __future__ import annotations

import functools

import pytest
import torch

from pagedllm.attention import AttentionMetadata, kv_quant, paged_attention_ref, write_kv_cache
from pagedllm.attention.cpu import paged_attention_cpu, write_kv_cache_cpu
from pagedllm.attention.sdpa import paged_attention_sdpa
from pagedllm.attention.selector import copy_blocks_torch
from pagedllm.attention.torch_ref import context_slots
from pagedllm.config import ModelArchConfig
from pagedllm.worker.kv_cache import KVCache, kv_cache_spec
from tests.attention.test_paged_attention import HANDOFF, build_batch, dense_causal_attention

CODES = ["int8", "fp8_e4m3", "fp8_e5m2"]
BACKENDS = {
    "sdpa": paged_attention_sdpa,
    "cpu-kernel": functools.partial(paged_attention_cpu, min_sdpa_query_len=0),
    "cpu": functools.partial(paged_attention_cpu, min_sdpa_query_len=HANDOFF),
}


def empty_cache(shape, dtype, seed=0):
    """A quantized cache [..., head_dim + 4] of random bytes: codes and scales that are garbage
    (huge, NaN), so reading a slot nobody wrote shows in the output."""
    *lead, head_dim = shape
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*lead, kv_quant.row_elements(head_dim, dtype)), generator=g)
    return raw.to(torch.uint8).view(dtype)


def error_bound(x: torch.Tensor, code: str) -> torch.Tensor:
    """Largest |x - dequantize(quantize(x))| per element: half a step of the row's grid."""
    amax = x.abs().amax(-1, keepdim=True)
    if code == "int8":
        return amax / 254 * (1 + 1e-5)
    mantissa, max_code, min_exponent = (3, 448.0, -9) if code == "fp8_e4m3" else (2, 57344.0, -16)
    scale = amax / max_code
    # Normals: a relative half step; subnormals (and zero): half the smallest step, scaled.
    return torch.maximum(x.abs() * 2.0 ** -(mantissa + 1), scale * 2.0 ** (min_exponent - 1)) * (
        1 + 1e-5
    )


@pytest.mark.parametrize("code", CODES)
def test_round_trip_stays_within_half_a_step_and_zero_rows_stay_zero(code):
    dtype = kv_quant.storage_dtype(code)
    g = torch.Generator().manual_seed(1)
    # Rows of very different magnitudes, one all zero, one with a single large outlier.
    x = torch.randn(64, 4, 64, generator=g) * torch.logspace(-3, 3, 64)[:, None, None]
    x[3] = 0
    x[7, 0, 5] = 1e4
    rows = kv_quant.quantize(x, dtype)
    assert rows.dtype == torch.uint8 and rows.shape == (64, 4, 64 + kv_quant.SCALE_BYTES)
    back = kv_quant.dequantize(rows.view(dtype))
    assert torch.all((back - x).abs() <= error_bound(x, code))
    assert torch.equal(back[3], torch.zeros(4, 64))
    # Each row's largest element maps onto the largest code, so it comes back almost exactly.
    amax_index = x.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(
        back.gather(-1, amax_index), x.gather(-1, amax_index), rtol=1e-6, atol=0
    )


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_writer_writes_the_torch_writers_bytes(code, input_dtype):
    dtype = kv_quant.storage_dtype(code)
    g = torch.Generator().manual_seed(2)
    num_blocks, block_size, heads, head_dim = 6, 4, 3, 32
    key = (torch.randn(17, heads, head_dim, generator=g) * 5).to(input_dtype)
    value = torch.randn(17, heads, head_dim, generator=g).to(input_dtype)
    key[4] = 0
    slots = torch.randperm(num_blocks * block_size, generator=g)[:17]
    caches = [empty_cache((num_blocks, block_size, heads, head_dim), dtype) for _ in range(4)]
    write_kv_cache(key, value, caches[0], caches[1], slots)
    write_kv_cache_cpu(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    # And the rows written are the quantized K/V; the slots not written are untouched.
    flat = caches[0].view(-1, heads, head_dim + kv_quant.SCALE_BYTES)
    assert torch.all((kv_quant.dequantize(flat[slots]) - key.float()).abs()
                     <= error_bound(key.float(), code))  # fmt: skip
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    fresh = empty_cache((num_blocks, block_size, heads, head_dim), dtype).view(flat.shape)
    assert torch.equal(flat.view(torch.uint8)[untouched], fresh.view(torch.uint8)[untouched])


def quantized_batch(reqs, block_size, heads, kv_heads, head_dim, code, seed, query_dtype):
    """build_batch's requests with every context token's K/V written into quantized caches."""
    b = build_batch(reqs, block_size, heads, kv_heads, head_dim, seed=seed)
    meta: AttentionMetadata = b["meta"]
    dtype = kv_quant.storage_dtype(code)
    k_cache = empty_cache(b["k_cache"].shape, dtype, seed)
    v_cache = empty_cache(b["v_cache"].shape, dtype, seed + 1)
    tables = meta.block_tables.tolist()
    for i, (_, k, v) in enumerate(b["dense"]):
        slots = torch.tensor(context_slots(tables[i], meta.seq_lens_cpu[i], block_size))
        write_kv_cache(k, v, k_cache, v_cache, slots)
    b.update(k_cache=k_cache, v_cache=v_cache, query=b["query"].to(query_dtype))
    return b


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("seed", range(4))
def test_backends_match_the_reference_on_a_quantized_cache(code, seed):
    """Random shapes (block sizes, head dims, GQA, query lengths across the kernel's tiles,
    windows, soft caps): every backend reads the same codes as the reference, in float32; and
    the reference is within the codes' error of attention over the unquantized K/V."""
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (), generator=g))]

    block_size, head_dim = pick([1, 4, 16]), pick([32, 64, 128])
    kv_heads, group = pick([1, 3]), pick([1, 3, 8])
    reqs = [(int(torch.randint(0, 50, (), generator=g)), pick([1, 1, 3, 17]))
            for _ in range(int(torch.randint(1, 6, (), generator=g)))]  # fmt: skip
    window, cap = pick([None, 5]), pick([None, 30.0])
    b = quantized_batch(reqs, block_size, kv_heads * group, kv_heads, head_dim, code, seed,
                        torch.float32)  # fmt: skip
    meta, scale = b["meta"], head_dim**-0.5
    args = (b["query"], b["k_cache"], b["v_cache"], meta, scale)
    kwargs = dict(sliding_window=window, logits_soft_cap=cap)
    expected = paged_attention_ref(*args, **kwargs)
    for name, backend in BACKENDS.items():
        out = backend(*args, **kwargs, key=b["key"], value=b["value"])
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=0, msg=f"{name} {reqs}")
    # The quantization error: unit-variance K/V, so a few of the codes' steps at most.
    atol = {"int8": 0.05, "fp8_e4m3": 0.2, "fp8_e5m2": 0.4}[code]
    for i, (q, k, v) in enumerate(b["dense"]):
        rows = expected[meta.query_start_loc_cpu[i] : meta.query_start_loc_cpu[i + 1]]
        dense = dense_causal_attention(q, k, v, scale, window, cap).float()
        torch.testing.assert_close(rows, dense, atol=atol, rtol=0)


@pytest.mark.parametrize("code", ["int8", "fp8_e4m3"])
def test_bfloat16_queries_read_a_quantized_cache(code):
    reqs = [(20, 1), (0, 9), (33, 4)]
    b = quantized_batch(reqs, 16, 9, 3, 64, code, 5, torch.bfloat16)
    args = (b["query"], b["k_cache"], b["v_cache"], b["meta"], 0.125)
    expected = paged_attention_ref(*args).float()
    for name, backend in BACKENDS.items():
        out = backend(*args)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=0, msg=name)


@pytest.mark.parametrize("code", CODES)
def test_block_copies_and_swaps_carry_the_scales(code):
    dtype = kv_quant.storage_dtype(code)
    config = ModelArchConfig("x", 10, 16, 32, 3, 2, 2, 32)
    spec = kv_cache_spec(config, 4, dtype)
    assert spec.bytes_per_block == 2 * 3 * 4 * 2 * (32 + kv_quant.SCALE_BYTES)
    kv = KVCache(spec, 3, 10, 6, dtype, torch.device("cpu"), copy_blocks_torch)
    assert kv.pool.dtype == torch.uint8 and kv.layers[0][0].dtype == dtype
    g = torch.Generator().manual_seed(3)
    for k_cache, v_cache in kv.layers:  # blocks 2 and 5 of every layer
        key = torch.randn(8, 2, 32, generator=g) * 3
        slots = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23])
        write_kv_cache(key, key + 1, k_cache, v_cache, slots)
    before = kv.pool.clone()
    kv.copy([(2, 7)])
    assert torch.equal(kv.pool[:, :, 7], before[:, :, 2])
    kv.swap([(5, 0), (7, 1)], [])
    kv.pool[:, :, [5, 7]] = 0
    kv.swap([], [(0, 8), (1, 9)])
    assert torch.equal(kv.pool[:, :, 8], before[:, :, 5])
    assert torch.equal(kv.pool[:, :, 9], before[:, :, 2])
    rows = kv.layers[1][0][8].view(-1, 2, 32 + kv_quant.SCALE_BYTES)
    assert torch.isfinite(kv_quant.dequantize(rows)).all()


def test_unquantized_names_and_sizes():
    assert not kv_quant.is_quantized(torch.bfloat16) and kv_quant.is_quantized(torch.int8)
    assert kv_quant.storage_dtype("fp8") == torch.float8_e4m3fn
    assert kv_quant.row_elements(64, torch.float32) == 64
    assert kv_quant.row_elements(64, torch.float8_e5m2) == 68
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        kv_quant.storage_dtype("int4")
