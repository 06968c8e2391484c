"""The dashboard's routes over real HTTP on loopback: /debug/kv stays consistent with the pool's
integrity check while a workload shares, swaps and finishes; polls share snapshots; the page is
self-contained; the API key guards both routes (HTTP Basic for browsers); --no-dashboard; a dead
engine. A tiny random Llama with the default model's vocabulary (fast); the browser test with
the real default model is test_dashboard_browser.py."""

import asyncio
import threading
import time
import uuid
from base64 import b64encode
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.openai.dashboard import HISTORY_KEYS
from tests.conftest import save_tiny_llama
from tests.engine.test_kv_snapshot import assert_consistent
from tests.entrypoints.test_faults_and_limits import TIMEOUT, TOKENIZER, InProcessServer

PREFIX = list(range(100, 140))  # 40 tokens every prompt shares: 2 full blocks of 16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-dashboard")
    save_tiny_llama(path, vocab_size=49152, max_position_embeddings=512)
    return str(path)


def _engine(model: str) -> LLMEngine:
    args = EngineArgs(
        model=model, tokenizer=TOKENIZER, device="cpu", max_model_len=256,
        num_gpu_blocks_override=40, preemption_mode="swap", swap_space=0.0005,
    )  # fmt: skip
    return LLMEngine(args)


@pytest.fixture(scope="module")
def server(tiny_model):
    s = InProcessServer(AsyncLLMEngine(_engine(tiny_model)))
    yield s
    s.stop()


def _basic(password: str, user: str = "") -> dict:
    return {"Authorization": "Basic " + b64encode(f"{user}:{password}".encode()).decode()}


def test_the_page_is_self_contained(server):
    response = httpx.get(f"{server.url}/dashboard", timeout=TIMEOUT)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    csp = response.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    page = response.text
    # No file or address outside the page: it fetches nothing but its own server's JSON.
    for outside in ("http://", "https://", " src=", "@import", "url("):
        assert outside not in page, outside
    assert "debug/kv" in page and '<canvas class="grid" id="pool"' in page


def test_snapshots_stay_consistent_while_requests_share_and_swap(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=TIMEOUT)

    def run(i: int) -> None:
        prompt = PREFIX + [(7 * i + j) % 900 + 1000 for j in range(5 + i)]
        client.completions.create(
            model="tiny", prompt=prompt, n=3 if i % 2 == 0 else 1, max_tokens=80,
            temperature=1.0, seed=i, extra_body={"ignore_eos": True},
        )  # fmt: skip

    seen = {"shared": 0, "cached": 0, "swap": 0, "statuses": set(), "polls": 0}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(run, i) for i in range(6)]
            while not all(f.done() for f in futures):
                snap = http.get("/debug/kv", params={"check": "true"}).json()
                assert_consistent(snap)
                counts = snap["pool"]["counts"]
                seen["shared"] = max(seen["shared"], counts["shared"])
                seen["cached"] = max(seen["cached"], counts["cached"])
                seen["swap"] = max(seen["swap"], snap["swap"]["counts"]["used"])
                seen["statuses"] |= {r["status"] for r in snap["requests"]}
                seen["polls"] += 1
                time.sleep(0.05)
            for f in futures:
                f.result()
        server.wait_idle()
        time.sleep(0.3)  # past the interval in which polls get the last snapshot again
        final = http.get("/debug/kv", params={"check": "true"}).json()
    assert_consistent(final)
    assert final["requests"] == [] and final["pool"]["counts"]["used"] == 0
    assert seen["polls"] >= 3
    assert seen["shared"] > 0, seen
    assert seen["swap"] > 0 and "swapped" in seen["statuses"], seen
    assert "running" in seen["statuses"]
    # The counters' history: samples once a second, each with every key, in time order.
    history = final["history"]
    assert len(history) >= 2 and final["history_interval"] == 1.0
    assert all(set(HISTORY_KEYS) <= s.keys() for s in history)
    assert [s["time"] for s in history] == sorted(s["time"] for s in history)
    last = history[-1]
    assert last["num_generation_tokens_total"] >= 6 * 80 and last["num_first_tokens_total"] >= 6
    later = httpx.get(f"{server.url}/debug/kv", params={"since": history[-2]["time"]}).json()
    assert [s["time"] for s in later["history"]][0] == last["time"]


def test_concurrent_polls_share_one_snapshot(server, monkeypatch):
    engine = server.engine.engine
    taken = []
    original = engine.kv_snapshot

    def counting(check=False):
        taken.append(time.monotonic())
        return original(check)

    monkeypatch.setattr(engine, "kv_snapshot", counting)
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        time.sleep(0.3)  # past the previous test's last snapshot
        http.get("/debug/kv")  # a fresh snapshot: the next polls fall in its interval
        assert taken
        start = len(taken)
        with ThreadPoolExecutor(16) as pool:
            responses = list(pool.map(lambda _: http.get("/debug/kv"), range(48)))
        times = {r.json()["time"] for r in responses}
    assert all(r.status_code == 200 for r in responses)
    elapsed = max(taken[-1] - taken[start - 1], 0.2)
    # At most one snapshot per 0.2 s (plus the one in flight), whatever the number of polls.
    assert len(taken) - start <= elapsed / 0.2 + 1, (len(taken) - start, elapsed)
    assert len(times) <= len(taken) - start + 1


def test_the_api_key_guards_the_dashboard_and_basic_auth_opens_it(server):
    key = "sk-" + uuid.uuid4().hex
    keyed = InProcessServer(server.engine, api_key=key)
    try:
        with httpx.Client(base_url=keyed.url, timeout=TIMEOUT) as http:
            for path in ("/dashboard", "/debug/kv"):
                response = http.get(path)
                assert response.status_code == 401
                assert response.headers["www-authenticate"].startswith("Basic ")
                for wrong in (_basic("wrong"), _basic(key + "x"), {"Authorization": "Basic !!"}):
                    assert http.get(path, headers=wrong).status_code == 401
                for right in ({"Authorization": f"Bearer {key}"}, _basic(key), _basic(key, "me")):
                    assert http.get(path, headers=right).status_code == 200, (path, right)
            # Basic auth is for the dashboard only; the API keeps its Bearer key.
            response = http.get("/v1/models", headers=_basic(key))
            assert response.status_code == 401 and "www-authenticate" not in response.headers
    finally:
        keyed.stop_app()


def test_no_dashboard_turns_both_routes_off(server):
    off = InProcessServer(server.engine, enable_dashboard=False)
    try:
        for path in ("/dashboard", "/debug/kv"):
            assert httpx.get(off.url + path, timeout=TIMEOUT).status_code == 404
        assert httpx.get(off.url + "/health", timeout=TIMEOUT).status_code == 200
    finally:
        off.stop_app()
    parser = build_parser()
    assert parser.parse_args(["serve"]).enable_dashboard is True
    assert parser.parse_args(["serve", "--no-dashboard"]).enable_dashboard is False


def test_a_stopped_engine_answers_503_at_once(tiny_model):
    async_engine = AsyncLLMEngine(_engine(tiny_model))
    s = InProcessServer(async_engine)
    try:
        async_engine.shutdown()
        response = httpx.get(f"{s.url}/debug/kv", timeout=10)
        assert response.status_code == 503 and "stopped" in response.json()["error"]["message"]
    finally:
        s.stop_app()


def test_a_snapshot_asked_for_as_the_loop_stops_fails_instead_of_hanging(tiny_model):
    async_engine = AsyncLLMEngine(_engine(tiny_model), start_thread=False)

    async def main() -> None:
        async_engine.shutdown(timeout=0)  # queued first: the loop stops before the snapshot
        task = asyncio.create_task(async_engine.kv_snapshot())
        await asyncio.sleep(0)
        loop = threading.Thread(target=async_engine.run_loop)
        loop.start()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, TIMEOUT)
        loop.join()

    asyncio.run(main())
