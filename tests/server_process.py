"""`pagedllm serve` as a subprocess on a free loopback port, for tests of the real server."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx

from pagedllm.bench.utils import free_port


def start_server(
    flags: list[str], timeout: float, env: dict | None = None, command: list[str] = ()
) -> tuple[subprocess.Popen, str, list[str]]:
    """Start `pagedllm serve --port P *flags` (after `command`'s words: a wrapper such as
    taskset), wait until /health answers 200; returns the process, its URL and its output
    lines so far (filled in as it prints)."""
    port = free_port()
    cli = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(
        [*command, *cli, *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while True:
        assert proc.poll() is None, "".join(lines)
        assert time.time() < deadline, "".join(lines)
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url, lines
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
