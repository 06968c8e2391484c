"""`python -m benchmarks.determinism` on a tiny random GGUF model: copies of one greedy request
among random ones, through a real `pagedllm serve`, come back as one distinct completion."""

import json

import pytest

from benchmarks import determinism
from pagedllm import kernels
from tests.model_loader.tiny_gguf import gpt2_vocab, random_hf_weights, write_tiny_llama

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")


def test_identical_requests_give_one_completion(tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny.gguf", random_hf_weights(len(gpt2_vocab()[0])))
    out = tmp_path / "result.json"
    code = determinism.common.run(determinism.add_cli_args, determinism.main, [
        "--model", str(model), "--dtype", "float32", "--max-model-len", "512",
        "--kv-cache-memory", "64MiB", "--enable-prefix-caching", "--num-identical", "12",
        "--num-others", "12", "--max-tokens", "6", "--concurrency", "8",
        "--output-json", str(out),
    ])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "12 identical greedy requests among 12 others (concurrency 8): 1 distinct" in printed
    result = json.loads(out.read_text())
    assert result["distinct"] == 1 and result["counts"] == [12]
    assert result["output_tokens_per_s"] > 0


def test_compare_fast_runs_both_paths_on_one_workload(tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny.gguf", random_hf_weights(len(gpt2_vocab()[0])))
    out = tmp_path / "result.json"
    code = determinism.common.run(determinism.add_cli_args, determinism.main, [
        "--model", str(model), "--dtype", "bfloat16", "--max-model-len", "512",
        "--kv-cache-memory", "64MiB", "--num-identical", "8", "--num-others", "8",
        "--max-tokens", "4", "--concurrency", "8", "--compare-fast", "--output-json", str(out),
    ])  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert "--deterministic" in result["invariant"]["command"]
    assert "--no-deterministic" in result["fast"]["command"]
    assert result["invariant"]["distinct"] == 1 and sum(result["fast"]["counts"]) == 8
    printed = capsys.readouterr().out
    assert f"invariant / fast output tokens/s: {result['invariant_over_fast']:.2f}x" in printed
