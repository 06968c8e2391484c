"""Where a one-request decode step goes (docs/performance.md, items 7 and 8): the step with the
fused C++ decoder and through the model's modules (--enforce-eager); then, through the modules,
the wall time of each C++ kernel inside the step, and the step again with every kernel replaced
by a no-op (outputs still allocated), which leaves the Python and torch glue, scheduling and
sampling.

    python benchmarks/one_stream_split.py [quantization=int4 ...]   # EngineArgs fields
"""

import collections
import sys
import time

import numpy as np

from pagedllm import kernels
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams

KERNELS = ("int4_linear", "int8_linear", "paged_attention", "reshape_and_cache", "rms_norm",
           "rotary_embedding", "silu_and_mul")  # fmt: skip

overrides = dict(arg.split("=", 1) for arg in sys.argv[1:])
engine = LLMEngine(EngineArgs(max_model_len=2048, kv_cache_memory="1GiB", **overrides))
ops = kernels.cpu_ops()
prompt = {"prompt_token_ids": np.random.default_rng(0).integers(100, 20000, 128).tolist()}
engine.add_request("one", prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
for _ in range(5):
    engine.step()


def step_ms(n: int = 40) -> float:
    t = time.perf_counter()
    for _ in range(n):
        engine.step()
    return (time.perf_counter() - t) / n * 1e3


model = engine.executor.driver_worker.model
fused = model.model.fused
print(f"step with the fused decoder: {step_ms():.2f} ms" if fused else "no fused decoder here")
model.model.fused = None  # the modules, as --enforce-eager
print(f"step through the modules: {step_ms():.2f} ms")
seconds, calls = collections.Counter(), collections.Counter()
real = {name: getattr(ops, name) for name in KERNELS}


def timed(name):
    def call(*args):
        t = time.perf_counter()
        out = real[name](*args)
        seconds[name] += time.perf_counter() - t
        calls[name] += 1
        return out

    return call


for name in KERNELS:
    setattr(ops, name, timed(name))
n = 40
total = step_ms(n)
inside = sum(seconds.values()) / n * 1e3
print(f"modules, kernels timed: step {total:.2f} ms; inside C++ kernels {inside:.2f} ms")
for name, s in seconds.most_common():
    each = s / calls[name] * 1e6
    print(f"  {name}: {s / n * 1e3:.2f} ms ({calls[name] // n} calls, {each:.1f} us each)")
ops.int4_linear = lambda x, q, s, m: x.new_empty(x.shape[0], q.shape[0])
ops.int8_linear = lambda x, q, s: x.new_empty(x.shape[0], q.shape[0])
for name in KERNELS[2:]:
    setattr(ops, name, lambda *args: None)
print(f"modules, every kernel a no-op (outputs allocated): {step_ms():.2f} ms")
for name in KERNELS:
    setattr(ops, name, real[name])
