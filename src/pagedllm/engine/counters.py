"""Readings of the engine's counters (get_stats()) added together: an engine process's totals
carried over its restarts (engine/core_client.py), replicas summed (engine/dp_client.py)."""

from __future__ import annotations

import itertools


def add_counter(a, b):
    """Two readings of a counter summed (a list: by position); None counts as nothing."""
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, list):
        return [x + y for x, y in itertools.zip_longest(a, b, fillvalue=0)]
    return a + b


def sum_counters(readings: list[dict]) -> dict:
    """The numeric counters (numbers, lists by position) of several readings summed; any other
    value as the first reading has it."""
    total: dict = {}
    for stats in readings:
        for key, value in stats.items():
            if isinstance(value, int | float | list) and not isinstance(value, bool):
                total[key] = add_counter(total.get(key), value)
            else:
                total.setdefault(key, value)
    return total
