"""Tensor parallelism on the default model (9 query heads, 3 KV heads: ranks of 2 and 1 KV
heads): greedy output of 2 ranks equal to one rank's (float32), and `pagedllm serve -tp 2`
answering the real openai client, reporting a dead worker on /health, and leaving no process
behind when it stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from tests.server_process import free_port, start_server
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
TIMEOUT = 180
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def test_two_ranks_give_one_ranks_greedy_tokens():
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    outs = {}
    for tp in (1, 2):
        llm = LLM(dtype="float32", tensor_parallel_size=tp, kv_cache_memory="64MiB",
                  max_model_len=512)  # fmt: skip
        try:
            outs[tp] = llm.generate(PROMPTS, params, use_tqdm=False)
        finally:
            llm.shutdown()
    for one, two in zip(outs[1], outs[2], strict=True):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        for a, b in zip(one.outputs[0].logprobs, two.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _workers(pid: int) -> list[int]:
    """The server's spawned ranks (not multiprocessing's resource tracker)."""
    found = []
    for child in _children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            found.append(child)
    return found


def _serve(*flags):
    return start_server(
        ["--max-model-len", "512", "--kv-cache-memory", "64MiB", "-tp", "2", *flags], TIMEOUT
    )


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_server_answers_and_stops_cleanly():
    from openai import OpenAI

    proc, url, lines = _serve()
    try:
        workers = _workers(proc.pid)
        assert len(workers) == 1
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT)
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16,
            temperature=0,
        )  # fmt: skip
        assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
        assert "tensor parallelism: 2 ranks" in "".join(lines)
        metrics = httpx.get(f"{url}/metrics", timeout=30).text  # counted on rank 0
        generated = [line for line in metrics.splitlines()
                     if line.startswith("pagedllm:generation_tokens_total")]  # fmt: skip
        assert generated and float(generated[0].split()[-1]) >= chat.usage.completion_tokens
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert "server stopped" in "".join(lines)
    assert not any(_alive(p) for p in workers + _children(proc.pid))


def test_a_dead_worker_without_the_engine_process_is_reported():
    """--no-engine-process: rank 1 dies, the engine cannot step; /health and requests say so."""
    proc, url, lines = _serve("--no-engine-process")
    try:
        (worker,) = _workers(proc.pid)
        os.kill(worker, signal.SIGKILL)
        wait_until(
            lambda: httpx.get(f"{url}/health", timeout=30).status_code != 200,
            lambda: "".join(lines),
            interval=0.2,
            tolerate=(httpx.TimeoutException,),
        )
        assert httpx.get(f"{url}/health", timeout=30).status_code == 503
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code >= 500 and "worker rank 1 exited" in r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert not any(_alive(p) for p in _children(proc.pid))


def test_a_dead_worker_takes_its_engine_process_down_and_both_are_replaced():
    """The default: rank 1 (a child of the engine process) dies; the engine process fails, the
    server starts another with a new rank 1 (/health 503 meanwhile), and serves again."""
    proc, url, lines = _serve()
    try:
        (engine,) = _workers(proc.pid)
        (worker,) = _workers(engine)
        os.kill(worker, signal.SIGKILL)
        deadline, seen = time.time() + 120, set()
        while not (503 in seen and 200 in seen):
            assert time.time() < deadline, "".join(lines)
            seen.add(httpx.get(f"{url}/health", timeout=5).status_code)
            time.sleep(0.1)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        (new_engine,) = _workers(proc.pid)
        assert new_engine != engine and len(_workers(new_engine)) == 1
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert "pagedllm:engine_restarts_total" in metrics and "tensor-parallel worker" in "".join(
            lines
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert not any(_alive(p) for p in _children(proc.pid))


def test_torchrun_starts_every_rank():
    """A multi-node launch, on one node: torchrun starts both ranks with its rendezvous
    environment; rank 1 serves rank 0's steps and exits when rank 0 is done."""
    args = ["generate", "Name a colour.", "--max-tokens", "12", "--dtype", "float32",
            "--max-model-len", "256", "--kv-cache-memory", "32MiB"]  # fmt: skip
    cli = [sys.executable, "-m", "pagedllm.entrypoints.cli"]
    single = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=TIMEOUT)
    assert single.returncode == 0, single.stderr
    port = free_port()
    launched = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "pagedllm.entrypoints.cli", *args, "-tp", "2"],
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert launched.stdout == single.stdout and single.stdout.strip()
    assert "tensor parallelism: 2 ranks" in launched.stderr
