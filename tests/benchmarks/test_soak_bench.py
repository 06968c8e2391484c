"""`python -m benchmarks.soak` on a tiny random GGUF model: a short run reports zero failures and no
leaked block; a leak the engine is made to keep is reported and fails the command."""

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
    assert _soak(tiny_gguf, out) == 0
    printed = capsys.readouterr().out
    assert "Failed requests:" in printed and "leaked_blocks:" in printed
    result = json.loads(out.read_text())
    assert result["completed"] == 40 and result["failed"] == 0
    assert result["integrity"] == "ok" and result["leaked_blocks"] == 0
    assert result["unfinished_requests"] == 0 and result["open_streams"] == 0
    assert result["rss_start_mib"] > 0 and result["rss_end_mib"] > 0
    assert len(result["python_objects_after_rounds"]) == 5
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
