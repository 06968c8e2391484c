"""Model FLOPs utilisation (MFU): the FLOPs a model's tokens need against the GEMM peak that the
same machine reaches now, in the same dtype.

MFU = tokens/s × FLOPs per token ÷ peak FLOP/s. The peak is measured, not taken from a data sheet:
a large torch.nn.functional.linear is the best a model's matmuls could do on this machine with
torch's kernels and thread count, so MFU says how much of that the engine turns into model work.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pagedllm.config import ModelArchConfig

# (M, N, K) of F.linear(x[M, K], w[N, K]): smallest first, so a slow dtype (bfloat16 on a CPU
# without native support) measures the small shape and skips the big one rather than overrun.
DEFAULT_GEMM_SHAPES: tuple[tuple[int, int, int], ...] = ((1024, 1024, 1024), (2048, 2048, 2048))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_gemm_peak(
    dtype: torch.dtype,
    shapes: tuple[tuple[int, int, int], ...] = DEFAULT_GEMM_SHAPES,
    seconds: float = 1.5,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Best GFLOP/s of F.linear over `shapes` in `dtype`, within about `seconds` in all.

    Each shape gets a warm-up call, then repeats until its share of the time is spent (best
    of them counts: noise only ever slows a GEMM down). A shape whose estimated cost no longer
    fits the remaining time is skipped and listed as such, but the first always runs once.
    Returns {"dtype", "device", "torch_num_threads", "best_gflops", "shapes": [...]}.
    """
    device = torch.device(device)
    deadline = time.perf_counter() + seconds
    per_shape: list[dict[str, Any]] = []
    last_call_s: float | None = None
    last_flops = 0.0
    gen = torch.Generator(device="cpu").manual_seed(0)
    for k, (m, n, kk) in enumerate(shapes):
        flops = 2.0 * m * n * kk
        remaining = deadline - time.perf_counter()
        # Predict this shape's call from the previous one (FLOPs scale); warm-up + 1 call.
        if k > 0 and last_call_s is not None and 2 * last_call_s * flops / last_flops > remaining:
            per_shape.append({"m": m, "n": n, "k": kk, "skipped": "out of time"})
            continue
        x = torch.randn(m, kk, generator=gen).to(device=device, dtype=dtype)
        w = torch.randn(n, kk, generator=gen).to(device=device, dtype=dtype)
        with torch.inference_mode():
            torch.nn.functional.linear(x, w)  # warm-up: kernel selection, page faults
            _sync(device)
            share_end = time.perf_counter() + remaining / (len(shapes) - k)
            best = float("inf")
            repeats = 0
            while repeats == 0 or time.perf_counter() < share_end:
                t0 = time.perf_counter()
                torch.nn.functional.linear(x, w)
                _sync(device)
                best = min(best, time.perf_counter() - t0)
                repeats += 1
        last_call_s, last_flops = best, flops
        per_shape.append(
            {"m": m, "n": n, "k": kk, "repeats": repeats, "best_s": best,
             "gflops": flops / best / 1e9}
        )  # fmt: skip
    measured = [s["gflops"] for s in per_shape if "gflops" in s]
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "torch_num_threads": torch.get_num_threads(),
        "best_gflops": max(measured),
        "shapes": per_shape,
    }


def measure_read_bandwidth(num_bytes: int, seconds: float = 1.0) -> dict[str, Any]:
    """Best GB/s of reading a CPU buffer of num_bytes once (torch's sum over float32s, on
    torch's threads), within about `seconds`: from L3 when that much fits there, from DRAM when
    not, as a step reading that many bytes of weights would."""
    buf = torch.ones(max(num_bytes // 4, 1024))
    buf.sum()  # page faults, thread start-up
    deadline, best, repeats = time.perf_counter() + seconds, float("inf"), 0
    while repeats < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
        repeats += 1
    return {"bytes": buf.nbytes, "best_s": best, "gb_per_s": buf.nbytes / best / 1e9,
            "repeats": repeats}  # fmt: skip


def matmul_params_per_token(config: ModelArchConfig) -> int:
    """Weights each token multiplies by: per layer q, k, v, o, gate, up and down projections,
    plus the LM head (hidden × vocab, even when tied to the embedding: the lookup is free, the
    logits matmul is not). Biases and norms are not matmuls and are left out."""
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attention = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_hidden_layers * (attention + mlp) + c.hidden_size * c.vocab_size


def flops_per_token(config: ModelArchConfig, context_len: float) -> float:
    """FLOPs of one token's forward pass at `context_len` tokens of context:

        2 × matmul_params_per_token(config)                       (one multiply-add per weight)
        + Σ over layers 4 × num_attention_heads × head_dim × ctx   (QKᵀ and PV, 2 FLOPs each)

    where ctx = context_len, or min(context_len, window) on a sliding-window layer (an
    approximation when context_len is a mean). Linear in context_len, so the mean context of a
    batch gives its exact total. Elementwise work (norms, RoPE, softmax, activations) is left
    out, as in the usual MFU accounting (PaLM's appendix B)."""
    c = config
    attention = 0.0
    for layer in range(c.num_hidden_layers):
        window = c.layer_sliding_window(layer)
        ctx = context_len if window is None else min(context_len, window)
        attention += 4.0 * c.num_attention_heads * c.head_dim * ctx
    return 2.0 * matmul_params_per_token(c) + attention


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s ÷ peak FLOP/s (both in FLOP/s)."""
    return tokens_per_s * flops_per_token / peak_flops if peak_flops > 0 else 0.0


def gemm_peak_line(peak: dict[str, Any]) -> str:
    shapes = ", ".join(
        f"{s['m']}x{s['n']}x{s['k']}: "
        + (f"{s['gflops']:.1f}" if "gflops" in s else "skipped (out of time)")
        for s in peak["shapes"]
    )
    return (
        f"GEMM peak, {peak['dtype']} on {peak['device']} ({peak['torch_num_threads']} threads): "
        f"{peak['best_gflops']:.1f} GFLOP/s (F.linear MxNxK GFLOP/s: {shapes})"
    )
