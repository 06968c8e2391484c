"""Tensor parallelism across two hosts (tests/distributed/netns.py: this machine's network
namespace and another, joined by a veth link; gloo over that link): pagedllm's own --nnodes
flags and torchrun's c10d rendezvous give one rank's output; a link that drops mid-request fails
the step within --distributed-timeout, the server restarts its engine process, host 1's ranks
(restarted by their supervisor, as Kubernetes would) join the new group once the link is back,
and the open stream goes on to the same text."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.distributed.netns import two_hosts
from tests.server_process import free_port, start_server
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
TIMEOUT = 240
CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli"]
GENERATE = ["generate", "Name a colour.", "--max-tokens", "12", "--dtype", "float32",
            "--max-model-len", "256", "--kv-cache-memory", "32MiB"]  # fmt: skip


def _tx_bytes(link: str) -> int:
    return int(Path(f"/sys/class/net/{link}/statistics/tx_bytes").read_text())


def _on_both(hosts, argv_of) -> list[subprocess.CompletedProcess]:
    """argv_of(host) run on both hosts at once; both results."""
    procs = [subprocess.Popen(hosts.command(h, argv_of(h)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for h in (1, 0)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, o, e)
            for p, (o, e) in zip(procs, outs, strict=True)][::-1]  # fmt: skip


def test_two_hosts_give_one_ranks_output():
    single = subprocess.run([*CLI, *GENERATE], capture_output=True, text=True, timeout=TIMEOUT)
    assert single.returncode == 0 and single.stdout.strip(), single.stderr
    with two_hosts() as hosts:
        # pagedllm's flags: the same command on each host, with its --node-rank
        port = free_port()
        sent = _tx_bytes(hosts.links[0])
        own = _on_both(hosts, lambda h: [
            *CLI, *GENERATE, "-tp", "2", "--nnodes", "2", "--node-rank", str(h),
            "--master-addr", hosts.addrs[0], "--master-port", str(port)])  # fmt: skip
        sent = _tx_bytes(hosts.links[0]) - sent
        for run in own:
            assert run.returncode == 0, run.stderr[-3000:]
        assert own[0].stdout == single.stdout and own[1].stdout == ""
        assert "tensor parallelism: 2 ranks" in own[0].stderr
        assert sent > 100_000  # the weights' start-up and 12 steps' all-reduces crossed the link
        # torchrun's c10d rendezvous; each agent names its own address (--local-addr): a
        # namespace's host name resolves to the machine's, not to the link
        port = free_port()
        launched = _on_both(hosts, lambda h: [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "pagedllm",
            "--rdzv-endpoint", f"{hosts.addrs[0]}:{port}", "--local-addr", hosts.addrs[h],
            *(["--rdzv-conf", "is_host=true"] if h == 0 else []),
            "-m", "pagedllm.entrypoints.cli", *GENERATE, "-tp", "2"])  # fmt: skip
        for run in launched:
            assert run.returncode == 0, run.stderr[-3000:]
        assert single.stdout in (launched[0].stdout, launched[1].stdout)


class _Supervisor:
    """Host 1's ranks, started again whenever they exit (what a process supervisor does)."""

    def __init__(self, hosts, argv: list[str]) -> None:
        self.runs: list[int] = []  # exit codes
        self.output: list[str] = []
        self._stop = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._loop, args=(hosts.command(1, argv),))
        self._thread.start()

    def _loop(self, command) -> None:
        while not self._stop.is_set():
            self._proc = subprocess.Popen(command, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True)  # fmt: skip
            self.output.append(self._proc.communicate()[0])
            self.runs.append(self._proc.returncode)

    def stop(self) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.kill()
        self._thread.join(30)


def test_a_dropped_link_fails_the_step_and_the_group_comes_back():
    with two_hosts() as hosts:
        port = str(free_port())
        flags = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB",
                 "-tp", "2", "--nnodes", "2", "--master-addr", hosts.addrs[0], "--master-port",
                 port, "--distributed-timeout", "5"]  # fmt: skip
        node1 = _Supervisor(hosts, [*CLI, "serve", *flags, "--node-rank", "1"])
        proc = None
        try:
            proc, url, lines = start_server([*flags, "--node-rank", "0"], TIMEOUT,
                                            command=hosts.command(0, []))  # fmt: skip
            body = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            whole = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json()
            expected = whole["choices"][0]["text"]
            pieces: list[str] = []
            statuses: set[int] = set()
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                              timeout=TIMEOUT) as r:  # fmt: skip
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
                    if len(pieces) == 8:  # mid-request: the link goes, then comes back
                        hosts.set_link(False)

                        def unhealthy() -> bool:  # the step failed: the engine restarts
                            statuses.add(httpx.get(f"{url}/health", timeout=30).status_code)
                            return 503 in statuses

                        wait_until(unhealthy, lambda: "".join(lines), interval=0.2,
                                   tolerate=(httpx.TimeoutException,))  # fmt: skip
                        hosts.set_link(True)
            assert "".join(pieces) == expected
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            log = "".join(lines)
            assert "the engine process failed" in log and "Timed out" in log, log[-5000:]
            assert node1.runs and node1.runs[0] != 0  # its ranks saw the group end, and left
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
            (restarts,) = [line for line in metrics.splitlines()
                           if line.startswith("pagedllm:engine_restarts_total")]  # fmt: skip
            assert restarts.endswith(" 1.0"), restarts
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
            node1.stop()
