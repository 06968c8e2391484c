"""examples/ray_serve_app.py under a real local Ray Serve: two replicas of a tiny random Llama
(one CPU and one torch thread each) behind Serve's HTTP proxy, queried with the openai client.
Its greedy completion is the in-process engine's; a chat streams; both replicas answer; and
nothing of Ray's outlives the test."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.utils import free_port
from tests.conftest import save_tiny_llama
from tests.waiting import wait_until

PROMPT = "The quick brown fox jumps over"
TOKENIZER = "SmolLM2-135M-Instruct"
ENGINE = dict(tokenizer=TOKENIZER, dtype="float32", kv_cache_memory="16MiB", max_model_len=512)


def descendants(root: int) -> set[int]:
    """Live processes under `root` (Ray's raylet, GCS, agents and workers are the driver's)."""
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat[0] != "Z":
            children.setdefault(int(stat[1]), []).append(int(pid))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)}


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-serve")
    save_tiny_llama(path, vocab_size=49152, max_position_embeddings=512)
    return str(path)


def test_builder_arguments_are_the_command_lines_engine_flags():
    pytest.importorskip("ray.serve")
    from examples.ray_serve_app import engine_args

    texts = {"model": "m", "max-model-len": "512", "enable_prefix_caching": "false",
             "enforce_eager": "true", "kv_cache_memory": "1GiB", "block_size": 8}  # fmt: skip
    args = engine_args(texts)
    assert (args.model, args.max_model_len, args.block_size) == ("m", 512, 8)
    assert not args.enable_prefix_caching and args.enforce_eager
    assert args.kv_cache_memory == "1GiB"
    with pytest.raises(ValueError, match="max_modle_len"):
        engine_args({"max_modle_len": "512"})
    with pytest.raises(argparse.ArgumentError, match="max-model-len"):
        engine_args({"max_model_len": "lots"})


@pytest.mark.slow
def test_two_replicas_serve_the_openai_api(model, monkeypatch):
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    import httpx
    from openai import OpenAI

    from examples.ray_serve_app import build_app

    llm = LLM(model=model, **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    (expected,) = llm.generate([PROMPT], greedy, use_tqdm=False)
    llm.shutdown()

    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit
    monkeypatch.setenv("RAY_TMPDIR", tmp)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    port = free_port()
    ray_pids: set[int] = set()
    earlier = descendants(os.getpid())  # e.g. a resource tracker an earlier test started
    try:
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = {k: str(v) for k, v in ENGINE.items()}  # as `serve run key=value` gives them
        app = build_app({"model": model, "num_replicas": "2", "num_cpus": "1",
                         "served_model_name": "tiny", **options})  # fmt: skip
        serve.run(app, name="pagedllm", route_prefix="/")
        ray_pids = descendants(os.getpid()) - earlier
        url = f"http://127.0.0.1:{port}"
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

        assert [m.id for m in client.models.list().data] == ["tiny"]
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
        assert out.choices[0].text == expected.outputs[0].text

        messages = [{"role": "user", "content": "Say something."}]
        whole = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0
        )
        chunks = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True
        )
        deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert len([d for d in deltas if d]) > 1  # streamed, not one block
        assert "".join(deltas) == whole.choices[0].message.content

        def replicas() -> dict[int, dict]:
            """Each replica's /replica answer, asking until both answered."""
            seen: dict[int, dict] = {}
            for _ in range(100):
                info = httpx.get(f"{url}/replica", timeout=30).json()
                seen[info["pid"]] = info
                if len(seen) == 2:
                    return seen
            raise AssertionError(f"only these replicas answered: {seen}")

        before = replicas()
        assert all(i["torch_threads"] == 1 for i in before.values())  # its num_cpus
        assert set(before) <= ray_pids  # the replicas are Ray's worker processes
        requests = 8
        with concurrent.futures.ThreadPoolExecutor(requests) as pool:
            list(pool.map(lambda i: client.completions.create(
                model="tiny", prompt=f"{PROMPT} {i}", max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True}), range(requests)))  # fmt: skip
        after = replicas()
        assert set(after) == set(before)
        generated = {p: after[p]["generated_tokens"] - before[p]["generated_tokens"] for p in after}
        assert sum(generated.values()) == requests * 16
        assert all(n > 0 for n in generated.values()), generated  # both engines took requests
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            with contextlib.suppress(AssertionError):  # asserted below, after the clean-up
                wait_until(lambda: not alive(ray_pids), interval=0.2)
            shutil.rmtree(tmp, ignore_errors=True)
    assert not alive(ray_pids), "Ray processes outlived ray.shutdown()"
    assert not descendants(os.getpid()) & ray_pids
