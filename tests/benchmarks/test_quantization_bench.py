"""`python -m benchmarks.quantization`: configuration parsing, accuracy arithmetic, and the whole
command on a tiny random model (structure only, never timings)."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import common, quantization
from benchmarks.quantization import accuracy, parse_configs
from pagedllm.config import EngineArgs


def _parse(argv):
    parser = argparse.ArgumentParser()
    quantization.add_cli_args(parser)
    return parser.parse_args(argv)


def test_cli_defaults_and_registration():
    ns = _parse([])
    assert (ns.configs, ns.num_prompts, ns.output_len, ns.batch_size) == (
        "float32,bfloat16,int8,int4", 16, 64, 32,
    )  # fmt: skip
    ns = common.build_parser(quantization.add_cli_args).parse_args(
        ["--num-prompts", "2", "--output-len", "3", "-q", "int8"]
    )
    assert ns.num_prompts == 2 and ns.output_len == 3 and ns.quantization == "int8"


def test_parse_configs():
    assert parse_configs("float32,bfloat16,int8,int4") == [
        ("float32", "float32", "none"),
        ("bfloat16", "bfloat16", "none"),
        ("int8", "bfloat16", "int8"),
        ("int4", "bfloat16", "int4"),
    ]
    # The float32 reference always runs, first; method:dtype picks the activations.
    assert parse_configs("int4:float32,int4") == [
        ("float32", "float32", "none"),
        ("int4:float32", "float32", "int4"),
        ("int4", "bfloat16", "int4"),
    ]
    for bad in ("int3", "int4:int8", "none"):
        with pytest.raises(ValueError):
            parse_configs(bad)


def test_accuracy_figures():
    ref = [[-1.0, -2.0], [-0.5]]
    acc = accuracy(ref, [[-1.5, -2.0], [-0.0]], [[1, 2], [1]])
    assert acc["num_scored_tokens"] == 3
    assert acc["mean_abs_logprob_diff"] == pytest.approx(1.0 / 3)
    assert acc["max_abs_logprob_diff"] == 0.5
    assert acc["greedy_agreement"] == pytest.approx(2 / 3)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.conftest import save_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama-quant-bench")
    save_tiny_llama(path)
    return str(path)


def test_whole_benchmark_on_a_tiny_model(tiny_model, tmp_path, capsys):
    out_json = tmp_path / "quant.json"
    ns = _parse(["--num-prompts", "3", "--output-len", "4", "--batch-size", "4",
                 "--configs", "float32,bfloat16,int8,int4,int4:float32",
                 "--output-json", str(out_json)])  # fmt: skip
    engine_args = EngineArgs(model=tiny_model, kv_cache_memory="8MiB", block_size=4)
    assert quantization.main(ns, engine_args) == 0
    printed = capsys.readouterr().out
    for label in ("float32", "bfloat16", "int8", "int4", "int4:float32"):
        assert f"\n{label} " in printed
    results = json.loads(out_json.read_text())
    configs = results["configs"]
    assert list(configs) == ["float32", "bfloat16", "int8", "int4", "int4:float32"]
    fp32 = configs["float32"]
    # The reference scored on its own greedy continuation: no difference, full agreement.
    assert fp32["mean_abs_logprob_diff"] == 0 and fp32["greedy_agreement"] == 1
    assert fp32["weight_bytes_ratio"] == 1 and fp32["decode_speedup"] == 1
    for r in configs.values():
        assert r["num_scored_tokens"] == 3 * 4
        assert r["decode_tokens"] == 3 and r["batch_output_tokens"] == 4 * 4
        assert r["decode_tokens_per_s"] > 0 and r["batch_tokens_per_s"] > 0
        assert 0 <= r["greedy_agreement"] <= 1
    mem = {label: r["weight_bytes"] for label, r in configs.items()}
    assert mem["bfloat16"] < mem["float32"]
    assert mem["int4"] < mem["int8"] < mem["bfloat16"]
    assert configs["int4:float32"]["dtype"] == "float32"
