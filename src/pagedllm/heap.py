"""Handing freed heap memory back to the OS.

glibc's malloc keeps the pages of freed chunks (per-thread arenas, the top of the heap) for later
allocations, so a server's resident memory stays at its busiest moment's size after the load is
gone. `malloc_trim(0)` returns what it can; the engine loops call it when they fall idle
(docs/reliability.md measures what it gives back). Elsewhere than glibc it does nothing."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): no malloc_trim
        return None


def trim_heap() -> bool:
    """Return the C heap's free pages to the OS; False where malloc_trim is not available."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
