"""`python -m benchmarks.soak` on a tiny random GGUF model: a short run reports zero failures and no
leaked block; a leak the engine is made to keep is reported and fails the command, and so does
resident memory growing past `--max-rss-growth`. Those run the engine in the test's process
(`--no-engine-process`, where the engine can be patched); with the engine in its own process (the
default, as `pagedllm serve`), both processes' memory is read and the leak checks run there, and
an engine process restarted during the soak fails it."""

from __future__ import annotations

import json
import os
import signal

import pytest

from benchmarks import common, soak
from pagedllm.engine import diagnostics
from tests.model_loader.tiny_gguf import gpt2_vocab, random_hf_weights, write_tiny_llama
from tests.waiting import wait_until


def run_soak(argv):  # python -m benchmarks.soak ...argv
    return common.run(soak.add_cli_args, soak.main, argv)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-soak") / "tiny.gguf"
    return str(write_tiny_llama(path, random_hf_weights(len(gpt2_vocab()[0]))))


def _soak(tiny_gguf, out, *extra, engine_process=False):
    return run_soak(
        ["--model", tiny_gguf, "--kv-cache-memory", "16MiB",
         "--num-prompts", "40", "--warmup-prompts", "8", "--max-concurrency", "16",
         "--result-json", str(out),
         "--engine-process" if engine_process else "--no-engine-process", *extra]
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
        diagnostics, "rss_bytes", lambda pid="self": int(2**30 * 1.1 ** (next(readings) // 2))
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


def test_soak_with_the_engine_in_its_own_process(tiny_gguf, tmp_path, capsys):
    """The default: the engine in its own process. Each process's RSS and objects are read (the
    engine's in its process, through calls), the pool made resident there, the leak checks run
    there; every check passes."""
    out = tmp_path / "soak.json"
    argv = ("--rounds", "2", "--trim-heap", "--max-rss-growth", "1000")
    assert _soak(tiny_gguf, out, *argv, engine_process=True) == 0
    printed = capsys.readouterr().out
    assert "within --max-rss-growth 1000% (each process)" in printed
    assert "engine_restarts:" in printed and "engine process pids:" in printed
    for process in ("server", "engine"):
        assert f"Object types grown most from the warm-up to the end, {process} process" in printed
    result = json.loads(out.read_text())
    assert result["engine_process"] is True
    assert result["completed"] == 40 and result["failed"] == 0
    assert result["integrity"] == "ok" and result["leaked_blocks"] == 0
    assert result["unfinished_requests"] == 0 and result["open_streams"] == 0
    assert result["compiling_requests"] == 0 and result["idle"] is True
    # One engine process, not this one, all along.
    assert result["engine_restarts"] == 0
    assert len(result["engine_pids"]) == 1 and result["engine_pids"][0] != os.getpid()
    # The warm-up's reading, then one per round, in each process; the total is their sum.
    for process in ("server", "engine"):
        assert len(result[f"{process}_rss_after_rounds_mib"]) == 3
        assert len(result[f"{process}_rss_before_trim_after_rounds_mib"]) == 3
        assert len(result[f"{process}_python_objects_after_rounds"]) == 3
        assert result[f"{process}_rss_start_mib"] > 0
    total = result["total_rss_end_mib"]
    assert abs(total - result["server_rss_end_mib"] - result["engine_rss_end_mib"]) < 1e-6
    assert "rss_growth_pct" not in result  # which process's? only prefixed fields
    # The engine process's 16 MiB pool was written before the warm-up.
    assert result["resident_pool_bytes"] >= 15 * 2**20
    assert result["dashboard_polls"] >= 1 and result["dashboard_bad_polls"] == 0


def test_soak_fails_when_the_engine_process_restarts(tiny_gguf, tmp_path, monkeypatch, capsys):
    """The engine process killed after the first round: the client restarts it, the soak goes on
    (its readings from the new process), then reports the restart and exits 1."""
    read_memory = soak.EngineProcess.read_memory
    reads = []

    def read_after_a_kill(self, trim_heap, by_type):
        reads.append(self.client.pid)
        if len(reads) == 2:  # after the first round
            os.kill(self.client.pid, signal.SIGKILL)
            wait_until(lambda: self.client.num_restarts and not self.client.is_restarting,
                       "the engine process to restart")  # fmt: skip
        return read_memory(self, trim_heap, by_type)

    monkeypatch.setattr(soak.EngineProcess, "read_memory", read_after_a_kill)
    out = tmp_path / "soak.json"
    assert _soak(tiny_gguf, out, "--rounds", "2", engine_process=True) == 1
    printed = capsys.readouterr().out
    assert "the engine process RESTARTED" in printed
    assert "FAILED: the engine process restarted 1 times during the soak" in printed
    result = json.loads(out.read_text())
    assert result["engine_restarts"] == 1 and len(result["engine_pids"]) == 2
    assert result["failed"] == 0 and result["leaked_blocks"] == 0 and result["integrity"] == "ok"


def test_rss_verdict_bounds_each_process():
    ok, line = soak.rss_verdict({"": 4.0}, 5)
    assert (
        ok and line == "RSS growth +4.00% from the warm-up to the end: within --max-rss-growth 5%"
    )
    ok, line = soak.rss_verdict({"server": 1.0, "engine": 6.0}, 5)
    assert not ok and line.endswith(
        "engine +6.00%: FAILED: engine above --max-rss-growth 5% (each process)"
    )
    ok, line = soak.rss_verdict({"server": 1.0, "engine": 2.0}, 5)
    assert ok and "within --max-rss-growth 5% (each process)" in line


def test_make_pool_resident_refuses_an_engine_holding_requests():
    class Busy:
        def has_unfinished_requests(self):
            return True

    with pytest.raises(ValueError, match="no request"):
        diagnostics.make_pool_resident(Busy())
