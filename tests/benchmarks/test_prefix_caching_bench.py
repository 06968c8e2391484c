"""`benchmarks.prefix_caching`: the shared-prefix workload, the arrivals, the reporting, and
the whole command (caching off, then on) on a tiny random model."""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import pytest

from benchmarks import common, prefix_caching
from benchmarks.prefix_caching import outputs_identical_share
from benchmarks.prefix_workload import (
    poisson_arrivals,
    shared_prefix_workload,
    short_length_distribution,
)
from pagedllm.config import EngineArgs

VOCAB = 1000
SPECIAL = range(17)


def _parse(argv):
    parser = argparse.ArgumentParser()
    prefix_caching.add_cli_args(parser)
    return parser.parse_args(argv)


def test_cli_defaults_and_registration():
    ns = _parse([])
    assert (ns.num_prompts, ns.prefix_len, ns.suffix_len, ns.output_len) == (64, 341, 25.0, 25.0)
    assert math.isinf(ns.request_rate) and ns.workload_seed == 0 and ns.output_json is None
    ns = common.build_parser(prefix_caching.add_cli_args).parse_args(
        [
            "--prefix-len",
            "80",
            "--request-rate",
            "4",
            "--block-size",
            "8",
        ]
    )
    assert (ns.prefix_len, ns.request_rate, ns.block_size) == (80, 4.0, 8)


def test_workload_is_seeded_and_shares_exactly_the_prefix():
    a = shared_prefix_workload(40, VOCAB, exclude_ids=SPECIAL, prefix_len=80, seed=3)
    b = shared_prefix_workload(40, VOCAB, exclude_ids=SPECIAL, prefix_len=80, seed=3)
    c = shared_prefix_workload(40, VOCAB, exclude_ids=SPECIAL, prefix_len=80, seed=4)
    assert a == b and a != c
    assert len(a.prefix) == 80 and len(a.requests) == 40
    for prompt, _ in a.requests:
        assert prompt[:80] == a.prefix
        assert all(17 <= t < VOCAB for t in prompt)
    suffixes = [tuple(p[80:]) for p, _ in a.requests]
    assert len(set(suffixes)) == len(suffixes)  # distinct suffixes
    assert all(len(s) >= 1 for s in suffixes)
    # The suffix that follows the prefix differs right away in most requests (random tokens).
    assert len({s[0] for s in suffixes}) > 30
    assert a.arrival_offsets == [0.0] * 40  # infinite rate: all at once


def test_lengths_as_requested():
    w = shared_prefix_workload(4000, VOCAB, prefix_len=5, suffix_len=25, output_len=12, seed=0)
    suffix, output = np.array(w.suffix_lens), np.array(w.output_lens)
    assert suffix.mean() == pytest.approx(25, rel=0.05)
    assert output.mean() == pytest.approx(12, rel=0.05)
    assert suffix.min() >= 6 and suffix.max() <= 100  # [mean/4, 4*mean]
    assert output.min() >= 3 and output.max() <= 48
    assert suffix.std() > 3  # a real spread, not one fixed length
    # Lengths do not depend on the vocabulary, the prefix length or the rate.
    other = shared_prefix_workload(
        4000, 50000, prefix_len=90, suffix_len=25, output_len=12, request_rate=2.0, seed=0
    )
    assert other.suffix_lens == w.suffix_lens and other.output_lens == w.output_lens


def test_workload_fits_the_context_and_rejects_what_cannot():
    w = shared_prefix_workload(50, VOCAB, prefix_len=60, suffix_len=25, output_len=25,
                               max_model_len=80)  # fmt: skip
    for prompt, n in w.requests:
        assert len(prompt) < 80 and len(prompt) + n <= 80 and n >= 1
    with pytest.raises(ValueError, match="prefix"):
        shared_prefix_workload(4, VOCAB, prefix_len=79, max_model_len=80)
    with pytest.raises(ValueError, match="distinct suffixes"):
        shared_prefix_workload(20, 3, prefix_len=4, suffix_len=1, output_len=1)


def test_short_length_distribution_and_expected_hits():
    d = short_length_distribution(25)
    assert (d.min_len, d.max_len, d.mean) == (6, 100, 25)
    assert short_length_distribution(1).min_len == 1
    with pytest.raises(ValueError):
        short_length_distribution(0.5)
    w = shared_prefix_workload(5, VOCAB, prefix_len=21, suffix_len=4, output_len=2)
    assert w.expected_hit_tokens(4) == 4 * 20  # 5 full prefix blocks for each of 4 followers
    assert w.expected_hit_tokens(16) == 4 * 16
    assert w.expected_hit_tokens(32) == 0


def test_poisson_arrivals():
    rng = np.random.default_rng(0)
    offsets = poisson_arrivals(rng, 5000, rate=4.0)
    assert offsets[0] == 0.0 and all(np.diff(offsets) >= 0)
    assert np.diff(offsets).mean() == pytest.approx(0.25, rel=0.05)
    assert poisson_arrivals(rng, 3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(rng, 3, 0.0)


def test_reporting():
    assert outputs_identical_share([[1, 2], [3], [4]], [[1, 2], [3], [5]]) == pytest.approx(2 / 3)
    run = dict(requests_per_s=1.0, output_tokens_per_s=20.0, total_tokens_per_s=300.0,
               mean_ttft_s=4.0, median_ttft_s=3.0, mean_latency_s=6.0, elapsed_s=10.0,
               prefix_cache={"hit_rate": 0.0})  # fmt: skip
    on = {**run, "requests_per_s": 3.0, "output_tokens_per_s": 60.0, "mean_ttft_s": 1.0,
          "median_ttft_s": 1.5, "mean_latency_s": 2.0,
          "prefix_cache": {"hit_rate": 0.8}}  # fmt: skip
    ratios = prefix_caching.compare(run, on)
    assert ratios["throughput_on_over_off"] == pytest.approx(3.0)
    assert ratios["mean_ttft_off_over_on"] == pytest.approx(4.0)
    assert ratios["median_ttft_off_over_on"] == pytest.approx(2.0)
    table = prefix_caching.format_table(run, on, ratios)
    assert "3.00x" in table and "4.00x lower" in table and "80.0%" in table
    note = prefix_caching.paper_note(341, 3.0)
    assert "3.00x" in note and "1.67x" in note and "3.58x" in note and "A100" in note


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.conftest import save_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama-prefix-bench")
    save_tiny_llama(path)
    return str(path)


def test_whole_benchmark_on_a_tiny_model(tiny_model, tmp_path, capsys):
    out = tmp_path / "bench.json"
    ns = _parse(["--num-prompts", "6", "--prefix-len", "21", "--suffix-len", "5",
                 "--output-len", "4", "--output-json", str(out)])  # fmt: skip
    # --enable-prefix-caching=False must not leak into the ON run.
    engine_args = EngineArgs(model=tiny_model, kv_cache_memory="8MiB", block_size=4,
                             enable_prefix_caching=False)  # fmt: skip
    assert prefix_caching.main(ns, engine_args) == 0
    printed = capsys.readouterr().out
    assert "caching off" in printed and "caching on" in printed and "3.58x" in printed
    results = json.loads(out.read_text())

    w = results["workload"]
    assert w["prefix_len"] == 21 and w["num_prompts"] == 6
    prompt_tokens = w["num_prompt_tokens"]
    assert prompt_tokens == 6 * 21 + sum(w["suffix_lens"])
    # Each of the 5 followers can reuse the prefix's 5 full blocks of 4 tokens.
    assert w["expected_hit_tokens"] == 5 * 20
    off, on = results["off"], results["on"]
    assert off["prefix_cache"]["enabled"] is False and on["prefix_cache"]["enabled"] is True
    assert off["prefix_cache"]["hit_tokens"] == 0 and off["prefix_cache"]["hit_rate"] == 0
    # Queries are this run's prompts only: the warm-up is neither counted nor cached.
    assert on["prefix_cache"]["queried_tokens"] == prompt_tokens
    assert on["prefix_cache"]["hit_tokens"] == 5 * 20
    assert on["prefix_cache"]["hit_rate"] == pytest.approx(w["expected_hit_rate"])
    for run in (off, on):
        assert run["num_useful_output_tokens"] == run["num_output_tokens"] == sum(w["output_lens"])
        assert run["num_requests"] == 6 and run["num_preemptions"] == 0
        assert len(run["ttft_s"]) == 6
        assert 0 < run["mean_ttft_s"] <= run["mean_latency_s"]
        assert run["requests_per_s"] > 0 and run["output_tokens_per_s"] > 0
        assert "others_cpu_share" in run
    assert results["outputs_identical_share"] == 1.0
    assert results["greedy_token_agreement"] == 1.0
    ratios = results["ratios"]
    assert ratios["throughput_on_over_off"] == pytest.approx(
        on["requests_per_s"] / off["requests_per_s"]
    )
    assert ratios["mean_ttft_off_over_on"] == pytest.approx(off["mean_ttft_s"] / on["mean_ttft_s"])
    assert [f["throughput_ratio"] for f in results["paper"]["figures"]] == [1.67, 3.58]
    assert "enable_prefix_caching" not in results["engine_args"]


def test_finite_rate_adds_requests_at_their_arrival(tiny_model):
    from pagedllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=tiny_model, kv_cache_memory="8MiB", block_size=4))
    w = shared_prefix_workload(5, 128, prefix_len=12, suffix_len=3, output_len=3,
                               request_rate=40.0, seed=1)  # fmt: skip
    added = []  # (request id, wall time when added, arrival_time given)
    add_request = engine.add_request

    def recording_add_request(request_id, prompt, params, arrival_time=None):
        added.append((request_id, time.time(), arrival_time))
        return add_request(request_id, prompt, params, arrival_time=arrival_time)

    engine.add_request = recording_add_request
    run = prefix_caching.run_engine(engine, w)
    timed = [a for a in added if a[0] != "bench-warm-up"]
    assert [a[0] for a in timed] == [f"bench-{i}" for i in range(5)]
    # Each request is added once its arrival has passed, with the arrival as its arrival_time,
    # and arrivals are spaced as drawn.
    assert all(at >= arrival for _, at, arrival in timed)
    gaps = np.diff([arrival for _, _, arrival in timed])
    assert gaps == pytest.approx(np.diff(w.arrival_offsets), abs=1e-6)  # wall-clock floats
    assert run["elapsed_s"] >= w.arrival_offsets[-1] > 0
    assert all(t > 0 for t in run["ttft_s"])
    assert run["prefix_cache"]["hit_tokens"] == w.expected_hit_tokens(4) == 4 * 12
