"""Where a one-request decode step goes (docs/performance.md, items 7 and 8, and the integer
path's section): the step with the fused C++ decoder, then on a second engine built with
enforce_eager=True, through the model's modules; then, through the modules, the wall time of
each C++ kernel inside the step, and the step again with every kernel replaced by a no-op
(outputs still allocated), which leaves the Python and torch glue, scheduling and sampling.
The kernels are swapped on pagedllm.kernels' ops object for the two measurements only, and put
back after each.

    python benchmarks/one_stream_split.py [quantization=int4 ...]   # EngineArgs fields
"""

import collections
import contextlib
import dataclasses
import gc
import sys
import time

import numpy as np

from pagedllm import kernels
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams

LINEARS = ("int4_linear", "int8_linear", "int8_act_linear")  # they return their output
KERNELS = (*LINEARS, "paged_attention", "reshape_and_cache", "rms_norm", "rotary_embedding",
           "silu_and_mul")  # fmt: skip

overrides = dict(arg.split("=", 1) for arg in sys.argv[1:])
overrides = {k: int(v) if v.isdigit() else v for k, v in overrides.items()}  # max_model_len=1024
args = EngineArgs(**{"max_model_len": 2048, "kv_cache_memory": "1GiB", **overrides})
prompt = {"prompt_token_ids": np.random.default_rng(0).integers(100, 20000, 128).tolist()}


def decoding_engine(engine_args: EngineArgs) -> LLMEngine:
    """An engine with the one request past its prefill and first decode steps."""
    engine = LLMEngine(engine_args)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    engine.add_request("one", prompt, params)
    for _ in range(5):
        engine.step()
    return engine


def step_ms(engine: LLMEngine, n: int = 40) -> float:
    t = time.perf_counter()
    for _ in range(n):
        engine.step()
    return (time.perf_counter() - t) / n * 1e3


@contextlib.contextmanager
def replaced(ops, functions: dict):
    """ops' kernels replaced by `functions` inside the block, the originals back after it."""
    real = {name: getattr(ops, name) for name in functions}
    for name, fn in functions.items():
        setattr(ops, name, fn)
    try:
        yield real
    finally:
        for name, fn in real.items():
            setattr(ops, name, fn)


engine = decoding_engine(args)
if engine.executor.driver_worker.model_runner.fused is not None:  # read only: is it fused here?
    print(f"step with the fused decoder: {step_ms(engine):.2f} ms")
else:
    print("no fused decoder here")
del engine
gc.collect()
engine = decoding_engine(dataclasses.replace(args, enforce_eager=True))
print(f"step through the modules: {step_ms(engine):.2f} ms")

ops = kernels.cpu_ops()
seconds, calls = collections.Counter(), collections.Counter()


def timed(name, real):
    def call(*args):
        t = time.perf_counter()
        out = real(*args)
        seconds[name] += time.perf_counter() - t
        calls[name] += 1
        return out

    return call


n = 40
with replaced(ops, {name: timed(name, getattr(ops, name)) for name in KERNELS}):
    total = step_ms(engine, n)
inside = sum(seconds.values()) / n * 1e3
print(f"modules, kernels timed: step {total:.2f} ms; inside C++ kernels {inside:.2f} ms")
for name, s in seconds.most_common():
    each = s / calls[name] * 1e6
    print(f"  {name}: {s / n * 1e3:.2f} ms ({calls[name] // n} calls, {each:.1f} us each)")
no_ops = {name: (lambda *args: None) for name in KERNELS[len(LINEARS) :]}
no_ops["int4_linear"] = lambda x, q, s, m: x.new_empty(x.shape[0], q.shape[0])
no_ops["int8_linear"] = lambda x, q, s: x.new_empty(x.shape[0], q.shape[0])
no_ops["int8_act_linear"] = lambda x, codes, s, m, bits, n, variant="": x.new_empty(x.shape[0], n)
with replaced(ops, no_ops):
    print(f"modules, every kernel a no-op (outputs allocated): {step_ms(engine):.2f} ms")
