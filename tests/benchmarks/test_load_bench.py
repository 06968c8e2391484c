"""`python -m benchmarks.load` on a tiny random Llama: the virtual-clock driver and a smoke run."""

import json

import pytest

from benchmarks import common, load
from pagedllm.config import EngineArgs
from tests.conftest import save_tiny_llama

pytest.importorskip("transformers")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_load(argv):  # python -m benchmarks.load ...argv
    return common.run(load.add_cli_args, load.main, argv)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-load")
    save_tiny_llama(path)
    return str(path)


class FakeTimer:
    """Every call is `tick` seconds after the previous one: each step measures `tick`."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_poisson_arrivals_are_seeded_and_increasing():
    a = load.poisson_arrivals(200, 4.0, seed=3)
    assert a == load.poisson_arrivals(200, 4.0, seed=3)
    assert all(x < y for x, y in zip(a, a[1:], strict=False))
    assert 3.0 < len(a) / a[-1] < 5.0  # about 4 requests per second
    with pytest.raises(ValueError):
        load.poisson_arrivals(3, 0.0)


def test_virtual_clock_skips_idle_gaps(tiny_path):
    from pagedllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineArgs(dtype="float32", model=tiny_path, kv_cache_memory="1MiB", block_size=4)
    )
    requests = [([5, 9, 3], 4), ([17, 4, 88, 23, 6], 6), ([100], 2)]
    arrivals = [0.0, 1000.0, 5000.0]  # far apart: the engine idles between them
    r = load.drive(engine, requests, arrivals, timer=FakeTimer(0.5), keep_trace=True)
    # Alone, a request of n output tokens takes n steps (the prefill samples the first token),
    # each measured as 0.5 s: the idle gaps never count.
    assert r["finish_times"] == [2.0, 1003.0, 5001.0]
    assert r["normalized_latencies"] == [0.5, 0.5, 0.5]
    assert r["mean_normalized_latency_s"] == 0.5
    assert r["busy_s"] == 6.0 and r["makespan_s"] == 5001.0
    assert r["mean_batched_requests"] == 1.0 and r["max_batched_requests"] == 1
    assert r["num_steps"] == 12 and r["num_finished"] == 3
    assert r["num_output_tokens"] == 12 == r["num_expected_output_tokens"]
    clocks = [t for t, _ in r["trace"]]
    assert clocks == sorted(clocks)
    assert not engine.has_unfinished_requests()


def test_virtual_clock_batches_simultaneous_arrivals(tiny_path):
    from pagedllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineArgs(dtype="float32", model=tiny_path, kv_cache_memory="1MiB", block_size=4)
    )
    requests = [([5, 9, 3], 4), ([17, 4, 88], 4), ([100, 7], 4)]
    r = load.drive(engine, requests, [0.0, 0.0, 0.0], timer=FakeTimer(1.0))
    assert r["num_steps"] == 4 and r["mean_batched_requests"] == 3.0
    assert r["mean_normalized_latency_s"] == 1.0


def test_load_smoke(tiny_path, tmp_path, capsys):
    out_json, png = tmp_path / "load.json", tmp_path / "load.png"
    rc = run_load([
        "--model", tiny_path, "--dtype", "float32", "--max-model-len", "128",
        "--kv-cache-memory", "64KiB", "--max-num-seqs", "6", "--num-prompts", "10",
        "--policies", "paged", "--sharegpt-rates", "20,200", "--alpaca-rates", "100",
        "--sharegpt-scale", "0.1", "--alpaca-scale", "0.5",
        "--output-json", str(out_json), "--plot", str(png),
    ])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "s/token" in printed and "batch" in printed
    result = json.loads(out_json.read_text())
    assert result["engine"]["kv_pool_token_slots"] == 128
    assert result["engine_args"]["enable_prefix_caching"] is False
    runs = result["runs"]
    assert [(r["workload"], r["request_rate"]) for r in runs] == [
        ("sharegpt", 20.0), ("sharegpt", 200.0), ("alpaca", 100.0)
    ]  # fmt: skip
    for r in runs:
        assert r["num_finished"] == r["num_requests"] == 10 and r["num_failed"] == 0
        assert r["num_output_tokens"] == r["num_expected_output_tokens"]
        assert r["mean_normalized_latency_s"] > 0
        assert 1 <= r["mean_batched_requests"] <= r["max_batched_requests"] <= 6
        assert r["makespan_s"] >= r["busy_s"] * (1 - 1e-9) and r["busy_s"] > 0
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_bad_policy_is_refused(tiny_path, capsys):
    rc = run_load(["--model", tiny_path, "--dtype", "float32", "--policies", "paged,best"])
    assert rc == 2
    assert "--policies" in capsys.readouterr().err


def test_max_reservations_batch_fewer_requests_than_paging(tiny_path):
    from pagedllm.bench.workload import sharegpt_like_workload
    from pagedllm.engine.llm_engine import LLMEngine

    # 512 slots: 4 reservations of max_model_len 128, or many short paged requests.
    args = EngineArgs(dtype="float32", model=tiny_path, kv_cache_memory="256KiB", max_model_len=128,
                      max_num_seqs=16, enable_prefix_caching=False)  # fmt: skip
    engine = LLMEngine(args)
    requests = sharegpt_like_workload(16, 128, scale=0.1, seed=1, max_model_len=128)
    runs = {
        # A fixed virtual step time keeps the batching independent of this machine's speed.
        policy: load.run_one(
            engine, policy, "sharegpt", requests, 1000.0, seed=0, timer=FakeTimer(0.01)
        )
        for policy in ("paged", "max", "oracle")
    }
    for r in runs.values():
        assert r["num_finished"] == 16 and r["num_failed"] == 0
        assert r["num_output_tokens"] == r["num_expected_output_tokens"]
        assert abs(sum(r["kv_breakdown"]["shares"].values()) - 1) < 1e-9
    assert runs["max"]["max_batched_requests"] <= 4
    assert runs["max"]["mean_batched_requests"] < runs["oracle"]["mean_batched_requests"]
    assert runs["oracle"]["mean_batched_requests"] < runs["paged"]["mean_batched_requests"]
    assert runs["max"]["num_preemptions"] == 0  # a region never grows
    assert (
        runs["paged"]["kv_breakdown"]["shares"]["internal_fragmentation"]
        < (runs["max"]["kv_breakdown"]["shares"]["internal_fragmentation"])
    )
