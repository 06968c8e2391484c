"""What several benchmarks share: CPU counters, greedy requests and their speed figures, text
tables, JSON reports, medians and free loopback ports."""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pagedllm.bench.workload import WorkloadRequest


# -- timing and CPU counters --------------------------------------------------------------------
def _children_cpu_seconds() -> float:
    """CPU seconds of this process's live children (tensor-parallel ranks: part of the run)."""
    total, me = 0, str(os.getpid())
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:  # ppid; utime and stime follow at 11 and 12
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def cpu_counters() -> tuple[float, float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its children,
    wall seconds)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    return busy, own.user + own.system + _children_cpu_seconds(), time.perf_counter()


def others_cpu_share(before, after) -> float | None:
    """Share of the machine's CPU time other processes used between two `cpu_counters()`:
    a CPU benchmark is only worth quoting when this stays near zero."""
    if before is None or after is None or after[2] <= before[2]:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others) / ((after[2] - before[2]) * (os.cpu_count() or 1))


def median(values: Iterable[float]) -> float | None:
    """The median, or None for no values."""
    values = list(values)
    return statistics.median(values) if values else None


# -- greedy requests and their figures ----------------------------------------------------------
def greedy_params(output_len: int):
    """Exactly `output_len` greedy tokens: a benchmark's request never stops early."""
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)


def speed_figures(
    requests: list[WorkloadRequest], token_ids: list[list[int]], generated: int, elapsed: float
) -> dict[str, Any]:
    """Throughput counting only useful output tokens (each request's own output_len)."""
    useful = sum(min(len(t), n) for t, (_, n) in zip(token_ids, requests, strict=True))
    num_prompt_tokens = sum(len(p) for p, _ in requests)
    return {
        "elapsed_s": elapsed,
        "num_requests": len(requests),
        "num_prompt_tokens": num_prompt_tokens,
        "num_output_tokens": generated,
        "num_useful_output_tokens": useful,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": useful / elapsed,
        "total_tokens_per_s": (num_prompt_tokens + useful) / elapsed,
    }


def greedy_agreement(
    ours: list[list[int]], theirs: list[list[int]], eos_ids: Iterable[int] = ()
) -> float:
    """Share of output tokens before two runs' greedy outputs first diverge.

    Each request is compared up to the first EOS in `ours`: there the engine (ignore_eos) takes
    EOS, while HF's `min_new_tokens` forbids it, so the two part ways by design, not by error.
    """
    eos = set(eos_ids)
    total = agree = 0
    for x, y in zip(ours, theirs, strict=True):
        cut = next((i for i, t in enumerate(x) if t in eos), len(x))
        total += cut
        for s, t in zip(x[:cut], y, strict=False):
            if s != t:
                break
            agree += 1
    return agree / total if total else 1.0


def print_run(name: str, r: dict[str, Any]) -> None:
    """`speed_figures` in one line, and a second when other processes skewed them."""
    print(
        f"[{name}] {r['num_requests']} requests in {r['elapsed_s']:.2f} s: "
        f"{r['requests_per_s']:.2f} requests/s, {r['output_tokens_per_s']:.1f} output tokens/s, "
        f"{r['total_tokens_per_s']:.1f} total tokens/s"
    )
    others = r.get("others_cpu_share")
    if others is not None:
        note = " (busy machine: these figures are skewed)" if others > 0.1 else ""
        print(f"[{name}] other processes used {others:.1%} of the machine's CPU meanwhile{note}")


# -- reports ------------------------------------------------------------------------------------
def table_lines(rows: list[tuple[str, ...]]) -> list[str]:
    """A text table: the first row is the header (underlined), the first column left-aligned,
    the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def write_json(path: str | Path, results: dict[str, Any]) -> None:
    """Every figure of a run to `path` (what JSON cannot hold, as text), and say so."""
    Path(path).write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {path}")


# -- servers ------------------------------------------------------------------------------------
def free_port() -> int:
    """A loopback port nobody listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
