"""--kv-events-config through `pagedllm serve` (the engine in its own process): a subscriber's
replay of the published batches is the prefix cache the server reports, every BlockStored's
hashes follow from its tokens, a prompt's full blocks are published with its tokens, and the
replay socket resends every batch from a number on. And when the engine process is replaced,
the new one says AllBlocksCleared first."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import msgspec
import pytest
import zmq

from pagedllm.bench.utils import free_port
from pagedllm.core.block_hash import hash_block_tokens
from pagedllm.core.kv_events import KVEventBatch
from pagedllm.procs import child_pids
from tests.conftest import save_tiny_llama
from tests.core.test_kv_events import replay
from tests.server_process import start_server

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-kv-events")
    save_tiny_llama(path, vocab_size=49152, max_position_embeddings=512)
    return str(path)


def subscribe(context, address: str, topic: str):
    sub = context.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    sub.connect(address)
    return sub


def receive(sub, until: float) -> list[tuple[int, KVEventBatch]]:
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    got = []
    while sub.poll(max(0, int((until - time.monotonic()) * 1000))):
        _, number, payload = sub.recv_multipart()
        got.append((int.from_bytes(number, "big"), decoder.decode(payload)))
    return got


def is_spawned(pid: int) -> bool:
    """A multiprocessing child (the engine process), not the resource tracker."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return b"spawn_main" in f.read()


def ask_replay(dealer, first: int) -> list[KVEventBatch]:
    """The batches the replay socket resends from number `first` on, up to its end marker."""
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    dealer.send(first.to_bytes(8, "big"))
    batches = []
    while dealer.poll(10_000):
        number, payload = dealer.recv_multipart()
        if not payload:
            return batches
        assert int.from_bytes(number, "big") == first + len(batches)
        batches.append(decoder.decode(payload))
    raise AssertionError("no end marker from the replay socket")


def test_a_subscriber_sees_the_prefix_cache(tiny):
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = {"enable_kv_cache_events": True, "endpoint": pub, "replay_endpoint": rep,
              "topic": "kv"}  # fmt: skip
    proc, url, lines = start_server(
        ["--model", tiny, "--tokenizer", "SmolLM2-135M-Instruct", "--dtype", "float32",
         "--kv-cache-memory", "128KiB", "--block-size", str(BLOCK_SIZE), "--max-model-len", "256",
         "--kv-events-config", json.dumps(config)], timeout=180,
    )  # fmt: skip
    context = zmq.Context()
    try:
        sub = subscribe(context, pub, "kv")
        time.sleep(0.5)  # the subscription reaches the publisher (PUB drops until then)
        shared = "You are a helpful assistant. Answer in one word. " * 3
        prompts = [
            shared + f"Question {i}: what colour is the sky over city number {i}?" * 2
            for i in range(24)
        ]
        with httpx.Client(base_url=url, timeout=120) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            for prompt in prompts:  # one at a time: a 64-block pool evicts as they come
                body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
                assert http.post("/v1/completions", json=body).status_code == 200
            tokens = http.post("/tokenize", json={"model": model, "prompt": prompts[-1]}).json()
            batches = receive(sub, time.monotonic() + 2)
            snapshot = http.get("/debug/kv", params={"check": "true"}).json()
        numbers = [n for n, _ in batches]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # none missed
        cached: set = set()
        for _, batch in batches:
            replay(batch.events, cached)
        kinds = {type(e).__name__ for _, b in batches for e in b.events}
        assert {"BlockStored", "BlockRemoved"} <= kinds  # the small pool evicted
        assert len(cached) == len(snapshot["pool"]["cached"]) > 0
        # A router can name the last prompt's full blocks from its tokens: all are cached.
        ids, parent, hashes = tokens["tokens"], None, []
        for i in range(len(ids) // BLOCK_SIZE):
            parent = hash_block_tokens(parent, ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            hashes.append(parent)
        assert len(hashes) >= 10 and set(hashes) <= cached

        # Replay from the first number on: the same batches again, then the end marker.
        dealer = context.socket(zmq.DEALER)
        dealer.connect(rep)
        assert ask_replay(dealer, numbers[0]) == [b for _, b in batches]

        # A new engine process starts with an empty cache, and says so in its batch 0.
        (engine,) = [pid for pid in child_pids(proc.pid) if is_spawned(pid)]
        os.kill(engine, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.2)
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
        first = ask_replay(dealer, 0)
        assert first and type(first[0].events[0]).__name__ == "AllBlocksCleared"
    finally:
        context.destroy(linger=0)
        proc.terminate()
        proc.wait(30)
