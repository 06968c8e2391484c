"""`python -m benchmarks.moe_step`: a decode step of a mixture-of-experts model against a dense
model with the same active parameters, at 1, 8 and 64 running requests, in one process, and
where the MoE step's time goes.

Both models are random GGUFs written by benchmarks/random_gguf.py (written first when missing):
`moe-a3b` (Qwen3-30B-A3B's layer: 128 experts of 768, 8 used, 8 layers) and `dense-a3b` (the
same attention, one MLP of 8 x 768). Default flags (on CPU: the codes in integers, 8-bit
activations). The two engines are measured alternately, `--rounds` times, and each figure is
the median step over the rounds.

    python -m benchmarks.moe_step [--type Q4_1] [--running 1,8,64] [--steps 8] [--rounds 3]

Printed per running count: the dense and MoE step (ms) and their ratio; of the MoE step, the
time inside its mixture-of-experts blocks (routing, grouping and the experts' products), the
experts a layer ran (of 128), and the expert weights those read, as bytes per step. Routing is
`--routing balanced` by default: each token's experts drawn uniformly, as a trained router's
load balancing spreads them (the random model's own router does not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from benchmarks.common import int_list
from benchmarks.random_gguf import write_random_gguf
from pagedllm.config import EngineArgs
from pagedllm.cpu_info import available_cpus, cpu_name
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams

PROMPT_TOKENS = 32


class MoeTimer:
    """Wraps every SparseMoeBlock's forward of a model: seconds inside them, and the experts
    each call ran."""

    def __init__(self, model, balanced: bool):
        from pagedllm.layers.moe import SparseMoeBlock

        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.reset()
        self.generator = torch.Generator().manual_seed(0)
        for block in self.blocks:
            block.forward = self._timed(block.forward)
            route = self._balanced(block) if balanced else block.route
            block.route = self._kept(route)

    def _balanced(self, block):
        """A trained router's load balance: each token's k experts drawn uniformly (distinct),
        its weights a softmax of random logits. (A random model's hidden states are much alike
        from token to token, so its own router sends nearly all tokens to the same experts.)"""

        def route(x):
            scores = torch.rand(x.shape[0], block.num_experts, generator=self.generator)
            ids = scores.topk(block.top_k, dim=-1).indices
            weights = torch.softmax(torch.randn(ids.shape, generator=self.generator), dim=-1)
            return weights, ids

        return route

    def reset(self) -> None:
        self.seconds, self.calls, self.routes = 0.0, 0, []

    def _timed(self, forward):
        def run(x):
            start = time.perf_counter()
            out = forward(x)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            return out

        return run

    def _kept(self, route):
        def run(x):
            weights, ids = route(x)
            self.routes.append(ids)  # counted after the steps, not inside them
            return weights, ids

        return run

    @property
    def experts_per_call(self) -> float:
        return sum(int(ids.unique().numel()) for ids in self.routes) / len(self.routes)

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (their codes)."""
        expert = self.blocks[0].experts[0]
        return sum(getattr(m, "nbytes", 0) or _param_bytes(m) for m in expert.modules()
                   if hasattr(m, "quant_method"))  # fmt: skip


def _param_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def make_engine(path: str) -> LLMEngine:
    return LLMEngine(EngineArgs(model=path, max_model_len=512, kv_cache_memory="1GiB"))


def decode_steps(engine: LLMEngine, n: int, steps: int, rng, before=None) -> list[float]:
    """Seconds of each of `steps` decode steps with n requests running (prefilled first);
    `before` is called just before the first."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    ids = [f"{n}-{i}-{rng.integers(1 << 30)}" for i in range(n)]
    for rid in ids:
        prompt = rng.integers(100, 20000, PROMPT_TOKENS).tolist()
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    started: set[str] = set()
    while len(started) < n:
        started |= {o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids}
    engine.step()
    if before is not None:
        before()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--type", default="Q4_1", help="the projections' quantization")
    parser.add_argument("--dir", default="/tmp", help="where the GGUFs are (or are written)")
    parser.add_argument("--running", type=int_list, default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--routing", choices=["balanced", "model"], default="balanced",
                        help="experts drawn uniformly per token (a trained router's balance), "
                        "or the random model's own router")  # fmt: skip
    args = parser.parse_args(argv)
    paths = {}
    for shape in ("dense-a3b", "moe-a3b"):
        paths[shape] = os.path.join(args.dir, f"{shape}-{args.type.lower()}.gguf")
        if not os.path.exists(paths[shape]):
            info = write_random_gguf(paths[shape], shape, args.type)
            print(
                f"wrote {paths[shape]} ({info['bytes'] / 2**20:.0f} MiB) in {info['seconds']:.0f} s"
            )
    engines = {shape: make_engine(path) for shape, path in paths.items()}
    timer = MoeTimer(
        engines["moe-a3b"].executor.driver_worker.model_runner.model, args.routing == "balanced"
    )
    rng = np.random.default_rng(0)
    for engine in engines.values():  # warm-up: every row count once
        for n in args.running:
            decode_steps(engine, n, 2, rng)
    results = {
        n: {"dense-a3b": [], "moe-a3b": [], "moe_block": [], "experts": []} for n in args.running
    }
    for _ in range(args.rounds):
        for n in args.running:
            for shape, engine in engines.items():
                times = decode_steps(engine, n, args.steps, rng, timer.reset)
                results[n][shape].append(statistics.median(times))
                if shape == "moe-a3b":  # the MoE blocks' share of the timed steps
                    results[n]["moe_block"].append(timer.seconds / args.steps)
                    results[n]["experts"].append(timer.experts_per_call)
    expert_bytes = timer.expert_bytes()
    print(f"CPU: {cpu_name()}, {available_cpus()} CPUs; {args.type}; {args.rounds} rounds of "
          f"{args.steps} steps; {args.routing} routing")  # fmt: skip
    print("running  dense ms  moe ms  ratio  moe-block ms  experts/layer  expert MB/step")
    summary = {}
    for n, r in results.items():
        dense, moe = statistics.median(r["dense-a3b"]), statistics.median(r["moe-a3b"])
        block, experts = statistics.median(r["moe_block"]), statistics.mean(r["experts"])
        read = experts * expert_bytes * len(timer.blocks)
        summary[n] = dict(dense_ms=dense * 1e3, moe_ms=moe * 1e3, ratio=moe / dense,
                          moe_block_ms=block * 1e3, experts_per_layer=experts,
                          expert_bytes_per_step=read)  # fmt: skip
        print(f"{n:7d}  {dense * 1e3:8.1f}  {moe * 1e3:6.1f}  {moe / dense:5.2f}  "
              f"{block * 1e3:12.1f}  {experts:13.1f}  {read / 1e6:14.0f}")  # fmt: skip
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
