"""The integer kernels (layers/quantization/int8_act.py) against the float paths they replace,
one model's projections at a time, in one run:

- int8_act: the default for a GGUF's codes (8-bit activations, integer sums), every variant
  this CPU has;
- dual bf16: `--dtype bfloat16`'s path (the codes kernel up to 8 rows, oneDNN's prepacked
  bfloat16 GEMM above), where the CPU has bf16 instructions;
- fixed f32: `--dtype float32`'s path (the codes kernel in float32, fixed order).

Each case multiplies every projection of `--layers` layers (random codes, so the weights are
cold, as in a real step: a layer's codes are read once per step) at each row count, and prints
milliseconds per layer-stack and the int8_act speed-up. For one row it also prints the bytes of
codes read per second against a plain copy's bandwidth measured in the same run. `--kinds`
compares the integer kernels' kinds of codes (int4: Q4_0 / Q4_1 / Q4_K; int6: Q6_K, as int6
holds it, with zero mins; int8: Q8_0; int8x: Q6_K in 8 bits) in one process; the float paths
run for int4 and int8 only.

    python -m benchmarks.int8_act_bench --shape smollm2 --rows 1,8,32,128,512
    python -m benchmarks.int8_act_bench --shape llama-1b --layers 4
    python -m benchmarks.int8_act_bench --shape llama-1b --layers 2 --kinds int6,int8x --rows 1,512
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm import kernels
from pagedllm.cpu_info import cpu_flags, has_native_bf16
from pagedllm.layers.linear import ColumnParallelLinear
from pagedllm.layers.quantization import (
    Int4Weight,
    Int8Weight,
    Int8xWeight,
    QuantizationConfig,
    QuantWeight,
    can_pack,
)

SHAPES = {  # hidden, intermediate, q rows, kv rows
    "smollm2": (576, 1536, 576, 192),
    "llama-1b": (2048, 8192, 2048, 512),
    "llama-8b": (4096, 14336, 4096, 1024),
}


def projections(shape: str) -> list[tuple[int, int]]:
    """(out, in) of a layer's qkv, o, gate_up and down."""
    hidden, inter, q, kv = SHAPES[shape]
    return [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]


def random_codes(kind: str, n: int, k: int) -> QuantWeight:
    w = torch.randn(n, k) * 0.02
    if kind in ("int6", "int8x"):
        return Int8xWeight.from_float(w, bits=6 if kind == "int6" else 8)
    return {"int4": Int4Weight, "int8": Int8Weight}[kind].from_float(w)


def build(codes: QuantWeight, method: str, dtype: torch.dtype, variant: str, kind: str):
    n, k = codes.shape
    prepack = method == "auto" and can_pack(dtype, torch.device("cpu"))
    fixed = method == "auto" and dtype == torch.float32
    config = QuantizationConfig(method, prepack, code_kinds={"w": kind}, fixed_order=fixed)
    layer = ColumnParallelLinear(k, n, bias=False, dtype=dtype, quant_config=config, prefix="w")
    layer.weight_loader(layer.weight, codes)
    layer.quant_method.process_weights_after_loading(layer)
    if variant:
        layer.quant_method.variant = variant
    return layer


def ms_per_pass(cases: dict[str, tuple], rows: int, repeat: int) -> dict[str, float]:
    """Each case's best milliseconds per pass over its layers. The cases take turns, one pass
    each, `repeat` times: this machine's memory bandwidth drifts from minute to minute, and
    taking turns gives each case the same chances at it."""
    xs = {}
    for layers, dtype in cases.values():
        for k in {lin.input_size for lin in layers}:
            xs[k, dtype] = torch.randn(rows, k).to(dtype)
    best = dict.fromkeys(cases, float("inf"))
    with torch.inference_mode():
        for layers, dtype in cases.values():  # warm-up: primitives, page faults
            for lin in layers:
                lin(xs[lin.input_size, dtype])
        for _ in range(repeat):
            for name, (layers, dtype) in cases.items():
                t0 = time.perf_counter()
                for lin in layers:
                    lin(xs[lin.input_size, dtype])
                best[name] = min(best[name], time.perf_counter() - t0)
    return {name: t * 1e3 for name, t in best.items()}


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
    parser.add_argument("--kinds", default="int4", help="int4, int6, int8, int8x (comma-separated)")
    args = parser.parse_args(argv)
    if not kernels.available():
        raise SystemExit("the C++ kernels are needed")
    torch.manual_seed(0)
    kinds, shapes = args.kinds.split(","), projections(args.shape)
    codes = {
        kind: [random_codes(kind, n, k) for _ in range(args.layers) for n, k in shapes]
        for kind in kinds
    }
    variants = [v for v in kernels.cpu_ops().int8_act_variants() if v != "reference"]
    label = (lambda kind: f" {kind}") if len(kinds) > 1 else (lambda kind: "")
    cases = {f"int8_act {v}{label(k)}": ("int8_act", torch.float32, v, k)
             for k in kinds for v in variants}  # fmt: skip
    if kinds[0] in ("int4", "int8"):
        if has_native_bf16():
            cases["dual bf16"] = ("auto", torch.bfloat16, "", kinds[0])
        cases["fixed f32"] = ("auto", torch.float32, "", kinds[0])
    built = {name: [build(c, m, d, v, k) for c in codes[k]] for name, (m, d, v, k) in cases.items()}
    first = next(iter(cases))
    code_bytes = {
        name: sum(lin.quant_method.nbytes(lin) for lin in built[name])
        for name in cases
        if name.startswith("int8_act")
    }
    isa = {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8"}
    flags = sorted(cpu_flags() & isa)
    held = ", ".join(
        f"{k}: {code_bytes[f'int8_act {variants[0]}{label(k)}'] / 2**20:.1f}" for k in kinds
    )
    print(f"{args.shape}, {args.layers} layers (MiB of codes, scales and mins: {held}), "
          f"{torch.get_num_threads()} threads, CPU flags: {' '.join(flags)}")  # fmt: skip
    floats = [n for n in cases if not n.startswith("int8_act")]
    print("rows | " + " | ".join(cases) + (f" | {first} speed-up" if floats else ""))
    for rows in [int(r) for r in args.rows.split(",")]:
        times = ms_per_pass({n: (built[n], cases[n][1]) for n in cases}, rows, args.repeat)
        cells = " | ".join(f"{t:.2f} ms" for t in times.values())
        if floats:
            speedup = min(times[n] for n in floats) / times[first]
            cells += f" | {speedup:.2f}x the fastest float path"
        print(f"{rows} | {cells}")
        if rows == 1:
            rates = ", ".join(f"{n}: {b / times[n] / 1e6:.1f}" for n, b in code_bytes.items())
            print(f"  1 row, GB/s of codes read: {rates}; a copy's bandwidth: "
                  f"{copy_bandwidth(256 << 20) / 1e9:.1f} GB/s")  # fmt: skip
    ops = 2 * sum(c.shape[0] * c.shape[1] for c in codes[kinds[0]])
    rows = int(args.rows.split(",")[-1])
    t = ms_per_pass({first: (built[first], torch.float32)}, rows, args.repeat)[first]
    print(f"{first} at {rows} rows: {ops * rows / (t / 1e3) / 1e9:.0f} GOP/s")


if __name__ == "__main__":
    main()
