"""The dashboard in a real headless browser: Debian's Chromium, driven by Playwright (its own
browser download is never used), kept off the network, opens /dashboard on a live `pagedllm
serve` of the default model (behind an API key, signed in with HTTP Basic) while requests with
n > 1 share blocks and overflow into the swap space, and must draw them: the shared blocks on
the pool's canvas (checked pixel by pixel), the swap space, and non-empty block tables. The
screenshot is a test artifact (test-artifacts/, or $PAGEDLLM_TEST_ARTIFACTS); the README's
picture is one of them."""

import os
import shutil
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from pagedllm.config import EngineArgs
from pagedllm.engine.arg_utils import create_engine_config
from tests.server_process import start_server

pytestmark = pytest.mark.slow

ARTIFACTS = Path(os.environ.get("PAGEDLLM_TEST_ARTIFACTS", "test-artifacts"))
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# No network but loopback: no background services, and any other address goes to a dead proxy
# and resolves to nothing.
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions", "--metrics-recording-only",
    "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]  # fmt: skip
SYSTEM = (
    "You are a careful assistant for an astronomy club. Answer in full sentences, give numbers "
    "with their units, and say when a fact is uncertain. Keep each answer under two hundred "
    "words. Question: "
)
QUESTIONS = [
    "How far is Mars from the Sun?",
    "Why is Venus hotter than Mercury?",
    "What are Saturn's rings made of?",
    "How long is a day on Jupiter?",
    "What is the Kuiper belt?",
    "Why does the Moon show phases?",
]
N = [4, 1, 3, 1, 2, 1]


def _require(ok: bool, why: str) -> None:
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"{why}: CI runs the browser test (`make test` installs Chromium)")
        pytest.skip(why)


def test_the_dashboard_draws_shared_blocks_and_block_tables_in_chromium():
    _require(os.path.exists(CHROMIUM), "Debian's chromium is not installed")
    sync_api = pytest.importorskip("playwright.sync_api")
    key = "sk-" + uuid.uuid4().hex
    # The same number of blocks whatever the default's KV cache dtype (float32 blocks take twice
    # the bytes of bfloat16 ones): the pool must overflow into swap, but fit each request.
    cache_dtype = create_engine_config(EngineArgs(device="cpu")).cache.cache_dtype
    scale = 2 if cache_dtype == "float32" else 1
    flags = [
        "--max-model-len", "512", "--kv-cache-memory", f"{48 * scale}MiB",
        "--preemption-mode", "swap", "--swap-space", f"{0.012 * scale}", "--api-key", key,
    ]  # fmt: skip
    proc, url, lines = start_server(flags, timeout=180)
    stop = threading.Event()
    errors: list[BaseException] = []

    def run(i: int) -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=120)
        try:
            stream = client.completions.create(
                model="SmolLM2-135M-Instruct", prompt=SYSTEM + QUESTIONS[i], n=N[i],
                max_tokens=400, temperature=0.8, seed=i, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for _ in stream:
                if stop.is_set():
                    stream.close()  # the server aborts the request and frees its blocks
                    return
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(N))]
    http = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {key}"})
    try:
        for t in threads:
            t.start()
        deadline = time.time() + 240  # about 10 s on an idle 2-core machine
        while True:  # the page comes up once requests share blocks and the pool overflowed
            snap = http.get("/debug/kv").json()
            running = [r for r in snap["requests"] if r["status"] == "running"]
            shared = snap["pool"]["counts"]["shared"] and any(r["num_samples"] > 1 for r in running)
            if shared and snap["swap"]["counts"]["used"]:
                break
            assert time.time() < deadline and not errors, (snap["pool"]["counts"], errors)
            time.sleep(0.2)

        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
            context = browser.new_context(
                viewport={"width": 1400, "height": 1000},
                http_credentials={"username": "admin", "password": key},
            )
            page = context.new_page()
            requested, page_errors = [], []
            page.on("request", lambda r: requested.append(r.url))
            page.on("pageerror", lambda e: page_errors.append(str(e)))
            page.on("console", lambda m: m.type == "error" and page_errors.append(m.text))
            page.goto(f"{url}/dashboard")
            page.wait_for_function(
                """() => { const d = window.pagedllmDashboard;
                           return d.updates >= 3 && d.drawn.shared > 0 && d.tableEntries > 0
                                  && d.swapDrawn.used > 0; }""",
                timeout=60_000,
            )
            drawn = page.evaluate(
                """() => { const d = window.pagedllmDashboard, snap = d.snapshot;
                  const canvas = document.getElementById("pool"), l = canvas.layout;
                  const ctx = canvas.getContext("2d"), dpr = window.devicePixelRatio || 1;
                  const pixel = (b, dx, dy) => { const x = (b % l.cols) * l.cell + dx,
                      y = Math.floor(b / l.cols) * l.cell + dy;
                      return Array.from(ctx.getImageData(x * dpr, y * dpr, 1, 1).data); };
                  const shared = snap.pool.ref_cnt.findIndex((c) => c > 1);
                  const free = snap.pool.ref_cnt.findIndex((c, b) => c === 0
                      && !snap.pool.cached.includes(b));
                  return { drawn: d.drawn, counts: snap.pool.counts, cell: l.cell,
                    cols: l.cols, shared,
                    swapDrawn: d.swapDrawn, swapCounts: snap.swap.counts,
                    sharedEdge: pixel(shared, 2, 2), freeMiddle: free < 0 ? null
                      : pixel(free, l.cell / 2, l.cell / 2),
                    sharedChips: document.querySelectorAll(".chip.shared").length,
                    chips: document.querySelectorAll(".chip").length,
                    seqRows: Array.from(document.querySelectorAll("#requests tr")).length,
                    groups: snap.requests.filter((r) => r.num_samples > 1).length,
                    status: document.getElementById("status").textContent }; }"""
            )
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            screenshot = ARTIFACTS / "dashboard.png"
            page.screenshot(path=str(screenshot), full_page=True)
            # Hovering a block names it; hovering a request dims every block but its own.
            box = page.locator("#pool").bounding_box()
            b, cell = drawn["shared"], drawn["cell"]
            page.mouse.move(
                box["x"] + (b % drawn["cols"] + 0.5) * cell,
                box["y"] + (b // drawn["cols"] + 0.5) * cell,
            )
            tooltip = page.locator("#tooltip").text_content()
            page.hover("#requests tr[data-request]")
            highlight = page.evaluate(
                """() => { const d = window.pagedllmDashboard, snap = d.snapshot;
                  const canvas = document.getElementById("pool"), l = canvas.layout;
                  const ctx = canvas.getContext("2d"), dpr = window.devicePixelRatio || 1;
                  const alpha = (b) => ctx.getImageData(((b % l.cols) * l.cell + l.cell / 2) * dpr,
                      (Math.floor(b / l.cols) * l.cell + l.cell / 2) * dpr, 1, 1).data[3];
                  const held = new Set(snap.requests.find((r) => r.request_id === d.highlight).seqs
                      .flatMap((s) => s.swapped ? [] : s.block_tables.flat()));
                  const others = [...Array(snap.pool.num_blocks).keys()]
                      .filter((b) => !held.has(b));
                  return { held: [...held].map(alpha), others: others.map(alpha) }; }"""
            )
            browser.close()
        print(f"dashboard screenshot: {screenshot.resolve()}")

        assert not page_errors, page_errors
        assert requested and all(u.startswith(url + "/") for u in requested), requested
        assert drawn["status"] == "live"
        # Every block drawn, in the state the snapshot gives it.
        assert drawn["drawn"] == drawn["counts"]
        assert drawn["swapDrawn"] == drawn["swapCounts"] and drawn["swapDrawn"]["used"] > 0
        assert drawn["drawn"]["shared"] > 0 and drawn["sharedChips"] > 0
        assert drawn["chips"] > 0 and drawn["groups"] > 0
        assert drawn["seqRows"] >= 4  # a request with n > 1 has a row per sequence
        assert drawn["sharedEdge"][:3] == [0x11, 0x18, 0x27], drawn  # the shared outline
        if drawn["freeMiddle"] is not None:
            assert drawn["freeMiddle"][:3] == [0xE8, 0xEB, 0xEF], drawn
        assert screenshot.stat().st_size > 10_000
        assert f"block {drawn['shared']} " in tooltip and "held by" in tooltip, tooltip
        assert highlight["held"] and all(a == 255 for a in highlight["held"]), highlight
        assert highlight["others"] and all(a < 255 for a in highlight["others"]), highlight
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        try:
            deadline = time.time() + 60
            while True:  # the aborted requests gave every block back
                time.sleep(0.3)
                snap = http.get("/debug/kv", params={"check": "true"}).json()
                if not snap["requests"]:
                    break
                assert time.time() < deadline, snap["requests"]
            assert snap["integrity"]["ok"] and snap["pool"]["counts"]["used"] == 0
            assert snap["swap"]["counts"]["used"] == 0
        finally:
            http.close()
            proc.terminate()
            proc.wait(30)
    assert not errors, errors
