"""Faults a test injects into engine processes (engine/core_proc.py): a step that hangs, a
prompt that crashes its process. Never set when serving."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Faults:
    """Faults a test injects into engine processes (never set when serving)."""

    hang_at_step: int | None = None  # the first engine process sleeps in this step ...
    hang_seconds: float = 3600.0  # ... this long
    crash_on_token: int | None = None  # a process aborts when it runs a prompt with this token
