"""The soak's parts that stand apart from its report (benchmarks/soak.py): a real server on a
thread (`serve_in_thread`, which many server tests use too), a dashboard page polling during
the load, and the two engines a soak runs against: in this process (`InProcessEngine`) or in its
own process as `pagedllm serve` runs it (`EngineProcess`), each answering the same questions
(made resident, idle, memory, leaks)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from pagedllm.bench.utils import free_port
from pagedllm.config import EngineArgs
from pagedllm.engine import diagnostics
from pagedllm.engine.diagnostics import make_pool_resident


@contextlib.contextmanager
def serve_in_thread(async_engine, served_model_name: str, **options) -> Iterator[str]:
    """A real uvicorn server on a free loopback port, on a thread; yields its base URL. Leaving
    the block stops the server (not the engine). `options`: other ServerConfig fields."""
    import httpx
    import uvicorn

    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.connections import uvicorn_config
    from pagedllm.entrypoints.openai.server_config import ServerConfig

    server_config = ServerConfig(served_model_name, **options)
    app = build_app(async_engine, server_config)
    port = free_port()
    config = uvicorn_config(app, server_config, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="pagedllm-http", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if not thread.is_alive() or time.time() > deadline:
            raise RuntimeError("the in-process server did not come up")
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def wait_idle(engine, timeout: float = 120.0) -> bool:
    """Wait until the engine holds no request (aborts are applied between steps)."""
    deadline = time.time() + timeout
    while engine.has_unfinished_requests() and time.time() < deadline:
        time.sleep(0.05)
    return not engine.has_unfinished_requests()


class DashboardPoller:
    """An open dashboard page during the load: polls /debug/kv with the integrity check every
    `interval` seconds on a thread, and counts the polls that failed or whose snapshot did not
    pass the check or add up (free + cached + used == total)."""

    def __init__(self, url: str, interval: float = 0.5) -> None:
        self.url = f"{url}/debug/kv?check=true"
        self.interval = interval
        self.num_polls = 0
        self.bad: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dashboard-poller", daemon=True)

    def __enter__(self) -> DashboardPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=60) as http:
            while True:
                self.num_polls += 1
                try:
                    response = http.get(self.url)
                    response.raise_for_status()
                    snap = response.json()
                    pool = snap["pool"]
                    counts = pool["counts"]
                    if not snap["integrity"]["ok"]:
                        self.bad.append(snap["integrity"]["error"])
                    elif counts["free"] + counts["cached"] + counts["used"] != pool["num_blocks"]:
                        self.bad.append(f"counts {counts} do not add up to {pool['num_blocks']}")
                except Exception as e:  # noqa: BLE001 - counted and reported
                    self.bad.append(repr(e))
                if self._stop.wait(self.interval):
                    return


def _soak_leaks(report: dict[str, Any], open_streams: int) -> dict[str, Any]:
    """diagnostics.leak_report's fields as the soak reports them (an idle engine's blocks held
    are leaked), with the streams the server still holds open."""
    report = dict(report)
    return {
        "idle": report.pop("idle"), "integrity": report.pop("integrity"),
        "unfinished_requests": report.pop("unfinished_requests"), "open_streams": open_streams,
        "leaked_blocks": report.pop("blocks_held"), **report,
    }  # fmt: skip


def leak_report(async_engine) -> dict[str, Any]:
    """After the load, with the engine (an AsyncLLMEngine's, in this process) idle: what it
    still holds. Call from any thread once no request is in flight (the loop then only waits for
    commands)."""
    engine = async_engine.engine
    idle = wait_idle(engine)
    report = diagnostics.leak_report(engine)
    report["idle"] = idle and report["idle"]
    return _soak_leaks(report, len(async_engine._streams))


class InProcessEngine:
    """--no-engine-process: an LLMEngine in this process, its loop on a thread (AsyncLLMEngine).
    One process to read."""

    processes = ("",)

    def __init__(self, engine_args: EngineArgs) -> None:
        from pagedllm.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(engine_args)
        self.info = self.engine  # the tokenizer, the model's limits
        self.async_engine = None

    def start(self, resident_pool: bool) -> int:
        """The KV pool made resident (if asked; the bytes written), then the loop started."""
        from pagedllm.engine.async_llm_engine import AsyncLLMEngine

        written = make_pool_resident(self.engine) if resident_pool else 0
        self.async_engine = AsyncLLMEngine(self.engine)
        return written

    def wait_idle(self) -> bool:
        return wait_idle(self.engine)

    def read_memory(self, trim_heap: bool, by_type: bool) -> dict[str, dict[str, Any]]:
        return {"": diagnostics.memory_report(trim_heap, by_type)}

    def leak_report(self) -> dict[str, Any]:
        return leak_report(self.async_engine)

    def restarts(self) -> int:
        return 0

    def shutdown(self) -> None:
        if self.async_engine is not None:
            self.async_engine.shutdown()
        else:
            self.engine.shutdown()


class EngineProcess:
    """--engine-process: the engine in its own process (EngineCoreClient), as `pagedllm serve`
    runs it. What the soak asks of the engine goes to that process as calls
    (engine/diagnostics.py's reports); two processes to read: the server (this one) and the
    engine."""

    processes = ("server", "engine")

    def __init__(self, engine_args: EngineArgs) -> None:
        from pagedllm.engine.core_client import EngineCoreClient

        try:
            self.client = EngineCoreClient(engine_args)
        except RuntimeError as e:
            raise SystemExit(f"benchmarks.soak: {e}") from None
        self.async_engine = self.client
        self.info = self.client.engine
        self.first_pid = self.client.pid

    def call(self, method: str, *args, timeout: float = 600.0):
        """A call to the engine process; while it restarts (a restart fails the soak, but
        its readings go on), once the new process runs."""
        from pagedllm.engine.streams import EngineDeadError

        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.client.call_blocking(method, *args, timeout=timeout)
            except EngineDeadError:  # lost with its process, or sent while it restarts
                if not self.client.is_running or time.monotonic() > deadline:
                    raise  # the engine is dead (too many restarts), or the server stopped
                time.sleep(0.1)

    def start(self, resident_pool: bool) -> int:
        return self.call("make_pool_resident") if resident_pool else 0

    def wait_idle(self, timeout: float = 120.0) -> bool:
        deadline = time.monotonic() + timeout
        while not (idle := self.call("leak_report")["idle"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return idle

    def read_memory(self, trim_heap: bool, by_type: bool) -> dict[str, dict[str, Any]]:
        engine = self.call("memory_report", trim_heap, by_type)
        # Read last: the call's own garbage (its future, the reply) is collected by then.
        server = diagnostics.memory_report(trim_heap, by_type)
        return {"server": server, "engine": engine}

    def leak_report(self) -> dict[str, Any]:
        idle = self.wait_idle()
        report = self.call("leak_report")
        report["idle"] = idle and report["idle"]
        return _soak_leaks(report, len(self.client._tracked))

    def restarts(self) -> int:
        return self.client.num_restarts

    def shutdown(self) -> None:
        self.client.shutdown()
