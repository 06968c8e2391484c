"""Waiting, in tests, for what a server or engine does a moment later (a freed block, a 503, a
log line). A test must pass on a busy machine (a full suite beside a compile), so every such wait
has one bound, far past what an idle machine needs; a passing test still returns as soon as the
condition holds."""

from __future__ import annotations

import time
from collections.abc import Callable

PATIENCE = 300.0  # seconds; an idle 2-core machine needs a few


def wait_until(
    condition: Callable[[], object],
    what: object = "",
    timeout: float = PATIENCE,
    interval: float = 0.05,
    tolerate: tuple[type[BaseException], ...] = (),
) -> None:
    """Call `condition` every `interval` seconds until it is true. Past `timeout`, fail with
    `what` (a string, or a callable giving one: the state to show). Exceptions in `tolerate`
    (a request that timed out on a loaded machine) count as not yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except tolerate:
            pass
        if time.monotonic() >= deadline:
            shown = what() if callable(what) else what
            raise AssertionError(f"waited {timeout:.0f} s for: {shown}")
        time.sleep(interval)
