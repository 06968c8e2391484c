"""`python -m benchmarks.attention` runs each backend and reports one row per context length."""

import pytest

from benchmarks import attention, common


def run_attention(argv):  # python -m benchmarks.attention ...argv
    return common.run(attention.add_cli_args, attention.main, argv, engine=False)


@pytest.mark.parametrize("backend", ["cpu", "triton"])  # triton: under the interpreter on CPU
def test_bench_attention_reports_bandwidth_per_context(backend, capsys):
    rc = run_attention(["--backend", backend, "--num-seqs", "2",
               "--context-lens", "17,64", "--iters", "2", "--dtype", "float32"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert f"backend {backend}" in out
    rows = [line.split() for line in out.splitlines() if line.split()[0] in ("17", "64")]
    assert [r[0] for r in rows] == ["17", "64"]
    for context, kv_mib, kernel_ms, read, copy, fraction in rows:
        # K and V of 2 requests x 3 KV heads x 64 dims in float32
        assert float(kv_mib) == pytest.approx(2 * 2 * int(context) * 3 * 64 * 4 / 2**20, abs=0.06)
        assert float(kernel_ms) > 0 and float(read) > 0 and float(copy) > 0
        assert fraction.endswith("%")
