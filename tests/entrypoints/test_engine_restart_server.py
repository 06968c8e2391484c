"""The engine process killed under load, through the real server (uvicorn on loopback, the
engine in its own process: engine/core_client.py): 256 streamed completions at concurrency 48
while the engine process is SIGKILLed 10 times at random points. Every stream completes with
the text of an undisturbed run, no event repeated or lost; /health answers 503 while the engine
restarts; afterwards no block is held, the pool passes its integrity check, the restarts are on
/metrics and one engine process is left. The figures are printed (pytest -s) for
docs/reliability.md."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import threading
import time

import httpx
import pytest

from benchmarks.soak_targets import serve_in_thread
from pagedllm import SamplingParams
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.procs import child_pids
from tests.engine.test_engine_process import engine_processes, tiny_args

NUM_REQUESTS, CONCURRENCY, NUM_KILLS, MAX_TOKENS = 256, 48, 10, 32
PROMPTS = [f"Story {i}: once upon a time" for i in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    return tiny_args(tmp_path_factory, max_model_len=128)


def undisturbed(args) -> list[str]:
    engine = LLMEngine(args)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    texts = {}
    while engine.has_unfinished_requests():
        texts.update({o.request_id: o.outputs[0].text for o in engine.step() if o.finished})
    engine.shutdown()
    return [texts[str(i)] for i in range(NUM_REQUESTS)]


async def stream_all(url: str, progress: list[int]) -> list[tuple[str, int, str | None]]:
    """Each request's (joined text, events, finish reason), CONCURRENCY at a time."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(http: httpx.AsyncClient, i: int):
        body = {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        text, events, reason = "", 0, None
        async with gate, http.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                choice = event["choices"][0]
                text += choice["text"]
                reason = choice["finish_reason"] or reason
                events += 1
                progress[0] += 1
        return text, events, reason

    async with httpx.AsyncClient(timeout=120) as http:
        return await asyncio.gather(*(one(http, i) for i in range(NUM_REQUESTS)))


@pytest.mark.parametrize("victim", ["engine", "tp_worker"])
def test_sigkill_during_256_streams_loses_nothing(args, victim):
    """`tp_worker`: --tensor-parallel-size 2, and rank 1 (a child of the engine process) is the
    one killed: its engine process fails with it and both are replaced."""
    expected = undisturbed(args)
    if victim == "tp_worker":
        args = dataclasses.replace(args, tensor_parallel_size=2)
    client = EngineCoreClient(args, max_restarts=NUM_KILLS + 2)
    rng = random.Random(0)
    progress, kills, health_seen = [0], [], set()
    total_events = NUM_REQUESTS * MAX_TOKENS
    # Kill points spread over the run, by the number of events streamed so far.
    points = sorted(rng.sample(range(total_events // 20, total_events * 9 // 10), NUM_KILLS))
    done = threading.Event()
    try:
        with serve_in_thread(client, "m") as url:

            def killer():
                while points and not done.is_set():
                    if progress[0] >= points[0] and client.is_running and not client.is_restarting:
                        points.pop(0)
                        if victim == "engine":
                            os.kill(client.pid, signal.SIGKILL)
                        else:
                            (worker,) = child_pids(client.pid)
                            os.kill(worker, signal.SIGKILL)
                        kills.append(time.monotonic())
                        # /health until the replacement serves: 503 meanwhile, then 200
                        deadline, down = time.monotonic() + 30, False
                        while time.monotonic() < deadline:
                            status = httpx.get(f"{url}/health", timeout=5).status_code
                            health_seen.add(status)
                            down = down or status == 503
                            if down and status == 200:
                                break
                            time.sleep(0.02)
                    time.sleep(0.01)

            thread = threading.Thread(target=killer, daemon=True)
            thread.start()
            started = time.monotonic()
            results = asyncio.run(stream_all(url, progress))
            elapsed = time.monotonic() - started
            done.set()
            thread.join(30)
            snapshot = httpx.get(f"{url}/debug/kv?check=true", timeout=30).json()
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert len(kills) == NUM_KILLS and client.num_restarts == NUM_KILLS
        assert [r[0] for r in results] == expected  # no token lost or repeated
        assert all(r[2] == "length" for r in results)
        assert 503 in health_seen and 200 in health_seen
        assert snapshot["integrity"]["ok"] and snapshot["pool"]["counts"]["used"] == 0
        restarts = f'pagedllm:engine_restarts_total{{engine="0",model_name="m"}} {NUM_KILLS}.0'
        assert restarts in metrics
        assert len(engine_processes()) == (1 if victim == "engine" else 2)
        print(f"\n{NUM_REQUESTS} streams at concurrency {CONCURRENCY}, {NUM_KILLS} SIGKILLs "
              f"of the {victim}, "
              f"all equal to the undisturbed run, {elapsed:.1f} s")  # fmt: skip
    finally:
        client.shutdown()
    assert engine_processes() == []
