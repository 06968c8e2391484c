"""`python -m benchmarks.recurrent_step`: the recurrent layers' C++ decode steps alone
(kernels/csrc/mamba_state.cpp), one layer's states for `--rows` sequences, in ms and in GB/s
of state read and written (each state is read once and written once: the step is bound by
memory bandwidth). Printed as JSON.

    python -m benchmarks.recurrent_step                      # gdn-1b's layer, 64 sequences
    python -m benchmarks.recurrent_step --kind mamba --heads 48 --dk 64 --dv 128  # hybrid-1b's
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedllm import kernels
from pagedllm.cpu_info import cpu_name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=["gated_deltanet", "mamba"], default="gated_deltanet")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dk", type=int, default=128, help="key dim (Mamba: head dim)")
    parser.add_argument("--dv", type=int, default=128, help="value dim (Mamba: state size)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    ops, r, h = kernels.cpu_ops(), args.rows, args.heads
    state = torch.randn(r, h, args.dk, args.dv)
    slots = torch.arange(r)
    if args.kind == "gated_deltanet":
        q, k = (torch.nn.functional.normalize(torch.randn(r, h, args.dk), dim=-1) for _ in "qk")
        v, out = torch.randn(r, h, args.dv), torch.empty(r, h, args.dv)
        decay, beta = -torch.rand(r, h), torch.rand(r, h)

        def step():
            ops.delta_rule_state_update(state, slots, q, k, v, decay, beta, out)
    else:
        x, y = torch.randn(r, h, args.dk), torch.empty(r, h, args.dk)
        dt, a = torch.rand(r, h), -torch.rand(h)
        b, c = torch.randn(r, h, args.dv), torch.randn(r, h, args.dv)

        def step():
            ops.mamba_state_update(state, slots, x, dt, a, b, c, y)

    for _ in range(3):
        step()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    t = statistics.median(times)
    print(json.dumps({
        "cpu": cpu_name(), "kind": args.kind, "rows": r, "state_mib": state.nbytes / 2**20,
        "ms": round(t * 1000, 2), "gb_per_s": round(2 * state.nbytes / t / 1e9, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
