"""`benchmarks.preemption`: the pool arithmetic, the recovery measurement (swap round trips
and recompute on the runner), and both parts of the command on a tiny random model."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from benchmarks import common, preemption, preemption_pool
from benchmarks.preemption_pool import (
    compare_outputs,
    fitting_max_model_len,
    format_throughput_table,
    pool_blocks,
    pool_demand,
    request_blocks,
)
from benchmarks.preemption_recovery import measure_recovery
from pagedllm.config import EngineArgs


def _parse(argv):
    parser = argparse.ArgumentParser()
    preemption.add_cli_args(parser)
    return parser.parse_args(argv)


# -- CLI ----------------------------------------------------------------------------------------
def test_cli_defaults_and_registration():
    ns = _parse([])
    assert ns.part == "all" and ns.block_sizes == [1, 2, 4, 8, 16, 32, 64, 128]
    assert ns.context_lens == [256, 1024] and ns.repeats == 5 and ns.swap_repeats == 20
    assert ns.num_prompts == 32 and ns.scale == 0.25 and ns.workload_seed == 0
    assert ns.pool_fractions == [1.0, 0.5, 0.25, 0.1] and ns.modes == ["recompute", "swap"]
    ns = common.build_parser(preemption.add_cli_args).parse_args(
        ["--part", "recovery", "--block-sizes", "1,4", "--context-len",
         "32", "--modes", "swap", "--pool-fractions", "1,0.3", "--block-size", "8"]
    )  # fmt: skip
    assert ns.part == "recovery" and ns.block_sizes == [1, 4] and ns.context_lens == [32]
    assert ns.modes == ["swap"] and ns.pool_fractions == [1.0, 0.3] and ns.block_size == 8
    for bad in (["--block-sizes", "0"], ["--pool-fractions", "0"], ["--pool-fractions", "1.5"],
                ["--modes", "evict"], ["--part", "both"], ["--context-len", "x"]):  # fmt: skip
        with pytest.raises(SystemExit):
            _parse(bad)


# -- arithmetic ---------------------------------------------------------------------------------
def test_request_blocks_count_every_written_token_but_the_last_sampled():
    # prompt + output - 1 tokens have K/V written: the last sampled token is never fed back.
    assert request_blocks(16, 1, 16) == 1
    assert request_blocks(16, 2, 16) == 2
    assert request_blocks(15, 2, 16) == 1
    assert request_blocks(1, 1, 4) == 1
    assert request_blocks(10, 7, 1) == 16


def test_pool_demand_and_max_model_len():
    requests = [([5] * 10, 7), ([5] * 3, 1), ([5] * 30, 20)]
    # cdiv(16, 4) + cdiv(3, 4) + cdiv(49, 4)
    assert pool_demand(requests, 4) == 4 + 1 + 13
    assert pool_demand(requests, 16) == 1 + 1 + 4
    # The longest request (50 tokens) rounded up to a whole block, within the model's limit.
    assert fitting_max_model_len(requests, 16) == 64
    assert fitting_max_model_len(requests, 4) == 52
    assert fitting_max_model_len(requests, 16, limit=60) == 60
    assert fitting_max_model_len(requests, 16, limit=50) == 50


def test_pool_blocks_rounds_half_up_and_clamps_to_one_request():
    assert pool_blocks(1.0, 100, 10) == (100, False)
    assert pool_blocks(0.5, 100, 10) == (50, False)
    assert pool_blocks(0.25, 10, 1) == (3, False)  # 2.5 -> 3
    assert pool_blocks(0.1, 30, 1) == (3, False)  # 3.0000000000000004 -> 3
    assert pool_blocks(0.1, 100, 16) == (16, True)
    assert pool_blocks(0.1, 100, 10) == (10, False)  # exactly one request: not raised
    assert pool_blocks(0.001, 100, 1) == (1, False)


def test_compare_outputs_finds_mismatches():
    ref = [[1, 2, 3], [4, 5], [6]]
    same = compare_outputs(ref, [[1, 2, 3], [4, 5], [6]])
    assert same["outputs_identical"] and same["num_mismatched_requests"] == 0
    assert same["token_agreement"] == 1.0
    diff = compare_outputs(ref, [[1, 2, 3], [4, 9], [6]])
    assert not diff["outputs_identical"] and diff["mismatched_requests"] == [1]
    assert diff["token_agreement"] == pytest.approx(5 / 6)


def test_throughput_table_marks_clamped_pools_and_mismatches():
    def run(mode, fraction, identical=True, clamped=False):
        return {
            "mode": mode, "pool_fraction": fraction, "num_blocks": 10,
            "clamped_to_one_request": clamped, "output_tokens_per_s": 100.0,
            "requests_per_s": 1.0, "elapsed_s": 2.0, "num_preemptions": 3,
            "num_swap_preemptions": 2, "num_swapped_out_blocks": 7, "num_swapped_in_blocks": 7,
            "output_tokens_per_s_vs_full": 0.5, "outputs_identical": identical,
        }  # fmt: skip

    table = format_throughput_table([run("swap", 1.0), run("swap", 0.1, False, True)])
    assert "DIFFER" in table and "identical" in table and "10%*" in table
    assert "raised to one request" in table and "7/7" in table and "0.50x" in table


# -- runs on a tiny model -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.conftest import save_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama-preemption-bench")
    save_tiny_llama(path)
    return str(path)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from pagedllm.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineArgs(dtype="float32", model=tiny_model, max_model_len=16, num_gpu_blocks_override=1)
    )


def _measure(engine, block_size, context_len=32, **kwargs):
    return measure_recovery(
        engine.executor.driver_worker.model, engine.model_config, engine.device, engine.dtype,
        block_size, context_len,
        vocab=np.arange(3, 128), repeats=2, swap_repeats=3, **kwargs,
    )  # fmt: skip


def test_recovery_point_on_a_tiny_model(engine):
    for block_size in (1, 4, 16):
        p = _measure(engine, block_size)
        n = -(-32 // block_size)
        assert p["num_blocks"] == n and p["num_swapped_blocks"] == [n, n]
        assert p["swap_round_trip_exact"] and p["recompute_deterministic"]
        for key in ("swap_out_ms", "swap_in_ms", "swap_ms", "recompute_ms"):
            assert p[key] > 0, key
        assert p["swap_ms"] == pytest.approx(sorted(p["swap_ms_all"])[1])
        assert len(p["swap_ms_all"]) == 3 and len(p["recompute_ms_all"]) == 2
        # 2 layers x K/V x block_size x 2 kv heads x head_dim 16 x 4 bytes
        assert p["bytes_per_block"] == 2 * 2 * block_size * 2 * 16 * 4
        assert p["recompute_over_swap"] == pytest.approx(p["recompute_ms"] / p["swap_ms"])


def test_recovery_round_trip_check_catches_a_lost_swap_in(engine, monkeypatch):
    from pagedllm.worker.kv_cache import KVCache

    real = KVCache.swap

    def drop_swap_in(self, swap_out, swap_in):
        real(self, swap_out, [])

    monkeypatch.setattr(KVCache, "swap", drop_swap_in)
    assert not _measure(engine, 4)["swap_round_trip_exact"]


def test_recovery_part_on_a_tiny_model(tiny_model, tmp_path, capsys):
    out = tmp_path / "recovery.json"
    ns = _parse(["--part", "recovery", "--block-sizes", "1,4,16", "--context-lens", "32,48",
                 "--repeats", "2", "--swap-repeats", "3", "--output-json", str(out)])  # fmt: skip
    assert preemption.main(ns, EngineArgs(dtype="float32", model=tiny_model)) == 0
    printed = capsys.readouterr().out
    assert "RAM-to-RAM" in printed and "recompute / swap" in printed and "Fig. 19" in printed
    results = json.loads(out.read_text())
    assert results["parts"] == ["recovery"] and "throughput" not in results
    rec = results["recovery"]
    assert rec["device"] == "cpu" and rec["dtype"] == "float32"
    assert [(p["context_len"], p["block_size"]) for p in rec["points"]] == [
        (c, b) for c in (32, 48) for b in (1, 4, 16)
    ]
    for p in rec["points"]:
        assert p["swap_ms"] > 0 and p["recompute_ms"] > 0 and p["swap_round_trip_exact"]
    s = rec["summary"]["48"]
    assert sorted(s["swap_cheaper_at"] + s["recompute_cheaper_at"]) == [1, 4, 16]


def test_recovery_refuses_a_context_beyond_the_model(tiny_model):
    ns = _parse(["--part", "recovery", "--context-lens", "300"])
    with pytest.raises(ValueError, match="context length 256"):
        preemption.main(ns, EngineArgs(dtype="float32", model=tiny_model))


def _throughput_ns(out, *extra):
    # 8 requests of 4-74 prompt and 14-74 output tokens: at block size 4, a demand of 108 blocks.
    return _parse(["--part", "throughput", "--num-prompts", "8", "--scale", "0.1",
                   "--output-json", str(out), *extra])  # fmt: skip


def test_throughput_part_on_a_tiny_model(tiny_model, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    # --num-gpu-blocks-override is the benchmark's own: ignored, with a note.
    args = EngineArgs(dtype="float32", model=tiny_model, block_size=4, num_gpu_blocks_override=3)
    assert preemption.main(_throughput_ns(out, "--pool-fractions", "0.25"), args) == 0
    captured = capsys.readouterr()
    assert "--num-gpu-blocks-override" in captured.err
    assert "greedy outputs: identical in every run" in captured.out
    results = json.loads(out.read_text())
    tp = results["throughput"]
    w = tp["workload"]
    lens = list(zip(w["input_lens"], w["output_lens"], strict=True))
    assert tp["demand_blocks"] == sum(-(-(p + n - 1) // 4) for p, n in lens) == 108
    assert tp["max_model_len"] == -(-max(p + n for p, n in lens) // 4) * 4 == 96
    assert tp["all_outputs_identical"] and tp["full_pool_outputs_agree_across_modes"]
    # 100% always runs first, as the reference of its mode.
    assert [(r["mode"], r["pool_fraction"]) for r in tp["runs"]] == [
        ("recompute", 1.0), ("recompute", 0.25), ("swap", 1.0), ("swap", 0.25)
    ]  # fmt: skip
    for r in tp["runs"]:
        assert r["outputs_identical"] and r["num_useful_output_tokens"] == sum(w["output_lens"])
        expected, _ = pool_blocks(r["pool_fraction"], tp["demand_blocks"], tp["min_blocks"])
        assert r["num_blocks"] == expected
        assert r["num_cpu_blocks"] == (r["num_blocks"] if r["mode"] == "swap" else 0)
        if r["pool_fraction"] == 1.0:
            assert r["num_preemptions"] == 0 and r["output_tokens_per_s_vs_full"] == 1.0
            assert r["max_num_running"] == 8
        else:
            assert r["num_preemptions"] > 0 and r["max_num_running"] < 8
            assert r["output_tokens_per_s_vs_full"] > 0
    rec_small, swap_small = tp["runs"][1], tp["runs"][3]
    assert rec_small["num_swap_preemptions"] == 0 and rec_small["num_swapped_out_blocks"] == 0
    assert swap_small["num_swap_preemptions"] > 0
    # Every block swapped out came back in: no request finishes while swapped out.
    assert swap_small["num_swapped_out_blocks"] == swap_small["num_swapped_in_blocks"] > 0


def test_throughput_part_reports_a_mismatch(tiny_model, tmp_path, monkeypatch, capsys):
    real = preemption_pool.run_pool

    def corrupt_small_pools(engine, requests):
        run = real(engine, requests)
        if engine.num_blocks < preemption_pool.pool_demand(requests, engine.block_size):
            run["token_ids"][0] = [t + 1 for t in run["token_ids"][0]]
        return run

    monkeypatch.setattr(preemption_pool, "run_pool", corrupt_small_pools)
    out = tmp_path / "mismatch.json"
    # 10% of 108 blocks is below one request of max_model_len 96 (24 blocks): raised to it.
    ns = _throughput_ns(out, "--modes", "swap", "--pool-fractions", "0.1")
    assert preemption.main(ns, EngineArgs(dtype="float32", model=tiny_model, block_size=4)) == 1
    printed = capsys.readouterr().out
    assert "DIFFER from the 100% run" in printed and "NOT identical" in printed
    assert "the pool is raised to 24 blocks" in printed and "10%*" in printed
    runs = json.loads(out.read_text())["throughput"]["runs"]
    assert [r["outputs_identical"] for r in runs] == [True, False]
    assert runs[1]["mismatched_requests"] == [0]
    assert runs[1]["clamped_to_one_request"] and runs[1]["num_blocks"] == 24
    assert runs[1]["num_swap_preemptions"] > 0
