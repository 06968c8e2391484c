"""The Ray executor (--distributed-executor-backend ray): ranks 1..N-1 as Ray actors, with the real
Ray. Two ranks give one rank's outputs, in a local cluster the executor starts itself and with
rank 1 on the other node of a two-node cluster (`ray start`, one per module); a killed actor
stops the engine; no actor outlives its engine, however that ends."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.cpu_info import available_cpus
from pagedllm.distributed import tp_group
from tests.conftest import save_tiny_llama

PROMPTS = [[5, 9, 3], [17, 4, 88, 23, 6, 70, 11, 42, 9, 1, 66], list(range(10, 40))]
ENGINE = dict(dtype="float32", kv_cache_memory="8MiB")
RAY = Path(sys.executable).with_name("ray")
WORKER_IP = "127.0.0.2"  # the second node's address: a loopback one of its own
PER_RANK = max(1, available_cpus() // 2)  # the executor's bundles: {"CPU": cores / ranks}


@pytest.fixture(scope="module", autouse=True)
def ray_env():
    """Ray's files under a temporary directory (not /tmp/ray: no other cluster is found there),
    no token file written to the home directory, no usage reports."""
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_TMPDIR", tmp)
        env.setenv("RAY_AUTH_MODE", "disabled")
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(path, seed=5, num_key_value_heads=2)
    return str(path)


def generate(llm):
    sampling = [
        SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.8, n=2, seed=7, max_tokens=8, ignore_eos=True),
    ]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = llm.generate(prompts, [sampling[0]] * 2 + [sampling[1]], use_tqdm=False)
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def expected(checkpoint):
    return generate(LLM(model=checkpoint, **ENGINE))


def assert_same(got, expected):
    for a, b in zip(got, expected, strict=True):
        for (tokens_a, lps_a), (tokens_b, lps_b) in zip(a, b, strict=True):
            assert tokens_a == tokens_b
            for step_a, step_b in zip(lps_a or [], lps_b or [], strict=True):
                assert step_a.keys() == step_b.keys()
                for t in step_a:
                    assert step_a[t].logprob == pytest.approx(step_b[t].logprob, abs=1e-3)


def gone(pids, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{p}").exists() and not _zombie(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_without_ray_installed_the_error_says_what_to_install(checkpoint, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails
    with pytest.raises(ImportError, match=r"pip install pagedllm\[ray\]"):
        LLM(model=checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    assert tp_group().size == 1


@pytest.mark.slow
def test_actors_in_a_local_cluster_give_one_ranks_outputs(checkpoint, expected):
    """No cluster to join: the executor starts one in this process, and stops it."""
    ray = pytest.importorskip("ray")
    threads = torch.get_num_threads()
    llm = LLM(model=checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray",
              **ENGINE)  # fmt: skip
    executor = llm.llm_engine.executor
    try:
        assert type(executor).__name__ == "RayExecutor" and not executor.procs
        (pid,) = executor.pids  # rank 1: a Ray worker process running the actor
        assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::RankActor")
        assert ray.is_initialized() and executor.dead() is None
        assert_same(generate(llm), expected)
        assert_same(generate(llm), expected)  # again, now from the prefix cache
    finally:
        llm.shutdown()
    assert not ray.is_initialized()  # the cluster it started is stopped
    assert gone(executor.pids)
    assert tp_group().size == 1
    assert torch.get_num_threads() == threads


@pytest.fixture(scope="module")
def cluster(ray_env):
    """A head node and a second node (`ray start`, PER_RANK cores each, no dashboard) on this
    host, the second with an address of its own; stopped by killing the process groups their
    `ray start` made (not `ray stop`, which would stop every cluster on the host)."""
    pytest.importorskip("ray")
    from tests.server_process import free_port

    port = free_port()
    common = [f"--num-cpus={PER_RANK}", "--disable-usage-stats"]
    starts = [
        [RAY, "start", "--head", f"--port={port}", f"--temp-dir={ray_env}",
         "--include-dashboard=false", *common],
        [RAY, "start", f"--address=127.0.0.1:{port}", f"--node-ip-address={WORKER_IP}", *common],
    ]  # fmt: skip
    groups = []
    try:
        for args in starts:
            p = subprocess.Popen(args, start_new_session=True, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)  # fmt: skip
            groups.append(p.pid)
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out
        yield f"127.0.0.1:{port}"
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pgid in groups:
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(2 if sig == signal.SIGTERM else 0)


def node_of(ray, ip: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == ip)


@pytest.mark.slow
def test_ranks_spread_over_two_nodes_give_one_ranks_outputs(cluster, checkpoint, expected,
                                                            monkeypatch):  # fmt: skip
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("PAGEDLLM_RAY_PLACEMENT", "STRICT_SPREAD")
    llm = LLM(model=checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray",
              ray_address=cluster, **ENGINE)  # fmt: skip
    executor = llm.llm_engine.executor
    try:
        here = ray.get_runtime_context().get_node_id()
        assert executor.nodes == [node_of(ray, WORKER_IP)] and here not in executor.nodes
        assert_same(generate(llm), expected)
    finally:
        llm.shutdown()
    assert not ray.is_initialized()  # it disconnected; the cluster goes on
    assert gone(executor.pids)


@pytest.mark.slow
def test_a_killed_actor_stops_the_engine(cluster, checkpoint):
    llm = LLM(model=checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray",
              ray_address=cluster, **ENGINE)  # fmt: skip
    executor = llm.llm_engine.executor
    try:
        assert executor.dead() is None
        os.kill(executor.pids[0], signal.SIGKILL)
        start = time.monotonic()
        assert "worker rank 1 exited" in (executor.dead(wait=5.0) or "")
        assert time.monotonic() - start < 5.0
        with pytest.raises(RuntimeError, match="worker rank 1 exited"):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], use_tqdm=False)
    finally:
        llm.shutdown()
    assert tp_group().size == 1


ENGINE_PROCESS = """
import sys, time
from pagedllm import LLM
llm = LLM(model=sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="ray",
          ray_address=sys.argv[2], dtype="float32", kv_cache_memory="8MiB")
print("actor", llm.llm_engine.executor.pids[0], flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_an_actor_does_not_outlive_its_engine_process(cluster, checkpoint, tmp_path):
    """No death watch across nodes as a spawned worker has: the actor goes when the engine's
    process is killed (its group breaks; Ray ends the actors of an owner that is gone)."""
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(ENGINE_PROCESS))
    engine = subprocess.Popen([sys.executable, str(script), checkpoint, cluster],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = engine.stdout.readline()
        assert line.startswith("actor"), line
        pid = int(line.split()[1])
        assert not gone([pid], timeout=0)
        engine.kill()
        engine.wait(10)
        assert gone([pid], timeout=10)
    finally:
        engine.kill()
        engine.wait()
