"""`python -m benchmarks.soak` on a tiny random GGUF model: a short run reports zero failures and no
leaked block; a leak the engine is made to keep is reported and fails the command, and so does
resident memory growing past `--max-rss-growth`."""

from __future__ import annotations

import json

import pytest

from benchmarks import common, soak
from tests.model_loader.tiny_gguf import gpt2_vocab, random_hf_weights, write_tiny_llama


def run_soak(argv):  # python -m benchmarks.soak ...argv
    return common.run(soak.add_cli_args, soak.main, argv)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-soak") / "tiny.gguf"
    return str(write_tiny_llama(path, random_hf_weights(len(gpt2_vocab()[0]))))


def _soak(tiny_gguf, out, *extra):
    return run_soak(
        ["--model", tiny_gguf, "--kv-cache-memory", "16MiB",
         "--num-prompts", "40", "--warmup-prompts", "8", "--max-concurrency", "16",
         "--result-json", str(out), *extra]
    )  # fmt: skip


def test_soak_reports_no_failure_and_no_leak(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "soak.json"
    # A bound no real run reaches: the check runs, and passes.
    assert _soak(tiny_gguf, out, "--rounds", "3", "--trim-heap", "--max-rss-growth", "1000") == 0
    printed = capsys.readouterr().out
    assert "Failed requests:" in printed and "leaked_blocks:" in printed
    assert "within --max-rss-growth 1000%" in printed
    assert "Object types grown most from the warm-up to the end" in printed
    result = json.loads(out.read_text())
    assert result["completed"] == 40 and result["failed"] == 0
    assert result["integrity"] == "ok" and result["leaked_blocks"] == 0
    assert result["unfinished_requests"] == 0 and result["open_streams"] == 0
    assert result["rss_start_mib"] > 0 and result["rss_end_mib"] > 0
    # The warm-up's reading, then one per round; before malloc_trim too.
    assert len(result["python_objects_after_rounds"]) == 4
    assert (
        len(result["rss_after_rounds_mib"]) == len(result["rss_before_trim_after_rounds_mib"]) == 4
    )
    # The 16 MiB pool was written (made resident) before the warm-up.
    assert result["resident_pool_bytes"] >= 15 * 2**20
    assert all(delta > 0 for delta in result["object_types_grown"].values())
    # A dashboard polled /debug/kv (with the integrity check) all along: every poll passed.
    assert result["dashboard_polls"] >= 1 and result["dashboard_bad_polls"] == 0


def test_soak_fails_on_a_leak(tiny_gguf, tmp_path, monkeypatch):
    """Blocks a finished request never gives back: the soak sees them and exits 1."""
    from pagedllm.core.kv_cache_manager import KVCacheManager

    free = KVCacheManager.free
    calls = []

    def leaky_free(self, request):
        calls.append(request)
        if len(calls) != 3:  # the third request's blocks are never freed
            free(self, request)

    monkeypatch.setattr(KVCacheManager, "free", leaky_free)
    out = tmp_path / "soak.json"
    assert _soak(tiny_gguf, out) == 1
    result = json.loads(out.read_text())
    assert result["failed"] == 0 and result["leaked_blocks"] > 0, result
    assert result["integrity"].startswith("failed: a finished")
    assert result["dashboard_bad_polls"] >= 1  # the dashboard's check saw it during the load


def test_soak_fails_on_rss_growth(tiny_gguf, tmp_path, monkeypatch, capsys):
    """RSS read 10% higher at each reading (warm-up, 2 rounds: +21% in all): over a 5% bound the
    soak prints the series and exits 1, though every request and leak check passed."""
    readings = iter(range(1000))
    monkeypatch.setattr(
        soak, "rss_bytes", lambda pid="self": int(2**30 * 1.1 ** (next(readings) // 2))
    )
    out = tmp_path / "soak.json"
    assert _soak(tiny_gguf, out, "--rounds", "2", "--max-rss-growth", "5") == 1
    printed = capsys.readouterr().out
    assert "FAILED: above --max-rss-growth 5%" in printed
    assert "1024.0 1126.4 1239.0" in printed  # the series, printed
    result = json.loads(out.read_text())
    assert result["failed"] == 0 and result["leaked_blocks"] == 0 and result["integrity"] == "ok"
    assert abs(result["rss_growth_pct"] - 21.0) < 1e-6


def test_type_growth_lists_the_types_grown_most():
    from collections import Counter

    before = Counter({"dict": 10, "list": 5, "Gone": 3})
    after = Counter({"dict": 12, "list": 5, "New": 7, "Block": 2})
    assert soak.type_growth(before, after) == [("New", 7), ("Block", 2), ("dict", 2)]
    assert soak.type_growth(before, after, top=1) == [("New", 7)]
