"""What a soak or a leak hunt asks of an engine, wherever it runs: the process's memory (RSS, with
and without trimming the C heap; the objects the garbage collector tracks, by type if asked),
what an engine still holds (leak_report), and its KV pool made resident before a measurement.

The engine process (engine/core_proc.py) answers these as calls ("memory_report",
"leak_report", "make_pool_resident"); an engine in the caller's process is passed directly.
They read the engine's internals: diagnostics, not the serving path."""

from __future__ import annotations

import collections
import gc
import os
from typing import Any

from pagedllm.heap import trim_heap as _trim_heap


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/<pid>/status")


def num_objects() -> int:
    """Objects the garbage collector tracks, after a collection: leaked Python state grows it,
    native allocator churn does not."""
    gc.collect()
    return len(gc.get_objects())


def _type_name(obj: object) -> str:
    kind = type(obj)
    module = getattr(kind, "__module__", None)
    name = getattr(kind, "__qualname__", kind.__name__)
    return name if module in (None, "builtins") else f"{module}.{name}"


def object_types() -> collections.Counter[str]:
    """The objects the garbage collector tracks, counted by type, after a collection."""
    gc.collect()
    return collections.Counter(_type_name(obj) for obj in gc.get_objects())


def memory_report(trim_heap: bool = False, by_type: bool = False) -> dict[str, Any]:
    """This process's memory: the objects the garbage collector tracks (after a collection),
    then RSS, and, with `trim_heap`, RSS again after `pagedllm.heap.trim_heap()` (malloc_trim),
    so that free pages the C heap keeps are not counted (`rss_bytes` is the last reading,
    `rss_before_trim_bytes` the first). `by_type`: the objects counted by type too (after the
    RSS readings, so that counting them is not in those)."""
    report: dict[str, Any] = {"pid": os.getpid(), "num_objects": num_objects()}
    report["rss_before_trim_bytes"] = rss_bytes()
    if trim_heap:
        _trim_heap()
    report["rss_bytes"] = rss_bytes()
    if by_type:
        report["object_types"] = dict(object_types())
    return report


def leak_report(engine) -> dict[str, Any]:
    """What an LLMEngine holds now, without waiting: whether it is idle (no unfinished request),
    the scheduler's and pool's integrity check ("ok" or "failed: ..."), its unfinished requests,
    the KV blocks held by requests (blocks kept only for the prefix cache count as free: 0 once
    idle, unless blocks leaked), and the KV usage. Call between steps (the engine's thread)."""
    kv = engine.scheduler.kv_cache_manager
    integrity = "ok"
    try:
        engine.scheduler.check_integrity()
    except AssertionError as e:
        integrity = f"failed: {e}"
    return {
        "idle": not engine.has_unfinished_requests(),
        "integrity": integrity,
        "unfinished_requests": engine.get_num_unfinished_requests(),
        "blocks_held": engine.num_blocks - kv.num_free_blocks,
        "num_blocks": engine.num_blocks,
        "kv_cache_usage": kv.usage,
        "num_preemptions_total": engine.get_stats()["num_preemptions_total"],
    }


def make_pool_resident(engine) -> int:
    """Touch every page of the engine's KV pool (and swap space, and a draft model's pool) and
    make every block's object: the pool is allocated uninitialized and the block pool makes a
    block's object the first time it hands it out, so otherwise both grow the process as the
    load first spreads over the blocks. Writes zeros, which no kernel reads (a slot is written
    before it is read): ValueError while the engine holds a request. Only the CPU tensors of
    this process (rank 0's) are written. Returns the bytes written."""
    import torch

    if engine.has_unfinished_requests():
        raise ValueError("the KV pool can be made resident only while the engine holds no request")
    kv_manager = engine.scheduler.kv_cache_manager
    for name in ("block_pool", "cpu_block_pool"):
        block_pool = getattr(kv_manager, name, None)
        if block_pool is not None and hasattr(block_pool, "blocks"):
            block_pool.blocks  # noqa: B018 - makes the never-used blocks' objects
    runner = engine.executor.driver_worker.model_runner
    draft = getattr(getattr(runner, "proposer", None), "runner", None)
    tensors = []
    for kv_cache in (runner.kv_cache, getattr(draft, "kv_cache", None)):
        if kv_cache is not None:
            tensors += [kv_cache.pool, kv_cache.swap_pool]
    written = 0
    with torch.no_grad():
        for tensor in tensors:
            # Writes: reading a page never written maps the shared zero page, not counted in RSS.
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                tensor.zero_()
                written += tensor.numel() * tensor.element_size()
    return written
