"""`benchmarks.sharing`: the memory-saving arithmetic, the Alpaca-shaped workload, and runs of
parallel sampling and beam search on a tiny random model."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from benchmarks import common, sharing
from benchmarks.sharing import SharingTracker, format_table, run_sharing
from pagedllm.bench.workload import (
    ALPACA_MEAN_INPUT_LEN,
    ALPACA_MEAN_OUTPUT_LEN,
    MIN_LEN,
    alpaca_length_distributions,
    alpaca_like_workload,
    sharegpt_like_workload,
    workload_from_tokenizer,
)
from pagedllm.config import EngineArgs

VOCAB = 1000
SPECIAL = range(17)


def _parse(argv):
    parser = argparse.ArgumentParser()
    sharing.add_cli_args(parser)
    return parser.parse_args(argv)


# -- CLI ----------------------------------------------------------------------------------------
def test_cli_defaults_and_registration():
    ns = _parse([])
    assert ns.num_prompts == 16 and ns.scale == 0.25 and ns.workload_seed == 0
    assert ns.workloads == ["alpaca", "sharegpt"]
    assert ns.parallel_n == [2, 4, 6] and ns.beam_widths == [2, 4, 6]
    ns = common.build_parser(sharing.add_cli_args).parse_args(
        ["--workloads", "alpaca", "--parallel-n", "3", "--beam-widths", "",
         "--block-size", "8"]
    )  # fmt: skip
    assert ns.workloads == ["alpaca"] and ns.parallel_n == [3] and ns.beam_widths == []
    assert ns.block_size == 8
    for bad in (["--parallel-n", "2,x"], ["--beam-widths", "0"], ["--workloads", "wmt"]):
        with pytest.raises(SystemExit):
            _parse(bad)


# -- the arithmetic -----------------------------------------------------------------------------
def test_tracker_time_average_mean_and_peak():
    t = SharingTracker()
    t.observe(0, 0)  # nothing held: not a sample
    t.observe(5, 10)  # saves 50%
    t.observe(9, 12)  # saves 25%, the peak of physical blocks
    t.observe(3, 3)  # saves nothing
    assert t.num_steps == 3
    assert t.saving == pytest.approx(1 - 17 / 25)  # sum physical / sum logical
    assert t.mean_step_saving == pytest.approx((0.5 + 0.25 + 0.0) / 3)
    assert t.saving_at_peak == pytest.approx(0.25)
    assert t.max_step_saving == pytest.approx(0.5)
    d = t.as_dict()
    assert d["peak_physical_blocks"] == 9 and d["logical_blocks_at_peak"] == 12
    assert d["sum_physical_blocks"] == 17 and d["sum_logical_blocks"] == 25
    assert SharingTracker().saving == 0.0 and SharingTracker().saving_at_peak == 0.0


def test_table_shows_paper_ranges_and_sanity_rows():
    runs = [
        {"workload": "alpaca", "mode": "sampling", "n": 1, "saving": 0.0,
         "mean_step_saving": 0.0, "saving_at_peak": 0.0},
        {"workload": "sharegpt", "mode": "beam", "n": 4, "saving": 0.5,
         "mean_step_saving": 0.45, "saving_at_peak": 0.4},
    ]  # fmt: skip
    table = format_table(runs)
    assert "(sanity: 0)" in table and "44.3-66.3%" in table and "50.0%" in table
    assert "beam search" in table and "parallel sampling" in table


# -- the Alpaca-shaped workload -----------------------------------------------------------------
def test_alpaca_workload_means_spread_and_bounds():
    workload = alpaca_like_workload(20000, VOCAB, exclude_ids=SPECIAL, seed=0)
    inp = np.array([len(p) for p, _ in workload])
    out = np.array([n for _, n in workload])
    assert inp.mean() == pytest.approx(ALPACA_MEAN_INPUT_LEN, rel=0.05)
    assert out.mean() == pytest.approx(ALPACA_MEAN_OUTPUT_LEN, rel=0.05)
    assert inp.min() >= MIN_LEN and out.min() >= MIN_LEN
    assert inp.max() <= 256 and out.max() <= 512
    # Log-normal: outputs are long-tailed, prompts narrower.
    assert np.median(out) < 0.85 * out.mean() and np.percentile(out, 99) > 3 * out.mean()
    assert np.percentile(inp, 95) < 2.5 * inp.mean()
    ids = np.concatenate([np.array(p) for p, _ in workload[:200]])
    assert ids.min() >= 17 and ids.max() < VOCAB


def test_alpaca_workload_is_seeded():
    a = alpaca_like_workload(50, VOCAB, exclude_ids=SPECIAL, seed=3)
    b = alpaca_like_workload(50, VOCAB, exclude_ids=SPECIAL, seed=3)
    c = alpaca_like_workload(50, VOCAB, exclude_ids=SPECIAL, seed=4)
    assert a == b and a != c
    # Shorter than the ShareGPT shape at its benchmark scale, and different lengths.
    s = sharegpt_like_workload(50, VOCAB, exclude_ids=SPECIAL, seed=3)
    assert [len(p) for p, _ in a] != [len(p) for p, _ in s]


def test_workload_from_tokenizer_shapes():
    class Tok:
        vocab_size = VOCAB
        all_special_ids = list(SPECIAL)

    alpaca = workload_from_tokenizer(40, Tok(), shape="alpaca", seed=1)
    assert alpaca == alpaca_like_workload(40, VOCAB, exclude_ids=SPECIAL, seed=1)
    # The ShareGPT default is unchanged: scale 0.25.
    sharegpt = workload_from_tokenizer(40, Tok(), seed=1)
    assert sharegpt == sharegpt_like_workload(40, VOCAB, exclude_ids=SPECIAL, scale=0.25, seed=1)
    fitted = workload_from_tokenizer(200, Tok(), shape="alpaca", seed=1, max_model_len=64)
    assert all(len(p) + n <= 64 for p, n in fitted)
    with pytest.raises(ValueError, match="shape"):
        workload_from_tokenizer(4, Tok(), shape="wmt")
    lo, hi = alpaca_length_distributions(scale=0.5)
    assert lo.mean == pytest.approx(ALPACA_MEAN_INPUT_LEN / 2) and hi.max_len == 256


# -- runs on a tiny model -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.conftest import save_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama-sharing-bench")
    save_tiny_llama(path)
    return str(path)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from pagedllm.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineArgs(model=tiny_model, kv_cache_memory="8MiB", block_size=4,
                   enable_prefix_caching=False)
    )  # fmt: skip


def _expected_sampling_saving(n: int) -> float:
    """A 20-token prompt (5 full blocks of 4) and 8 output tokens, per step after scheduling:
    step 1 prefills the prompt (5 blocks, one sequence); steps 2-8 each write one token per
    sample (tokens 21-27): 6 blocks per sample for tokens 21-24, 7 for 25-27, and only the
    prompt's 5 blocks are shared."""
    logical = 5 + n * (4 * 6 + 3 * 7)
    physical = 5 + 4 * (5 + n) + 3 * (5 + 2 * n)
    return 1 - physical / logical


def test_sampling_saves_nothing_for_one_sample_and_more_with_more(engine):
    requests = [(list(range(20, 40)), 8)]
    savings = {}
    for n in (1, 2, 4, 6):
        run = run_sharing(engine, requests, "sampling", n, seed=0)
        savings[n] = run["saving"]
        assert run["saving"] == pytest.approx(_expected_sampling_saving(n))
        assert run["num_steps"] == 8 and run["num_output_tokens"] == 8 * n
        assert run["num_copied_blocks"] == 0  # the prompt ends on a block boundary
        engine.scheduler.check_integrity()
        assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.num_blocks
    assert savings[1] == 0.0
    assert 0 < savings[2] < savings[4] < savings[6]


def test_partial_last_prompt_block_is_copied_not_shared(engine):
    # 22 tokens: 5 full blocks shared, the 6th (2 tokens) copied on write by all but one sample.
    run = run_sharing(engine, [(list(range(20, 42)), 6)], "sampling", 3)
    assert run["num_copied_blocks"] == 2
    assert run["saving"] > 0 and run["mean_step_saving"] > 0


def test_beam_search_shares_more_than_sampling(engine):
    requests = [(list(range(30, 50)), 12), (list(range(60, 66)), 9)]
    beam = {w: run_sharing(engine, requests, "beam", w) for w in (1, 2, 4)}
    sampled = run_sharing(engine, requests, "sampling", 4)
    assert beam[1]["saving"] == 0.0
    assert 0 < beam[2]["saving"] < beam[4]["saving"]
    assert beam[4]["saving"] > sampled["saving"]
    # Every beam runs to the request's length (ignore_eos): width x output tokens come back.
    assert beam[4]["num_output_tokens"] == 4 * (12 + 9)
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_run_refuses_prefix_caching(tiny_model):
    from pagedllm.engine.llm_engine import LLMEngine

    cached = LLMEngine(EngineArgs(model=tiny_model, kv_cache_memory="8MiB", block_size=4))
    with pytest.raises(ValueError, match="prefix caching off"):
        run_sharing(cached, [([1, 2, 3], 2)], "sampling", 2)


def test_whole_benchmark_on_a_tiny_model(tiny_model, tmp_path, capsys):
    out = tmp_path / "sharing.json"
    ns = _parse(["--num-prompts", "3", "--parallel-n", "2,3", "--beam-widths", "2",
                 "--output-json", str(out)])  # fmt: skip
    # Prefix caching is forced off whatever the flags say.
    engine_args = EngineArgs(model=tiny_model, kv_cache_memory="8MiB", block_size=4,
                             enable_prefix_caching=True)  # fmt: skip
    assert sharing.main(ns, engine_args) == 0
    printed = capsys.readouterr().out
    assert "prefix caching off (forced)" in printed
    assert "sanity: n=1 shares nothing, so it must save 0: alpaca 0.00%, sharegpt 0.00%" in printed
    assert "6.1-9.8%" in printed and "16.2-30.5%" in printed and "37.6-55.2%" in printed
    results = json.loads(out.read_text())
    assert results["engine_args"]["enable_prefix_caching"] is False
    assert results["sanity_n1_saving"] == {"alpaca": 0.0, "sharegpt": 0.0}
    assert set(results["workloads"]) == {"alpaca", "sharegpt"}
    assert results["workloads"]["sharegpt"]["scale"] == 0.25
    assert results["workloads"]["alpaca"]["scale"] == 1.0
    for w in results["workloads"].values():
        assert w["num_prompts"] == 3 and len(w["input_lens"]) == len(w["output_lens"]) == 3
    runs = results["runs"]
    assert [(r["workload"], r["mode"], r["n"]) for r in runs] == [
        (w, m, n)
        for w in ("alpaca", "sharegpt")
        for m, n in (("sampling", 1), ("sampling", 2), ("sampling", 3), ("beam", 2))
    ]
    for r in runs:
        for key in ("saving", "mean_step_saving", "saving_at_peak", "num_steps",
                    "sum_physical_blocks", "sum_logical_blocks", "peak_physical_blocks",
                    "logical_blocks_at_peak", "num_copied_blocks", "num_preemptions",
                    "num_output_tokens", "elapsed_s"):  # fmt: skip
            assert key in r, key
        output_lens = results["workloads"][r["workload"]]["output_lens"]
        assert r["num_output_tokens"] == r["n"] * sum(output_lens)
        if r["n"] > 1:
            assert 0 < r["saving"] < 1
    assert results["paper"]["savings_percent"]["sharegpt/beam"] == [44.3, 66.3]
