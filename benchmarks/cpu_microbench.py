"""The isolated timings of docs/performance.md, each case against its alternative in one run:

- attention: the C++ kernel (`cpu` backend, all rows through the kernel) vs the SDPA backend,
  one thread, 9 query heads / 3 KV heads / head_dim 64, blocks of 16 (--attention);
- linear: F.linear's GFLOP/s at a decode shape in float32 and bfloat16; plain F.linear vs a
  linear layer whose weight is prepacked for oneDNN, at 1 and 64 rows, on the main thread and on
  another (--linear);
- quantized: the default model's 120 projections (30 layers of qkv, o, gate_up, down, random
  weights, cold: 66 MB of int4 codes go by before a layer comes again) at 1-32 rows through
  the int4 layer's two paths (codes times rows; weight expanded for a GEMM) and torch's own int4
  kernel, then the tied LM head (49152 x 576) as int8 codes and as prepacked bf16 (--quantized);
- dual: the same 120 projections as int4 codes and as float weights (float32; bfloat16
  prepacked where oneDNN packs it) at 1-32 rows, and the row count up to which the codes win:
  where `--quantization auto` switches (layers/quantization/dual.py) (--dual);
- fixed order: the same 120 projections in float32 at 1-256 rows through F.linear (MKL) and
  through the kernels' fixed-order products (docs/determinism.md): dense_linear on the float
  weights and int4_linear on the codes (--fixed-order);
- lora: one rank-16 adapter on each of the default model's four projection shapes (the packed
  ones' parts stacked: 48 columns for qkv, 32 for gate_up), bfloat16, at 1, 8 and 32 rows of one
  slot: the C++ kernel (layers/lora.py's path) vs torch's two GEMMs and an add (--lora).

    python benchmarks/cpu_microbench.py [--attention] [--linear] [--quantized] [--dual]
                                        [--fixed-order] [--lora]
"""

import functools
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for build_batch

from pagedllm import kernels  # noqa: E402
from pagedllm.attention import paged_attention_sdpa, write_kv_cache  # noqa: E402
from pagedllm.attention.cpu import paged_attention_cpu  # noqa: E402
from pagedllm.layers.linear import ColumnParallelLinear  # noqa: E402
from pagedllm.layers.quantization import QuantizationConfig, can_pack  # noqa: E402


def layer(weight, method: str = "none", dtype=torch.bfloat16, prepack: bool = False):
    """A linear layer holding `weight` (float, or codes its method takes as they are), loaded
    and processed as the model loader does."""
    rows, cols = weight.shape
    config = QuantizationConfig(method, prepack, frozenset({"w"}))
    lin = ColumnParallelLinear(cols, rows, bias=False, dtype=dtype, quant_config=config, prefix="w")
    lin.weight_loader(lin.weight, weight)
    lin.quant_method.process_weights_after_loading(lin)
    return lin


def codes_times_rows(lin, x):
    """The int4 / int8 kernel on the codes, whatever the row count (the layer switches to an
    expanded GEMM above MAX_GEMV_ROWS)."""
    method = lin.quant_method
    return getattr(kernels.cpu_ops(), f"int{method.bits}_linear")(x, *method.codes(lin))


def per_call_us(fn, n: int = 20, clock=time.perf_counter) -> float:
    for _ in range(3):
        fn()
    t = clock()
    for _ in range(n):
        fn()
    return (clock() - t) / n * 1e6


def attention() -> None:
    from tests.attention.test_paged_attention import build_batch

    torch.set_num_threads(1)
    kernel = functools.partial(paged_attention_cpu, min_sdpa_query_len=0)
    cases = {
        "decode, 64 requests x 500 tokens": [(500 + i, 1) for i in range(64)],
        "4 requests x 4 new rows after 256 cached": [(256, 4)] * 4,
        "4 requests x 16 new rows after 256 cached": [(256, 16)] * 4,
        "one 512-token prompt": [(0, 512)],
    }
    for dtype in (torch.bfloat16, torch.float32):
        for name, reqs in cases.items():
            b = build_batch(reqs, 16, 9, 3, 64, dtype=dtype, seed=0)
            meta = b["meta"]
            write_kv_cache(b["key"], b["value"], b["k_cache"], b["v_cache"], meta.slot_mapping)
            args = (b["query"], b["k_cache"], b["v_cache"], meta, 0.125)
            sdpa_call = functools.partial(paged_attention_sdpa, *args)
            sdpa = per_call_us(sdpa_call, clock=time.thread_time)
            cpu = per_call_us(functools.partial(kernel, *args), clock=time.thread_time)
            print(f"attention {dtype} {name}: sdpa {sdpa / 1e3:.2f} ms, "
                  f"kernel {cpu / 1e3:.2f} ms")  # fmt: skip


def linear() -> None:
    w = torch.randn(3072, 576).bfloat16()
    packed = layer(w, prepack=True)
    xs = {rows: torch.randn(rows, 576).bfloat16() for rows in (1, 64)}

    def run(where: str) -> None:
        for rows, x in xs.items():
            plain = per_call_us(functools.partial(F.linear, x, w), 200)
            pk = per_call_us(functools.partial(packed, x), 200)
            print(f"linear 576->3072 bf16, {rows} rows, {where}: F.linear {plain:.0f} us, "
                  f"prepacked {pk:.0f} us")  # fmt: skip

    for dtype in (torch.float32, torch.bfloat16):
        x, wd = torch.randn(64, 576, dtype=dtype), torch.randn(3072, 576, dtype=dtype)
        us = per_call_us(functools.partial(F.linear, x, wd), 200)
        print(f"F.linear 64 rows 576->3072 {dtype}: {2 * 64 * 576 * 3072 / us / 1e3:.0f} GFLOP/s")
    run("main thread")
    other = threading.Thread(target=run, args=("another thread",))
    other.start()
    other.join()


def quantized() -> None:
    from pagedllm.layers.quantization import Int4Weight, Int8Weight

    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    torch.manual_seed(0)
    codes = [Int4Weight.from_float(torch.randn(n, k)) for _ in range(30) for n, k in shapes]
    layers = [layer(c, "int4") for c in codes]
    # torch's own int4 kernel on the same codes, in its layout (zero = min + 8 * scale)
    torch_int4 = [
        (
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(c.q.to(torch.int32), 1),
            torch.stack([c.scale.t(), (c.min + 8 * c.scale).t()], -1).bfloat16().contiguous(),
            c.q.shape[1],
        )
        for c in codes
    ]

    def seconds(fn) -> float:
        return min(per_call_us(fn, 3) for _ in range(3)) / 1e6

    mb = sum(lyr.quant_method.nbytes(lyr) for lyr in layers) / 1e6
    for rows in (1, 2, 4, 8, 16, 32):
        xs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
        gemv = seconds(lambda xs=xs: [codes_times_rows(lyr, xs[lyr.input_size]) for lyr in layers])
        expand = seconds(lambda xs=xs: [
            F.linear(xs[lyr.input_size], lyr.quant_method.weight_as(lyr, torch.bfloat16))
            for lyr in layers])  # fmt: skip
        ref = seconds(lambda xs=xs: [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k], p, 32, sz)
                               for p, sz, k in torch_int4])  # fmt: skip
        print(f"int4, 120 projections ({mb:.0f} MB), {rows} rows: codes x rows "
              f"{gemv * 1e3:.2f} ms ({mb / 1e3 / gemv:.1f} GB/s), expanded + GEMM "
              f"{expand * 1e3:.2f} ms, torch's int4 kernel {ref * 1e3:.2f} ms")  # fmt: skip
    head = torch.randn(49152, 576).bfloat16()
    int8_head, bf16_head = layer(Int8Weight.from_float(head), "int8"), layer(head, prepack=True)
    for rows in (1, 4):
        x = torch.randn(rows, 576).bfloat16()
        int8_ms = seconds(lambda x=x: codes_times_rows(int8_head, x)) * 1e3
        bf16_ms = seconds(lambda x=x: bf16_head(x)) * 1e3
        print(f"LM head 49152x576, {rows} rows: int8 codes {int8_ms:.2f} ms, "
              f"prepacked bf16 {bf16_ms:.2f} ms")  # fmt: skip


def dual() -> None:
    from pagedllm.layers.quantization import Int4Weight

    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    torch.manual_seed(0)
    codes = [Int4Weight.from_float(torch.randn(n, k)) for _ in range(30) for n, k in shapes]
    int4 = [layer(c, "int4", torch.float32) for c in codes]
    dtypes = [torch.float32] + [torch.bfloat16] * can_pack(torch.bfloat16, torch.device("cpu"))

    def ms(fn) -> float:
        return min(per_call_us(fn, 3) for _ in range(3)) / 1e3

    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        dense = [layer(c.dequantize(), dtype=dtype, prepack=dtype == torch.bfloat16) for c in codes]
        last_win = 0
        for rows in (1, 2, 4, 8, 16, 24, 32, 48, 64):
            xs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
            t_codes = ms(lambda xs=xs: [codes_times_rows(w, xs[w.input_size]) for w in int4])
            t_dense = ms(lambda xs=xs, dense=dense: [w(xs[w.input_size]) for w in dense])
            last_win = rows if t_codes < t_dense else last_win
            print(f"{name}, 120 projections, {rows} rows: int4 codes {t_codes:.2f} ms, "
                  f"float weights {t_dense:.2f} ms ({t_dense / t_codes:.2f}x)")  # fmt: skip
        print(f"{name}: the codes are faster up to {last_win} rows")


def fixed_order() -> None:
    from pagedllm.layers.quantization import Int4Weight

    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    torch.manual_seed(0)
    codes = [Int4Weight.from_float(torch.randn(n, k)) for _ in range(30) for n, k in shapes]
    int4 = [layer(c, "int4", torch.float32) for c in codes]
    weights = [c.dequantize() for c in codes]
    ops = kernels.cpu_ops()

    def ms(fn) -> float:
        return min(per_call_us(fn, 3) for _ in range(3)) / 1e3

    flops_per_row = 2 * sum(w.numel() for w in weights)
    for rows in (1, 2, 16, 64, 256):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        t_mkl = ms(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights])
        t_dense = ms(lambda xs=xs: [ops.dense_linear(xs[w.shape[1]], w, None) for w in weights])
        t_codes = ms(lambda xs=xs: [codes_times_rows(w, xs[w.input_size]) for w in int4])
        gflops = rows * flops_per_row / 1e6
        print(f"float32, 120 projections, {rows} rows: F.linear {t_mkl:.2f} ms "
              f"({gflops / t_mkl:.1f} GFLOP/s), fixed-order dense {t_dense:.2f} ms "
              f"({t_mkl / t_dense:.2f}x F.linear), fixed-order int4 codes {t_codes:.2f} ms "
              f"({t_mkl / t_codes:.2f}x)")  # fmt: skip


def lora() -> None:
    import numpy as np

    from pagedllm.layers.lora import LoRAContext, LoRAMapping, LoRASlots

    torch.manual_seed(0)
    # (name, out, in, parts): the default model's projections
    shapes = [("qkv_proj", 960, 576, 3), ("o_proj", 576, 576, 1),
              ("gate_up_proj", 3072, 576, 2), ("down_proj", 576, 1536, 1)]  # fmt: skip
    for rows in (1, 8, 32):
        cells = []
        for name, n, k, parts in shapes:
            slots = LoRASlots(LoRAContext(), 4, parts, 16, k, n, torch.bfloat16,
                              torch.device("cpu"))  # fmt: skip
            c = 16 * parts
            slots.set_slot(1, torch.randn(c, k) / k**0.5, torch.randn(n, c) * 0.01)
            slots.context.mapping = LoRAMapping(np.ones(rows, np.int64), torch.device("cpu"))
            x, y = torch.randn(rows, k).bfloat16(), torch.randn(rows, n).bfloat16()
            a, bt = slots.a[1, :c], slots.b[1, :c]
            kernel = min(per_call_us(functools.partial(slots.apply, y, x), 200) for _ in range(3))
            gemms = min(
                per_call_us(lambda y=y, x=x, a=a, bt=bt: y.addmm_(x @ a.t(), bt), 200)
                for _ in range(3)
            )
            cells.append(f"{name} {kernel:.1f} us (torch {gemms:.1f})")
        print(f"LoRA rank 16, {rows} rows: " + ", ".join(cells))


if __name__ == "__main__":
    chosen = set(sys.argv[1:]) or {"--attention", "--linear", "--quantized", "--dual"}
    if "--lora" in chosen:
        lora()
    if "--fixed-order" in chosen:
        fixed_order()
    if "--dual" in chosen:
        dual()
    if "--quantized" in chosen:
        quantized()
    if "--linear" in chosen:
        linear()
    if "--attention" in chosen:
        attention()
