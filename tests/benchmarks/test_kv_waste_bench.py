"""`python -m benchmarks.kv_waste`: a short run through the CLI; the report parses and the figure
is a PNG."""

import json

import pytest

from benchmarks import common, kv_waste


def run_kv_waste(argv):  # python -m benchmarks.kv_waste ...argv
    return common.run(kv_waste.add_cli_args, kv_waste.main, argv, engine=False)


def test_kv_waste_report_and_figure(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out_json, png = tmp_path / "kv.json", tmp_path / "kv.png"
    code = run_kv_waste([
        "--num-prompts", "40", "--scale", "0.25", "--num-kv-slots", "2048",
        "--max-model-len", "512", "--output-json", str(out_json), "--plot", str(png),
    ])  # fmt: skip
    assert code == 0
    table = capsys.readouterr().out
    for policy in ("max", "pow2", "oracle", "paged"):
        assert any(line.startswith(policy) for line in table.splitlines())
    result = json.loads(out_json.read_text())
    shares = {r["policy"]: r["breakdown"]["shares"] for r in result["rows"]}
    assert set(shares) == {"max", "pow2", "oracle", "paged"}
    for s in shares.values():
        assert sum(s.values()) == pytest.approx(1.0)
    assert shares["paged"]["token_states"] > shares["oracle"]["token_states"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_policy_is_a_clear_error(capsys):
    assert run_kv_waste(["--policies", "paged,nope"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
