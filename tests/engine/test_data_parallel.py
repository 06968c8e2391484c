"""Data parallelism behind one server (engine/dp_client.py): the balancer's choices on fake
replicas (load first, then prefix affinity, then in turn; restarting replicas passed over), and
two real engine processes behind the real server: every stream gets the text one engine gives,
both replicas serve, the same prompt returns to the replica that cached it, metrics are
labelled per engine, and a killed replica's requests go on while the other keeps serving."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import os
import signal
import time

import httpx
import pytest

from benchmarks.soak_targets import serve_in_thread
from pagedllm import SamplingParams
from pagedllm.config.kv_events import KVEventsConfig
from pagedllm.engine.dp_client import DataParallelClient, prefix_keys
from pagedllm.engine.llm_engine import LLMEngine
from tests.engine.test_engine_process import tiny_args


class FakeReplica:
    def __init__(self, restarting=False, running=True):
        self.is_restarting, self.is_running = restarting, running


def balancer(*replicas) -> DataParallelClient:
    client = object.__new__(DataParallelClient)
    client.replicas = list(replicas)
    client._load = [0] * len(replicas)
    client._owner, client.routed = {}, [0] * len(replicas)
    client._affinity = collections.OrderedDict()
    client._turn = itertools.count()
    return client


def test_the_least_loaded_replica_is_picked_then_affinity_then_turns():
    client = balancer(FakeReplica(), FakeReplica(), FakeReplica())
    client._load = [2, 1, 1]
    first = client.pick("a shared system prompt, then question one")
    assert first in (1, 2)
    # a tie: the replica that last saw this prompt's prefix, whichever the turn would give
    for _ in range(4):
        assert client.pick("a shared system prompt, then question one") == first
    # load comes first: the affine replica busier than another is passed over
    client._load[first] += 1
    assert client.pick("a shared system prompt, then question one") != first
    # unrelated prompts on a tie go in turn
    client._load = [0, 0, 0]
    picks = {client.pick(f"prompt {i} " + "x" * 40 * i) for i in range(6)}
    assert picks == {0, 1, 2}


def test_restarting_and_dead_replicas_get_nothing_new_while_another_serves():
    client = balancer(FakeReplica(restarting=True), FakeReplica(), FakeReplica(running=False))
    assert {client.pick(f"p{i}") for i in range(5)} == {1}
    assert not client.is_restarting and client.is_running
    client.replicas[1].is_restarting = True
    assert client.is_restarting and client.pick("p") in (0, 1)  # queued at a restarting one


def test_prefix_keys_nest():
    long = "s" * 600
    assert prefix_keys(long + "one")[-3:] == prefix_keys(long + "two")[-3:]  # 32, 128, 512
    assert prefix_keys(long + "one")[0] != prefix_keys(long + "two")[0]
    assert prefix_keys([1, 2, 3]) == prefix_keys({"prompt_token_ids": [1, 2, 3]})


PROMPTS = [f"Request {i}: tell me about the weather in city number {i}" for i in range(16)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    return tiny_args(tmp_path_factory, max_model_len=256)


def _completions(url: str, prompts: list[str]) -> list[str]:
    async def one(http, prompt):
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        r = await http.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http, p) for p in prompts))

    return asyncio.run(main())


def _per_engine(metrics: str, name: str) -> dict[str, float]:
    found = {}
    for line in metrics.splitlines():
        if line.startswith(f"pagedllm:{name}{{"):
            engine = line.split('engine="')[1].split('"')[0]
            found[engine] = float(line.rsplit(" ", 1)[1])
    return found


def test_two_replicas_behind_one_server(args):
    engine = LLMEngine(args)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    expected = {}
    while engine.has_unfinished_requests():
        expected.update({o.request_id: o.outputs[0].text for o in engine.step() if o.finished})
    engine.shutdown()

    client = DataParallelClient(dataclasses.replace(args, data_parallel_size=2))
    try:
        assert len({r.pid for r in client.replicas}) == 2
        with serve_in_thread(client, "m") as url:
            texts = _completions(url, PROMPTS)
            assert texts == [expected[str(i)] for i in range(len(PROMPTS))]
            assert min(client.routed) >= 4  # both replicas took a share of the 16
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
            queries = _per_engine(metrics, "prefix_cache_queries_total")
            assert set(queries) == {"0", "1"} and min(queries.values()) > 0
            assert set(_per_engine(metrics, "num_requests_waiting")) == {"0", "1"}

            # the same long prompt, one request at a time: back to the replica that cached it
            shared = "You are a helpful assistant. " * 8 + "What is paging?"
            before = client.routed.copy()
            hits = _per_engine(metrics, "prefix_cache_hits_total")
            _completions(url, [shared]), _completions(url, [shared]), _completions(url, [shared])
            sent = [a - b for a, b in zip(client.routed, before, strict=True)]
            assert sorted(sent) == [0, 3], sent
            engine_of = str(sent.index(3))
            after = _per_engine(httpx.get(f"{url}/metrics", timeout=30).text,
                                "prefix_cache_hits_total")  # fmt: skip
            assert after[engine_of] > hits[engine_of]

            # replica 1's process killed: requests still complete, /health never says 503
            os.kill(client.replicas[1].pid, signal.SIGKILL)
            texts = _completions(url, PROMPTS[:6])
            assert texts == [expected[str(i)] for i in range(6)]
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            deadline = time.time() + 120
            while client.replicas[1].is_restarting or client.replicas[1].num_restarts == 0:
                assert time.time() < deadline
                time.sleep(0.2)
            assert client.replicas[1].num_restarts == 1
    finally:
        client.shutdown()


def test_external_mode_one_replica_says_its_rank(args):
    """--data-parallel-rank: this server is one replica (a router balances): its metrics and
    its KV event sockets say which, so that replicas of one host do not collide."""
    with pytest.raises(ValueError, match="behind `pagedllm serve`"):
        LLMEngine(dataclasses.replace(args, data_parallel_size=2))
    engine = LLMEngine(dataclasses.replace(args, data_parallel_size=2, data_parallel_rank=1))
    try:
        assert set(engine.engine_stats()) == {"1"}
    finally:
        engine.shutdown()
    config = KVEventsConfig(True, endpoint="tcp://*:5557", replay_endpoint="ipc:///tmp/r")
    assert config.for_rank(0) == config
    assert config.for_rank(3).endpoint == "tcp://*:5560"
    assert config.for_rank(3).replay_endpoint == "ipc:///tmp/r_dp3"
