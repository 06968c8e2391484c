"""`benchmarks.block_size` on a tiny random Llama: one KV pool size, rebuilt per block size."""

import json

import pytest

from benchmarks import block_size, common
from tests.conftest import save_tiny_llama

pytest.importorskip("transformers")


def run_block_size(argv):  # python -m benchmarks.block_size ...argv
    return common.run(block_size.add_cli_args, block_size.main, argv)


def test_block_size_smoke(tmp_path, capsys):
    save_tiny_llama(tmp_path / "model")
    out_json, png = tmp_path / "bs.json", tmp_path / "bs.png"
    rc = run_block_size([
        "--model", str(tmp_path / "model"), "--dtype", "float32",
        "--max-model-len", "128",
        "--kv-cache-memory", "128KiB", "--max-num-seqs", "8", "--num-prompts", "8",
        "--block-sizes", "1,4,32", "--sharegpt-rate", "50", "--alpaca-rate", "100",
        "--sharegpt-scale", "0.1", "--alpaca-scale", "0.5",
        "--output-json", str(out_json), "--plot", str(png),
    ])  # fmt: skip
    assert rc == 0
    assert "block_size" in capsys.readouterr().out
    result = json.loads(out_json.read_text())
    runs = result["runs"]
    assert [(r["block_size"], r["workload"]) for r in runs] == [
        (bs, w) for bs in (1, 4, 32) for w in ("sharegpt", "alpaca")
    ]
    for r in runs:
        assert r["policy"] == "paged"
        assert r["num_blocks"] * r["block_size"] == 256  # the same 128 KiB pool: 256 slots
        assert r["num_finished"] == r["num_requests"] == 8 and r["num_failed"] == 0
        assert r["num_output_tokens"] == r["num_expected_output_tokens"]
        assert r["mean_normalized_latency_s"] > 0
        assert 1 <= r["mean_batched_requests"] <= r["max_batched_requests"] <= 8
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
