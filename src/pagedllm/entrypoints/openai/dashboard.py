"""The live KV-cache dashboard: `GET /dashboard`, one self-contained page (dashboard.html: no
external file, no network access), and `GET /debug/kv`, the JSON it polls twice a second.

`/debug/kv` is the engine's KV snapshot (engine/kv_snapshot.py) plus the recent history of the
engine's counters, sampled here once a second from `get_stats()` (cheap: no engine work). The
snapshot itself walks the pool on the engine's thread, so this module takes at most one every
SNAPSHOT_INTERVAL seconds and hands the same one to every page polling meanwhile. The fields are
described in docs/dashboard.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from pagedllm.engine.protocol import EngineClient
from pagedllm.engine.streams import EngineDeadError
from pagedllm.entrypoints.openai.errors import error_body

DASHBOARD_PATHS = ("/dashboard", "/debug/kv")
SNAPSHOT_INTERVAL = 0.2  # seconds: at most 5 snapshots a second, however many pages are open
HISTORY_INTERVAL = 1.0  # seconds between two samples of the counters
HISTORY_LENGTH = 600  # samples kept: the last 10 minutes
# The page may reach only this server (its polls) and run only its own inline script and style.
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"
    ),
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
}
# Counters kept in the history (cumulative ones: the page derives rates from two samples).
HISTORY_KEYS = (
    "num_running",
    "num_waiting",
    "num_swapped",
    "kv_cache_usage",
    "swap_space_usage",
    "num_preemptions_total",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_prompt_tokens_total",
    "num_generation_tokens_total",
    "num_first_tokens_total",
    "time_to_first_token_seconds_total",
)


class SnapshotCache:
    """One snapshot at a time, reused for SNAPSHOT_INTERVAL seconds; concurrent callers share the
    one in flight (and a caller that leaves does not cancel it for the others). Kept as JSON
    bytes, so a busy dashboard costs one serialisation per snapshot, not one per poll."""

    def __init__(self, async_engine: EngineClient, interval: float = SNAPSHOT_INTERVAL) -> None:
        self.async_engine = async_engine
        self.interval = interval
        self._slots: dict[bool, tuple[float, asyncio.Task]] = {}  # check -> (started, task)

    async def get(self, check: bool) -> bytes:
        now = time.monotonic()
        slot = self._slots.get(check)
        if slot is None or (slot[1].done() and now - slot[0] >= self.interval):
            slot = self._slots[check] = (now, asyncio.ensure_future(self._take(check)))
        return await asyncio.shield(slot[1])

    async def _take(self, check: bool) -> bytes:
        snapshot = await self.async_engine.kv_snapshot(check)
        return json.dumps(snapshot, separators=(",", ":")).encode()


class StatsHistory:
    """The engine's counters, sampled every `interval` seconds by `run()`."""

    def __init__(self, engine, interval: float = HISTORY_INTERVAL) -> None:
        self.engine = engine
        self.interval = interval
        self.samples: collections.deque[dict] = collections.deque(maxlen=HISTORY_LENGTH)

    def sample(self) -> None:
        stats = self.engine.get_stats()
        self.samples.append({"time": time.time(), **{k: stats[k] for k in HISTORY_KEYS}})

    def since(self, t: float) -> list[dict]:
        """Samples taken after `t` (a time from an earlier sample; 0: all of them)."""
        return [s for s in self.samples if s["time"] > t]

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval)


def add_dashboard(app: FastAPI, async_engine: EngineClient) -> StatsHistory:
    """Add the two routes; returns the history, whose `run()` the app's lifespan runs."""
    snapshots = SnapshotCache(async_engine)
    history = StatsHistory(async_engine.engine)
    page = resources.files("pagedllm.entrypoints.openai").joinpath("dashboard.html").read_text()

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard():
        return HTMLResponse(page, headers=_PAGE_HEADERS)

    @app.get("/debug/kv")
    async def debug_kv(since: float = 0.0, check: bool = False):
        try:
            snapshot = await snapshots.get(check)
        except EngineDeadError as e:
            return Response(json.dumps(error_body(str(e), 503)), 503, media_type="application/json")
        samples = json.dumps(history.since(since), separators=(",", ":")).encode()
        # {"history": [...], "history_interval": s, <the snapshot's fields>}
        head = b'{"history":%s,"history_interval":%s,' % (samples, str(history.interval).encode())
        return Response(head + snapshot[1:], media_type="application/json")

    return history


@contextlib.asynccontextmanager
async def running(history: StatsHistory | None):
    """Sample `history` (if any) in the background for as long as the block lasts."""
    if history is None:
        yield
        return
    task = asyncio.create_task(history.run())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
