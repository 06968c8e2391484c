"""The integer kernels (layers/quantization/int8_act.py) against the float paths they replace,
one model's projections at a time, in one run:

- int8_act: the default for a GGUF's codes (8-bit activations, integer sums), every variant
  this CPU has;
- dual bf16: `--dtype bfloat16`'s path (the codes kernel up to 8 rows, oneDNN's prepacked
  bfloat16 GEMM above), where the CPU has bf16 instructions;
- fixed f32: `--dtype float32`'s path (the codes kernel in float32, fixed order).

Each case multiplies every projection of `--layers` layers (random int4 codes, so the weights
are cold, as in a real step: a layer's codes are read once per step) at each row count, and
prints milliseconds per layer-stack and the int8_act speed-up. For one row it also prints the
bytes of codes read per second against a plain copy's bandwidth measured in the same run.

    python -m benchmarks.int8_act_bench --shape smollm2 --rows 1,8,32,128,512
    python -m benchmarks.int8_act_bench --shape llama-1b --layers 4
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm import kernels
from pagedllm.cpu_info import cpu_flags, has_native_bf16
from pagedllm.layers.linear import ColumnParallelLinear
from pagedllm.layers.quantization import Int4Weight, QuantizationConfig, can_pack

SHAPES = {  # hidden, intermediate, q rows, kv rows
    "smollm2": (576, 1536, 576, 192),
    "llama-1b": (2048, 8192, 2048, 512),
    "llama-8b": (4096, 14336, 4096, 1024),
}


def projections(shape: str) -> list[tuple[int, int]]:
    """(out, in) of a layer's qkv, o, gate_up and down."""
    hidden, inter, q, kv = SHAPES[shape]
    return [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]


def build(codes: Int4Weight, method: str, dtype: torch.dtype, variant: str = ""):
    n, k = codes.shape
    prepack = method == "auto" and can_pack(dtype, torch.device("cpu"))
    fixed = method == "auto" and dtype == torch.float32
    config = QuantizationConfig(method, prepack, code_kinds={"w": "int4"}, fixed_order=fixed)
    layer = ColumnParallelLinear(k, n, bias=False, dtype=dtype, quant_config=config, prefix="w")
    layer.weight_loader(layer.weight, codes)
    layer.quant_method.process_weights_after_loading(layer)
    if variant:
        layer.quant_method.variant = variant
    return layer


def ms_per_pass(layers, rows: int, dtype: torch.dtype, repeat: int) -> float:
    xs = {k: torch.randn(rows, k).to(dtype) for k in {lin.input_size for lin in layers}}
    with torch.inference_mode():
        for lin in layers:  # warm-up: primitives, page faults
            lin(xs[lin.input_size])
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            for lin in layers:
                lin(xs[lin.input_size])
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


def copy_bandwidth(num_bytes: int) -> float:
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * num_bytes / best  # read and written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--layers", type=int, default=8, help="layers of projections (cold)")
    parser.add_argument("--rows", default="1,8,32,128,512")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    if not kernels.available():
        raise SystemExit("the C++ kernels are needed")
    torch.manual_seed(0)
    codes = [
        Int4Weight.from_float(torch.randn(n, k) * 0.02)
        for _ in range(args.layers)
        for n, k in projections(args.shape)
    ]
    variants = list(kernels.cpu_ops().int8_act_variants())
    cases = {f"int8_act {v}": ("int8_act", torch.float32, v) for v in variants if v != "reference"}
    if has_native_bf16():
        cases["dual bf16"] = ("auto", torch.bfloat16, "")
    cases["fixed f32"] = ("auto", torch.float32, "")
    built = {name: [build(c, m, d, v) for c in codes] for name, (m, d, v) in cases.items()}
    code_bytes = sum(
        c.shape[0] * c.shape[1] // 2 + c.shape[0] * c.shape[1] // 32 * 4 for c in codes
    )
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8"})
    print(f"{args.shape}, {args.layers} layers ({code_bytes / 2**20:.1f} MiB of int4 codes), "
          f"{torch.get_num_threads()} threads, CPU flags: {' '.join(flags)}")  # fmt: skip
    first = next(iter(cases))
    header = "rows | " + " | ".join(cases) + f" | {first} speed-up"
    print(header)
    for rows in [int(r) for r in args.rows.split(",")]:
        times = {n: ms_per_pass(built[n], rows, cases[n][1], args.repeat) for n in cases}
        others = [t for n, t in times.items() if not n.startswith("int8_act")]
        speedup = min(others) / times[first] if others else float("nan")
        cells = " | ".join(f"{t:.2f} ms" for t in times.values())
        print(f"{rows} | {cells} | {speedup:.2f}x the fastest float path")
        if rows == 1:
            bw = code_bytes / (times[first] / 1e3)
            print(f"  1 row: {bw / 1e9:.1f} GB/s of codes read; a copy's bandwidth: "
                  f"{copy_bandwidth(256 << 20) / 1e9:.1f} GB/s")  # fmt: skip
    ops = 2 * sum(c.shape[0] * c.shape[1] for c in codes)
    rows = int(args.rows.split(",")[-1])
    t = ms_per_pass(built[first], rows, torch.float32, args.repeat)
    print(f"{first} at {rows} rows: {ops * rows / (t / 1e3) / 1e9:.0f} GOP/s")


if __name__ == "__main__":
    main()
