"""`benchmarks.dashboard` runs its three batches and checks that snapshots change nothing."""

import pytest

from benchmarks import common, dashboard

pytestmark = pytest.mark.slow


def run_dashboard(argv):  # python -m benchmarks.dashboard ...argv
    return common.run(dashboard.add_cli_args, dashboard.main, argv)


def test_bench_dashboard_reports_each_run(capsys):
    rc = run_dashboard(["--num-seqs", "3", "--output-len", "6",
               "--kv-cache-memory", "64MiB", "--max-model-len", "512"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        for name in ("none", "every 0.2 s", "every step"):
            if line.startswith(name):
                rows[name] = [float(x) for x in line[len(name) :].split()]
    assert set(rows) == {"none", "every 0.2 s", "every step"}
    assert rows["none"][1:] == [1.0, 0, 0, 0, 0]  # ratio 1, no snapshot taken
    tok_s, ratio, taken, median_ms, max_ms, kib = rows["every step"]
    assert tok_s > 0 and ratio > 0 and taken >= 6  # one per step, 6+ steps
    assert 0 < median_ms <= max_ms and kib > 0
    assert "every run decodes the same tokens: yes" in out
