"""`pagedllm bench latency`: flags, the summary's arithmetic, and the whole command on a tiny
random model (structure only, never timings)."""

from __future__ import annotations

import json

import pytest

from pagedllm.bench import latency
from pagedllm.config import EngineArgs
from pagedllm.entrypoints.cli import build_parser, engine_args_from


def test_cli_defaults_and_engine_flags():
    ns = build_parser().parse_args(["bench", "latency"])
    assert (ns.input_len, ns.output_len, ns.batch_size, ns.num_iters_warmup, ns.num_iters,
            ns.output_json) == (32, 128, 8, 10, 30, None)  # fmt: skip
    ns = build_parser().parse_args(["bench", "latency", "--batch-size", "2", "--block-size", "8"])
    assert ns.batch_size == 2 and engine_args_from(ns).block_size == 8


def test_summary_mean_and_percentiles():
    s = latency.summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert s["avg_latency"] == pytest.approx(3.0)
    assert list(s["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert s["percentiles"]["50"] == pytest.approx(3.0)
    assert s["percentiles"]["10"] == pytest.approx(1.4)
    text = latency.format_summary(s)
    assert text.splitlines()[0] == "Avg latency: 3.0000 seconds"
    assert "99% percentile latency: 4.9600 seconds" in text


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.conftest import save_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama-latency")
    save_tiny_llama(path)
    return str(path)


def test_whole_benchmark_on_a_tiny_model(tiny_model, tmp_path, capsys):
    out = tmp_path / "latency.json"
    ns = build_parser().parse_args(
        ["bench", "latency", "--input-len", "5", "--output-len", "4", "--batch-size", "3",
         "--num-iters-warmup", "1", "--num-iters", "3", "--output-json", str(out)]
    )  # fmt: skip
    args = EngineArgs(dtype="float32", model=tiny_model, kv_cache_memory="8MiB", block_size=4)
    assert latency.main(ns, args) == 0
    printed = capsys.readouterr()
    assert "Avg latency: " in printed.out and "90% percentile latency: " in printed.out
    assert "warning" not in printed.err  # every iteration generated 3 x 4 tokens
    r = json.loads(out.read_text())
    assert len(r["latencies"]) == 3 and all(t > 0 for t in r["latencies"])
    assert r["avg_latency"] == pytest.approx(sum(r["latencies"]) / 3)
    assert (r["batch_size"], r["input_len"], r["output_len"]) == (3, 5, 4)


def test_rejects_bad_sizes(tiny_model):
    args = EngineArgs(dtype="float32", model=tiny_model, kv_cache_memory="8MiB")
    with pytest.raises(ValueError, match="--batch-size"):
        latency.main(build_parser().parse_args(["bench", "latency", "--batch-size", "0"]), args)
    with pytest.raises(ValueError, match="max_model_len"):  # the tiny model has 256 positions
        ns = build_parser().parse_args(["bench", "latency", "--input-len", "250"])
        latency.main(ns, args)
