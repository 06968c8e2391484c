"""`python -m benchmarks.structured` runs its three batches and checks the unconstrained half."""

import pytest

from benchmarks import common, structured

pytestmark = pytest.mark.slow


def run_structured(argv):  # python -m benchmarks.structured ...argv
    return common.run(structured.add_cli_args, structured.main, argv)


def test_bench_structured_reports_each_run(capsys):
    rc = run_structured(["--num-seqs", "4", "--output-len", "8",
               "--kv-cache-memory", "128MiB", "--max-model-len", "512"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        for name in ("all unconstrained", "2 of 4 regex", "2 of 4 json"):
            if line.startswith(name):
                rows[name] = [float(x) for x in line[len(name) :].split()]
    assert set(rows) == {"all unconstrained", "2 of 4 regex", "2 of 4 json"}
    for name, (tokens, tok_s, step_ms, mask_ms) in rows.items():
        assert tokens == 32 and tok_s > 0 and step_ms > 0  # 4 requests x 8 tokens each
        assert (mask_ms > 0) == (name != "all unconstrained")  # masks only where constrained
    assert "decode the same tokens in every run: yes" in out
