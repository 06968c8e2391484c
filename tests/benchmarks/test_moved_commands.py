"""The experiments that left the package: `pagedllm bench <name>` names the command that
replaced it and exits 2, whatever its arguments; that command's module is there, and runs."""

from __future__ import annotations

import importlib

import pytest

from benchmarks import common
from pagedllm.entrypoints.cli import MOVED_BENCHMARKS, main


@pytest.mark.parametrize("name", MOVED_BENCHMARKS)
def test_old_command_names_the_new_one(name, capsys):
    assert main(["bench", name, "--num-prompts", "4", "--help"]) == 2
    err = capsys.readouterr().err.strip()
    module = name.replace("-", "_")
    assert len(err.splitlines()) == 1
    assert f"python -m benchmarks.{module} --num-prompts 4 --help" in err
    moved = importlib.import_module(f"benchmarks.{module}")
    assert callable(moved.add_cli_args) and callable(moved.main)


def test_experiment_help_lists_engine_flags_and_its_own(capsys):
    from benchmarks import step

    with pytest.raises(SystemExit) as e:
        common.run(step.add_cli_args, step.main, ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "python -m benchmarks.step" in out and "--num-running" in out and "--model" in out


def test_bad_input_is_a_one_line_error(capsys):
    from benchmarks import kv_waste

    assert common.run(kv_waste.add_cli_args, kv_waste.main, ["--policies", "nope"],
                      engine=False) == 2  # fmt: skip
    assert capsys.readouterr().err.startswith("error: ")
