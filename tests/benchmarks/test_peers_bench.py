"""`python -m benchmarks.peers`: flags, the pagedllm serve flags it rebuilds, the report, and short
smoke runs on a tiny random GGUF (pagedllm's HTTP server and HF static batching; llama.cpp's
llama-server only where its binary has been built: CI cannot build it in time)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks import common, peer_servers, peers
from pagedllm.config import EngineArgs
from pagedllm.cpu_info import has_native_bf16
from tests.model_loader.tiny_gguf import gpt2_vocab, random_hf_weights, write_tiny_llama


def run_peers(argv):  # python -m benchmarks.peers ...argv
    return common.run(peers.add_cli_args, peers.main, argv)


def _parse(argv):
    parser = argparse.ArgumentParser()
    peers.add_cli_args(parser)
    return parser.parse_args(argv)


def test_cli_defaults_and_flags():
    ns = _parse([])
    assert (ns.peers, ns.concurrency, ns.num_prompts, ns.llama_server) == (
        None,
        [1, 8, 32],
        64,
        None,
    )
    assert (ns.scenarios, ns.long_prompt_len, ns.prefix_len, ns.prefill_lens) == (
        ["long-prompts", "shared-prefix", "prefill"],
        1536,
        400,
        [512, 2048],
    )
    ns = _parse(["--peers", "hf,pagedllm", "--concurrency", "2,4", "--scenarios", "prefill"])
    assert ns.peers == ["pagedllm", "hf"] and ns.concurrency == [2, 4]
    assert ns.scenarios == ["prefill"] and _parse(["--scenarios", "none"]).scenarios == []
    for bad in (["--peers", "vllm"], ["--concurrency", "0"], ["--concurrency", "a"],
                ["--scenarios", "long"], ["--scenarios", ""]):  # fmt: skip
        with pytest.raises(SystemExit):
            _parse(bad)


def test_to_cli_args_rebuilds_the_serve_flags():
    """What run_pagedllm hands `pagedllm serve`: the flags away from the defaults."""
    assert EngineArgs().to_cli_args() == []
    args = EngineArgs(model="m.gguf", dtype="bfloat16", quantization="int8",
                      enable_prefix_caching=False, max_num_seqs=8)  # fmt: skip
    argv = args.to_cli_args()
    assert argv == ["--model", "m.gguf", "--dtype", "bfloat16", "--max-num-seqs", "8",
                    "--no-enable-prefix-caching", "--quantization", "int8"]  # fmt: skip
    from pagedllm.entrypoints.cli import build_parser, engine_args_from

    ns = build_parser().parse_args(["serve", *argv])
    rebuilt = engine_args_from(ns)
    for field in ("model", "dtype", "quantization", "enable_prefix_caching", "max_num_seqs",
                  "enable_chunked_prefill", "kv_cache_memory", "block_size"):  # fmt: skip
        assert getattr(rebuilt, field) == getattr(args, field), field


def test_pagedllm_dtype_from_the_log_line():
    args = EngineArgs()
    assert peer_servers._pagedllm_dtype(args, "3.4 MiB (float32)") == "float32"
    line = "60.1 MiB with int8 projections (257.9 MiB all in bfloat16); kept in bfloat16: lm_head"
    assert peer_servers._pagedllm_dtype(EngineArgs(quantization="int8"), line) == (
        "bfloat16 (+ int8 projections)"
    )
    # No log line: what --dtype auto picks on this machine.
    want = "bfloat16" if has_native_bf16() else "float32"
    assert peer_servers._pagedllm_dtype(EngineArgs(quantization="int4"), None) == want


def test_gguf_file_type(tmp_path):
    from pagedllm.model_loader.loader import resolve_model

    assert peer_servers.gguf_file_type(resolve_model(None)) == "Q4_1"  # the packaged default model
    assert peer_servers.gguf_file_type(tmp_path / "none.gguf") is None


def test_missing_llama_server(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDLLM_PEERS_DIR", str(tmp_path))
    assert peers.default_llama_server() == tmp_path / "llama-server"
    ns = _parse([])
    chosen, _, _ = peers._resolve_peers(ns, EngineArgs())
    assert chosen == ["pagedllm", "hf"]
    assert "build_llama_server.sh" in capsys.readouterr().out
    with pytest.raises(ValueError, match="build_llama_server.sh"):
        peers._resolve_peers(_parse(["--peers", "llama.cpp"]), EngineArgs())


def _rate(tokens_per_s, match=True):
    return {"output_tokens_per_s": tokens_per_s, "tokens_match": match}


def test_report_has_every_system_and_the_ratios():
    results = {
        "concurrency": [1, 8],
        "scenario_labels": {"prefill-512": "prefill 512 tokens (prompt tokens/s)"},
        "systems": {
            "pagedllm": {"by_concurrency": {"1": _rate(20.0), "8": _rate(80.0)},
                         "decode": {"decode_tokens_per_s": 22.0, "tokens_match": True},
                         "scenarios": {"prefill-512": {"tokens_per_s": 900.0,
                                                       "tokens_match": True}},
                         "dtype": "float32"},
            "llama.cpp": {"by_concurrency": {"1": _rate(40.0), "8": _rate(160.0, False)},
                          "decode": {"decode_tokens_per_s": 44.0, "tokens_match": True},
                          "scenarios": {"prefill-512": {"tokens_per_s": 300.0,
                                                        "tokens_match": False}},
                          "dtype": "Q4_1 (ggml kernels)"},
            "hf": {"by_concurrency": {"1": _rate(10.0), "8": _rate(40.0)},
                   "decode": {"decode_tokens_per_s": 11.0, "tokens_match": True},
                   "dtype": "float32"},
        },
    }  # fmt: skip
    peers.add_ratios(results)
    assert results["pagedllm_over_peer"]["llama.cpp"] == {
        "1": 0.5, "8": 0.5, "decode": 0.5, "prefill-512": 3.0
    }  # fmt: skip
    assert results["pagedllm_over_peer"]["hf"] == {"1": 2.0, "8": 2.0, "decode": 2.0}
    table = peers.format_table(results)
    assert "pagedllm / llama.cpp" in table and "pagedllm / HF static" in table
    assert "0.50x" in table and "2.00x" in table and "single-stream decode" in table
    assert "llama.cpp ran: Q4_1" in table
    warning = "WARNING: generated tokens != requested for llama.cpp at 8, llama.cpp at prefill-512"
    assert warning in table
    # The scenario's row: both servers' figures and the ratio; HF ran none.
    row = next(ln for ln in table.splitlines() if ln.startswith("prefill 512 tokens"))
    assert row.split()[-5:] == ["900.0", "300.0", "-", "3.00x", "-"] and "no scenarios" in table


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-peers") / "tiny.gguf"
    return str(write_tiny_llama(path, random_hf_weights(len(gpt2_vocab()[0]))))


def _run(model, out, *extra):
    return run_peers(
        ["--model", model, "--kv-cache-memory", "16MiB", "--num-prompts", "3",
         "--scale", "0.05", "--concurrency", "1,2", "--decode-output-len", "4",
         "--long-prompt-len", "24", "--prefix-len", "16", "--prefill-lens", "20,40",
         "--output-json", str(out), *extra]
    )  # fmt: skip


SCENARIO_KEYS = {"long-prompts", "shared-prefix", "prefill-20", "prefill-40"}


def _check_report(out, systems):
    results = json.loads(out.read_text())
    assert sorted(results["systems"]) == sorted(systems)
    expected = results["workload"]["num_output_tokens"]
    for name, system in results["systems"].items():
        assert system["dtype"]
        assert set(system["by_concurrency"]) == {"1", "2"}
        for r in system["by_concurrency"].values():
            assert r["tokens_match"] and r["expected_output_tokens"] == expected, (name, r)
            assert r["output_tokens_per_s"] > 0
        assert system["decode"]["tokens_match"] and system["decode"]["decode_tokens_per_s"] > 0
        # The servers run every scenario, checked token for token; HF none.
        scenarios = system.get("scenarios", {})
        assert set(scenarios) == (set() if name == "hf" else SCENARIO_KEYS), name
        for r in scenarios.values():
            assert r["tokens_match"] and r["tokens_per_s"] > 0, (name, r)
    assert set(results["scenario_labels"]) == SCENARIO_KEYS
    plan = results["workload"]["scenarios"]
    assert plan["long-prompts"]["prompt_lens"] == [24] * 8
    assert plan["prefill-40"] == {"num_requests": 3, "concurrency": 1, "prompt_lens": [40] * 3,
                                  "output_lens": [1] * 3}  # fmt: skip
    assert all(n >= 17 for n in plan["shared-prefix"]["prompt_lens"])
    return results


def test_a_crashing_server_fails_its_peer_only(tiny_gguf, tmp_path, capsys):
    """A llama-server that dies at start: reported, the others still run, exit status 1."""
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'segfault, say'\nexit 139\n")
    fake.chmod(0o755)
    out = tmp_path / "peers.json"
    assert _run(tiny_gguf, out, "--peers", "llama.cpp", "--llama-server", str(fake)) == 1
    assert "FAILED: llama.cpp" in capsys.readouterr().out
    results = json.loads(out.read_text())
    assert results["systems"] == {} and "segfault, say" in results["failed"]["llama.cpp"]


def test_smoke_pagedllm_and_hf(tiny_gguf, tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "peers.json"
    assert _run(tiny_gguf, out, "--peers", "pagedllm,hf") == 0
    printed = capsys.readouterr().out
    dtype = "bfloat16" if has_native_bf16() else "float32"  # what --dtype auto picks here
    assert "pagedllm / HF static" in printed and f"pagedllm ran: {dtype}" in printed
    results = _check_report(out, ["pagedllm", "hf"])
    assert set(results["pagedllm_over_peer"]["hf"]) == {"1", "2", "decode"}
    assert "--kv-cache-memory 16MiB" in results["systems"]["pagedllm"]["command"]


def _llama_server() -> str | None:
    binary = os.environ.get("PAGEDLLM_LLAMA_SERVER") or str(peers.default_llama_server())
    return binary if os.access(binary, os.X_OK) else None


@pytest.mark.skipif(_llama_server() is None, reason="llama-server not built (see benchmarks/)")
def test_smoke_llama_cpp(tiny_gguf, tmp_path):
    out = tmp_path / "peers.json"
    assert _run(tiny_gguf, out, "--peers", "llama.cpp", "--llama-server", _llama_server()) == 0
    results = _check_report(out, ["llama.cpp"])
    assert results["systems"]["llama.cpp"]["slot_ctx"] >= 256


def test_a_servers_engine_process_counts_as_the_system_under_test():
    """pagedllm's engine process is the server's child: its CPU is the run's, not a competing
    process's (it was reported as "others used 90% of the CPU")."""
    burn = "import time\nt = time.time()\nwhile time.time() - t < 20: pass"
    serve = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"
    server = subprocess.Popen([sys.executable, "-c", serve], start_new_session=True)
    try:
        while not any(parent == server.pid for parent in peer_servers._parents().values()):
            time.sleep(0.05)  # the engine process is up
        before = peer_servers.counters_with([server.pid])
        time.sleep(1.0)
        after = peer_servers.counters_with([server.pid])
        # Its busy loop is ours: at least a good part of a core over the second (a loaded
        # machine gives it less than all of one).
        assert after[1] - before[1] >= 0.25 * (after[2] - before[2]), (before, after)
    finally:
        os.killpg(server.pid, signal.SIGKILL)  # the server and its child
        server.wait()
