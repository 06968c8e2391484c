"""Two floors under a decode step, measured on the engine's own loaded model (benchmarks.step):

- weight streaming: the bytes the step must read (every projection's weights, in the format its
  method reads at this many rows, and the K/V of every request's context) over the bandwidth
  this machine reaches reading that many bytes once;
- the GEMMs alone: every projection of the model (LM head included) called in layer order on
  random rows of the step's shape, through its own quant_method, so each runs the kernel and the
  weight format the step picks at that row count. What a step spends beyond that is attention,
  norms, rotary, sampling, scheduling and input building.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from pagedllm.bench import roofline


def _model(engine):
    return engine.executor.driver_worker.model_runner.model


def _linears(model) -> list[tuple[str, torch.nn.Module]]:
    """Every projection (layers/linear.py), in module order: layer by layer, then the head."""
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "quant_method")]


def weight_streaming(engine, decode: dict[str, Any]) -> dict[str, Any]:
    model = _model(engine)
    rows, arch, spec = decode["num_running"], model.config, engine.kv_cache_spec
    weights = sum(m.quant_method.bytes_read(m, rows) for _, m in _linears(model))
    # One token's K/V over all layers, each (token, KV head) row with its scale if quantized.
    kv_per_token = (
        2 * arch.num_hidden_layers * spec.num_kv_heads
        * (spec.head_dim * spec.dtype_bytes + spec.scale_bytes)
    )  # fmt: skip
    kv = int(rows * decode["mean_context_len"] * kv_per_token)
    read = roofline.measure_read_bandwidth(weights + kv)
    streaming_ms = (weights + kv) / (read["gb_per_s"] * 1e9) * 1e3
    return {"weight_bytes": weights, "kv_bytes": kv, "read": read, "streaming_ms": streaming_ms,
            "ratio": decode["step_ms"] / streaming_ms}  # fmt: skip


def _kind(name: str) -> str:
    """'model.layers.3.self_attn.qkv_proj' -> 'qkv_proj'."""
    return name.rsplit(".", 1)[-1]


def gemms_alone(engine, decode: dict[str, Any], seconds: float = 1.0) -> dict[str, Any]:
    """Median ms of one pass over every projection at the step's rows (one per decoding
    request), after a warm-up pass, repeated for about `seconds` (at least 3 passes); and each
    kind's share, from one more pass timed layer by layer."""
    model = _model(engine)
    rows, dtype = decode["num_tokens"] // decode["num_steps"], model.dtype
    linears = _linears(model)
    gen = torch.Generator().manual_seed(0)
    inputs = [
        torch.randn(rows, m.input_size_per_partition, generator=gen).to(dtype) for _, m in linears
    ]

    def one_pass() -> float:
        t0 = time.perf_counter()
        for (_, m), x in zip(linears, inputs, strict=True):
            m(x)
        return time.perf_counter() - t0

    with torch.inference_mode():
        one_pass()  # warm-up: packing caches, page faults
        passes, deadline = [], time.perf_counter() + seconds
        while len(passes) < 3 or time.perf_counter() < deadline:
            passes.append(one_pass())
        by_kind: dict[str, float] = {}
        for (name, m), x in zip(linears, inputs, strict=True):
            t0 = time.perf_counter()
            m(x)
            by_kind[_kind(name)] = by_kind.get(_kind(name), 0.0) + time.perf_counter() - t0
    gemm_ms = 1e3 * statistics.median(passes)
    return {
        "rows": rows,
        "num_projections": len(linears),
        "passes": len(passes),
        "gemm_ms": gemm_ms,
        "by_kind_ms": {k: 1e3 * s for k, s in by_kind.items()},
        "ratio": decode["step_ms"] / gemm_ms,
    }


def gemms_line(gemms: dict[str, Any], step_ms: float) -> str:
    kinds = ", ".join(f"{k} {ms:.2f}" for k, ms in gemms["by_kind_ms"].items())
    return (
        f"{gemms['num_projections']} projections at {gemms['rows']} rows alone: "
        f"{gemms['gemm_ms']:.2f} ms (median of {gemms['passes']} passes; ms by kind: {kinds}); "
        f"the step {step_ms:.2f} ms, {gemms['ratio']:.2f}x that"
    )
