"""What this machine's CPU offers: instruction-set flags and the cores this process may use."""

from __future__ import annotations

import functools
import math
import os
import platform
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The `flags` of /proc/cpuinfo (Linux); elsewhere only what platform.processor() says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset(platform.processor().split())


def cpu_name() -> str:
    """The CPU's model name with its family and model numbers (which tell its generation where
    a virtual machine's name does not: "AMD EPYC (family 26, model 2)"), as benchmarks print it."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or "unknown CPU"
    name = fields.get("model name", platform.processor() or "unknown CPU")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX-BF16: bfloat16 matmuls in hardware, not emulated."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def available_cpus() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (a
    container's --cpus), which torch's default thread count does not see."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = cgroup_cpu_quota()
    if quota is not None:
        count = min(count or quota, quota)
    return max(1, count or 1)


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> int | None:
    """ceil(quota / period) from cgroup v2's cpu.max or v1's cfs files; None without a quota."""

    def read(path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None

    v2 = read(f"{root}/cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
    else:
        quota = read(f"{root}/cpu/cpu.cfs_quota_us")
        period = read(f"{root}/cpu/cpu.cfs_period_us")
    try:
        return max(1, math.ceil(int(quota) / int(period))) if int(quota) > 0 else None
    except (TypeError, ValueError):  # "max", missing files
        return None
