"""`python -m benchmarks.attention`: the decode attention kernel against the memory it must read.

A decode step's attention reads every running request's K and V once; nothing else it does
comes close in bytes, so its speed is bandwidth: bytes read / kernel time, reported against a
device-to-device copy of the same size timed in the same run (counting the copy's reads and
writes, as copy bandwidth is usually quoted). Shapes default to the default model's attention
(9 query heads, 3 KV heads, head_dim 64); block tables are shuffled as a busy pool's are.

`--prefill` (CPU): one request whose whole prompt of each context length attends causally to
itself, as a prompt's first step does; a question of arithmetic, not bytes. It reports the C++
kernel (the default's fixed-order path) in GFLOP/s (two multiply-adds per query row, key and
head_dim element: scores and weighted values) against torch's SDPA on the same rows (the path
`--no-deterministic` takes for prompts), the two timed in turns.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from benchmarks import common
from pagedllm.attention import AttentionMetadata, get_attention_backend, kv_quant
from pagedllm.config import KV_CACHE_DTYPES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument("--backend", default="auto", help="attention backend (default: auto)")
    group.add_argument("--device", default="auto", help="cpu | cuda | auto")
    group.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    group.add_argument("--kv-cache-dtype", default="auto",
                       choices=KV_CACHE_DTYPES,
                       help="what the cache holds (default auto: --dtype); int8 / fp8: codes and "
                            "a scale per row, read as they are stored")  # fmt: skip
    group.add_argument("--num-seqs", type=int, default=64, help="decoding requests")
    group.add_argument("--context-lens", default="512,2048,8192",
                       help="comma-separated context lengths, one run each")  # fmt: skip
    group.add_argument("--num-heads", type=int, default=9)
    group.add_argument("--num-kv-heads", type=int, default=3)
    group.add_argument("--head-dim", type=int, default=64)
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--iters", type=int, default=20, help="timed calls (median reported)")
    group.add_argument("--prefill", action="store_true",
                       help="one prompt's causal attention instead of decode (CPU)")  # fmt: skip


def main(ns: argparse.Namespace) -> int:
    device = torch.device(
        ns.device if ns.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    backend = get_attention_backend(ns.backend, device)
    dtype = DTYPES[ns.dtype]
    if ns.prefill:
        return prefill_main(ns, device, dtype)
    kv_name = ns.dtype if ns.kv_cache_dtype == "auto" else ns.kv_cache_dtype
    print(f"decode attention, backend {backend.name} on {_device_name(device)}, {ns.dtype} "
          f"queries, {kv_name} KV cache, "
          f"{ns.num_seqs} requests, {ns.num_heads} heads / {ns.num_kv_heads} KV heads x "
          f"{ns.head_dim}, block size {ns.block_size}")  # fmt: skip
    print(f"{'context':>8} {'KV MiB':>8} {'kernel ms':>10} {'read GB/s':>10} "
          f"{'copy GB/s':>10} {'of copy':>8}")  # fmt: skip
    for context_len in (int(n) for n in ns.context_lens.split(",")):
        r = run_one(ns, backend, device, dtype, context_len)
        print(f"{context_len:>8} {r['bytes'] / 2**20:>8.1f} {r['kernel_s'] * 1e3:>10.3f} "
              f"{r['read_gbps']:>10.4g} {r['copy_gbps']:>10.4g} {r['fraction']:>8.1%}")  # fmt: skip
    return 0


def run_one(ns, backend, device, dtype, context_len: int) -> dict:
    """One shape: the kernel's median time and bandwidth, and the copy's."""
    bs, kvh, d = ns.block_size, ns.num_kv_heads, ns.head_dim
    blocks_per_seq = -(-context_len // bs)
    num_blocks = ns.num_seqs * blocks_per_seq
    rng = np.random.default_rng(0)
    tables = rng.permutation(num_blocks).reshape(ns.num_seqs, blocks_per_seq)
    meta = AttentionMetadata.build(
        bs, np.zeros(ns.num_seqs, np.int64), tables, [1] * ns.num_seqs,
        [context_len] * ns.num_seqs, device,
    )  # fmt: skip
    k_cache, v_cache = (_cache(ns, (num_blocks, bs, kvh, d), device, dtype) for _ in range(2))
    query = torch.randn(ns.num_seqs, ns.num_heads, d, device=device).to(dtype)
    scale = d**-0.5
    row_bytes = k_cache.shape[-1] * k_cache.element_size()  # codes + scale when quantized
    kv_bytes = 2 * ns.num_seqs * context_len * kvh * row_bytes
    read_bytes = kv_bytes + 2 * query.numel() * query.element_size()  # + the output written

    def attend():
        backend.forward(query, k_cache, v_cache, meta, scale)

    kernel_s = _median_time(attend, device, ns.iters)
    src = torch.empty(kv_bytes // 2, dtype=torch.int16, device=device).fill_(1)
    dst = torch.empty_like(src)
    copy_s = _median_time(lambda: dst.copy_(src), device, ns.iters)
    copy_gbps = 2 * kv_bytes / copy_s / 1e9  # read + write
    read_gbps = read_bytes / kernel_s / 1e9
    return dict(bytes=kv_bytes, kernel_s=kernel_s, read_gbps=read_gbps, copy_gbps=copy_gbps,
                fraction=read_gbps / copy_gbps)  # fmt: skip


def prefill_main(ns: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> int:
    if device.type != "cpu":
        sys.exit("--prefill compares the CPU kernel with SDPA: run it with --device cpu")
    kv_name = ns.dtype if ns.kv_cache_dtype == "auto" else ns.kv_cache_dtype
    print(f"prefill attention on {_device_name(device)}, {torch.get_num_threads()} threads, "
          f"{ns.dtype} queries, {kv_name} KV cache, one prompt, {ns.num_heads} heads / "
          f"{ns.num_kv_heads} KV heads x {ns.head_dim}, block size {ns.block_size}")  # fmt: skip
    print(f"{'prompt':>8} {'kernel ms':>10} {'GFLOP/s':>8} {'SDPA ms':>9} {'GFLOP/s':>8} "
          f"{'SDPA/kernel':>12}")  # fmt: skip
    for prompt_len in (int(n) for n in ns.context_lens.split(",")):
        kernel_s, sdpa_s = run_prefill(ns, device, dtype, prompt_len)
        flop = 4 * ns.num_heads * ns.head_dim * prompt_len * (prompt_len + 1) / 2
        print(f"{prompt_len:>8} {kernel_s * 1e3:>10.2f} {flop / kernel_s / 1e9:>8.1f} "
              f"{sdpa_s * 1e3:>9.2f} {flop / sdpa_s / 1e9:>8.1f} "
              f"{sdpa_s / kernel_s:>11.2f}x")  # fmt: skip
    return 0


def run_prefill(ns, device, dtype, prompt_len: int) -> tuple[float, float]:
    """Median seconds of the kernel and of SDPA on one fresh prompt, timed in turns."""
    from pagedllm.attention.cpu import paged_attention_cpu
    from pagedllm.attention.sdpa import prefill_sdpa

    bs, kvh, d = ns.block_size, ns.num_kv_heads, ns.head_dim
    num_blocks = -(-prompt_len // bs)
    tables = np.random.default_rng(0).permutation(num_blocks).reshape(1, num_blocks)
    meta = AttentionMetadata.build(
        bs, np.zeros(prompt_len, np.int64), tables, [prompt_len], [prompt_len], device
    )
    k_cache, v_cache = (_cache(ns, (num_blocks, bs, kvh, d), device, dtype) for _ in range(2))
    query = torch.randn(prompt_len, ns.num_heads, d, device=device).to(dtype)
    # The prompt's own K/V as SDPA reads them in a fresh prompt's step: this step's rows.
    positions = np.arange(prompt_len)
    rows = torch.from_numpy(tables[0][positions // bs] * bs + positions % bs)
    key, value = (kv_quant.read_rows(c, dtype).view(-1, kvh, d)[rows] for c in (k_cache, v_cache))
    scale = d**-0.5

    def kernel():
        paged_attention_cpu(query, k_cache, v_cache, meta, scale, min_sdpa_query_len=0)

    def sdpa():
        out = torch.empty_like(query)
        prefill_sdpa(query, k_cache, v_cache, meta, scale, None, None, out, key=key, value=value)

    times = {kernel: [], sdpa: []}
    for fn in times:
        fn()
    for _ in range(ns.iters):
        for fn, ts in times.items():
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return statistics.median(times[kernel]), statistics.median(times[sdpa])


def _cache(ns, shape, device, dtype) -> torch.Tensor:
    """Random K or V in the cache's format."""
    x = torch.randn(shape, device=device)
    if ns.kv_cache_dtype == "auto":
        return x.to(dtype)
    cache_dtype = kv_quant.storage_dtype(ns.kv_cache_dtype)
    if kv_quant.is_quantized(cache_dtype):
        return kv_quant.quantize(x, cache_dtype).view(cache_dtype)
    return x.to(cache_dtype)


def _median_time(fn, device: torch.device, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return "cpu"


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main, engine=False))
