"""`pagedllm bench throughput`: KV accounting, reporting, the HF baseline on a tiny random model,
and the whole command on a tiny random model."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedllm.bench import hf_baseline, throughput, utils
from pagedllm.bench.throughput import KVUsageTracker, format_table
from pagedllm.bench.utils import greedy_agreement
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence


def _parse(argv):
    parser = argparse.ArgumentParser()
    throughput.add_cli_args(parser)
    return parser.parse_args(argv)


def test_cli_defaults_and_flags():
    ns = _parse([])
    assert (ns.num_prompts, ns.scale, ns.baseline, ns.hf_batch_size, ns.output_json) == (
        64,
        0.25,
        "none",
        32,
        None,
    )
    ns = _parse(["--num-prompts", "8", "--baseline", "hf", "--workload-seed", "3"])
    assert (ns.num_prompts, ns.baseline, ns.workload_seed) == (8, "hf", 3)
    with pytest.raises(SystemExit):
        _parse(["--baseline", "vllm"])


def _request(request_id, num_prompt):
    return Sequence.of(request_id, list(range(num_prompt)), SamplingParams(max_tokens=8))


def test_kv_usage_tracker_counts_blocks_and_held_tokens():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a, b = _request("a", 5), _request("b", 9)
    requests = {"a": a, "b": b}
    # Both prefilled: a holds 5 tokens in 2 blocks (8 slots), b 9 tokens in 3 blocks (12 slots).
    for r in (a, b):
        assert kv.allocate_slots(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
    tracker = KVUsageTracker()
    assert tracker.observe(kv, requests) == (20, 14)
    # a decodes 3 more tokens: still 2 blocks, 8 of 8 slots held.
    assert kv.allocate_slots(a, 3)
    a.num_computed_tokens += 3
    assert tracker.observe(kv, requests) == (20, 17)
    # b finishes and frees its blocks.
    kv.free(b)
    assert tracker.observe(kv, requests) == (8, 8)
    assert tracker.peak_reserved == 20 and tracker.held_at_peak == 14
    assert tracker.share_at_peak == pytest.approx(0.7)
    assert tracker.mean_share == pytest.approx((14 + 17 + 8) / (20 + 20 + 8))
    assert tracker.min_share == pytest.approx(0.7)
    # An empty cache adds no sample.
    kv.free(a)
    assert tracker.observe(kv, requests) == (0, 0)
    assert tracker.num_samples == 3


def test_kv_usage_tracker_counts_a_shared_block_once():
    class Block:
        def __init__(self, block_id):
            self.block_id = block_id

    class FakeKV:
        block_size = 4
        shared = Block(0)
        req_to_blocks = {"a": [shared, Block(1)], "b": [shared, Block(2)]}

    a, b = _request("a", 6), _request("b", 5)
    a.num_computed_tokens, b.num_computed_tokens = 6, 5
    # Blocks 0 (4 held), 1 (2 held), 2 (1 held): 12 slots reserved, 7 held.
    assert KVUsageTracker().observe(FakeKV(), {"a": a, "b": b}) == (12, 7)


def test_greedy_agreement():
    assert greedy_agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == 1.0
    assert greedy_agreement([[1, 2, 3, 4]], [[1, 9, 3, 4]]) == pytest.approx(0.25)
    assert greedy_agreement([[1, 2], [7]], [[1, 2], [8]]) == pytest.approx(2 / 3)
    # Compared only up to our first EOS (HF's min_new_tokens forbids EOS there).
    assert greedy_agreement([[1, 0, 5, 6], [3, 4]], [[1, 9, 9, 9], [3, 4]], eos_ids=[0]) == 1.0
    assert greedy_agreement([[0, 5]], [[7, 5]], eos_ids=[0]) == 1.0


def test_format_table_has_both_systems_and_the_ratio():
    run = {"requests_per_s": 1.0, "output_tokens_per_s": 90.0, "total_tokens_per_s": 120.0,
           "elapsed_s": 10.0}  # fmt: skip
    results = {
        "pagedllm": {**run, "kv_cache": {"used_share_at_peak": 0.97}},
        "hf": {
            **run,
            "output_tokens_per_s": 30.0,
            "batch_size": 32,
            "kv_cache": {"used_share": 0.41},
        },  # fmt: skip
        "speedup_output_tokens_per_s": 3.0,
    }
    results["pagedllm"]["mfu"] = {"mfu": 0.123}
    table = format_table(results)
    assert "pagedllm" in table and "HF generate (batch 32)" in table and "12.3%" in table
    assert "97.0%" in table and "41.0%" in table and "3.00x" in table
    del results["hf"]
    assert "HF" not in format_table(results)


def test_resolve_hf_source(tmp_path):
    directory, gguf_file = hf_baseline.resolve_hf_source(None)  # the packaged default model
    assert gguf_file.endswith(".gguf") and (directory / gguf_file).is_file()
    (tmp_path / "config.json").write_text("{}")
    assert hf_baseline.resolve_hf_source(str(tmp_path)) == (tmp_path, None)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(ValueError, match="HF baseline"):
        hf_baseline.resolve_hf_source(str(other))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.conftest import save_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama-bench")
    model = save_tiny_llama(path)
    return path, model


def test_hf_baseline_counts_useful_tokens_and_pads_left(tiny_llama):
    import torch

    _, model = tiny_llama
    requests = [([5, 9, 3], 4), ([17, 4, 88, 23, 6], 9), ([100], 2)]
    result = hf_baseline.run_hf(model, requests, batch_size=2)
    assert result["num_batches"] == 2
    assert result["num_useful_output_tokens"] == 15
    assert result["num_output_tokens"] == 2 * 9 + 1 * 2  # every row runs to its batch's longest
    assert [len(t) for t in result["token_ids"]] == [4, 9, 2]
    assert result["kv_cache"]["reserved_slots"] == 2 * (5 + 9) + 1 * (1 + 2)
    assert result["kv_cache"]["used_slots"] == 7 + 14 + 3
    # Left padding does not change a row's greedy tokens.
    for (prompt, n), got in zip(requests, result["token_ids"], strict=True):
        ids = torch.tensor([prompt])
        alone = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, pad_token_id=2)  # fmt: skip
        assert alone[0, len(prompt) :].tolist() == got


def test_whole_benchmark_on_a_tiny_model(tiny_llama, tmp_path, capsys):
    from pagedllm.config import EngineArgs

    path, _ = tiny_llama
    out = tmp_path / "bench.json"
    ns = _parse(["--num-prompts", "6", "--scale", "0.1", "--baseline", "hf",
                 "--hf-batch-size", "4", "--output-json", str(out)])  # fmt: skip
    engine_args = EngineArgs(dtype="float32", model=str(path), kv_cache_memory="8MiB", block_size=4)
    assert throughput.main(ns, engine_args) == 0
    printed = capsys.readouterr().out
    assert "pagedllm / HF, useful output tokens/s" in printed
    results = json.loads(out.read_text())
    expected = sum(results["workload"]["output_lens"])
    assert results["pagedllm"]["num_useful_output_tokens"] == expected
    assert results["pagedllm"]["num_output_tokens"] == expected
    assert results["hf"]["num_useful_output_tokens"] == expected
    assert 0 < results["pagedllm"]["kv_cache"]["used_share_at_peak"] <= 1
    assert results["hf"]["kv_cache"]["used_share"] <= 1
    # Same weights, both greedy in fp32: the outputs agree (up to the first EOS).
    assert results["hf"]["greedy_agreement_with_pagedllm"] > 0.95
    # MFU against the float32 GEMM peak measured in the same run.
    mfu = results["pagedllm"]["mfu"]
    assert 0 < mfu["mfu"] <= 1 and mfu["peak_gflops"] > 0 and mfu["flops_per_token"] > 0
    assert mfu["gemm_peak"]["dtype"] == "float32"
    assert mfu["tokens_per_s"] == results["pagedllm"]["total_tokens_per_s"]
    lens = zip(results["workload"]["input_lens"], results["workload"]["output_lens"], strict=True)
    assert mfu["mean_context_len"] == pytest.approx(throughput.mean_context_len(lens))
    assert "[pagedllm] model FLOPs utilisation: " in printed


def test_mean_context_len():
    # One request of 3 prompt + 2 output tokens: they attend to 1, 2, 3, 4 and 5 tokens.
    assert throughput.mean_context_len([(3, 2)]) == pytest.approx(3.0)
    # Weighted by tokens: 5 tokens with mean 3, 1 token with mean 1.
    assert throughput.mean_context_len([(3, 2), (1, 0)]) == pytest.approx(16 / 6)
    assert throughput.mean_context_len([]) == 0.0


def test_others_cpu_share(monkeypatch):
    monkeypatch.setattr(utils.os, "cpu_count", lambda: 2)
    # 10 s of wall time on 2 cores = 20 CPU s; the machine was busy 16 s, 12 s of it ours.
    assert utils.others_cpu_share((100.0, 5.0, 0.0), (116.0, 17.0, 10.0)) == pytest.approx(0.2)
    assert utils.others_cpu_share(None, (1.0, 1.0, 1.0)) is None
    counters = utils.cpu_counters()
    assert counters is None or len(counters) == 3
