"""What the experiments share: their command line (`python -m benchmarks.<name>` takes every
engine flag, as the `pagedllm` commands do, plus its own), list-valued flag types, and the
workload flags of `load` and `block_size`. Timing, CPU counters, figures, tables, JSON reports
and free ports are pagedllm.bench.utils', shared with the package's own benchmarks."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from pagedllm.bench.workload import WORKLOAD_SHAPES


# -- the command line ---------------------------------------------------------------------------
def build_parser(
    add_cli_args: Callable[[argparse.ArgumentParser], None],
    *,
    engine: bool = True,
    prog: str | None = None,
    description: str | None = None,
) -> argparse.ArgumentParser:
    """The experiment's own flags (`add_cli_args`), after the engine group when `engine`."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if engine:
        from pagedllm.entrypoints.cli import add_engine_args

        add_engine_args(parser)
    add_cli_args(parser)
    return parser


def run(
    add_cli_args: Callable[[argparse.ArgumentParser], None],
    main: Callable[..., int],
    argv: list[str] | None = None,
    *,
    engine: bool = True,
) -> int:
    """Parse `argv` (default: the command line) and run `main(ns, engine_args)`, or `main(ns)`
    without the engine flags. Bad flags or input (ValueError) exit with status 2 and a one-line
    message, as `pagedllm` does; a torchrun rank > 0 serves rank 0's steps instead."""
    module = sys.modules[main.__module__]
    spec = getattr(module, "__spec__", None)
    prog = f"python -m {spec.name}" if spec is not None else None
    doc = (module.__doc__ or "").strip()
    parser = build_parser(add_cli_args, engine=engine, prog=prog, description=doc)
    ns = parser.parse_args(argv)
    try:
        if not engine:
            return main(ns) or 0
        from pagedllm.entrypoints.cli import engine_args_from

        engine_args = engine_args_from(ns)
        if engine_args.tensor_parallel_size > 1 and _serve_torchrun_rank(engine_args):
            return 0
        return main(ns, engine_args) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _serve_torchrun_rank(engine_args) -> bool:
    """Under torchrun, ranks > 0 only run rank 0's steps: True once such a rank is done."""
    from pagedllm.distributed.process_group import launched_rank
    from pagedllm.engine.arg_utils import create_engine_config
    from pagedllm.executor.multiproc import run_worker

    rank = launched_rank()
    if rank:
        run_worker(create_engine_config(engine_args), rank)
        return True
    return False


# -- list-valued flags (argparse types) ---------------------------------------------------------
def int_list(text: str) -> list[int]:
    """Comma-separated integers >= 1 (an empty list skips that part)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return values


def float_list(text: str) -> list[float]:
    """Comma-separated positive numbers."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be > 0: {text!r}")
    return values


def str_list(text: str) -> list[str]:
    """Comma-separated names."""
    return [x.strip() for x in text.split(",") if x.strip()]


def choice_list(choices, what: str) -> Callable[[str], list[str]]:
    """A comma-separated, non-empty subset of `choices`, in the order given, without repeats;
    `what` names them in the error ("workloads", "peers")."""

    def parse(text: str) -> list[str]:
        values = str_list(text)
        if not values or any(v not in choices for v in values):
            raise argparse.ArgumentTypeError(
                f"{what} are a comma-separated subset of {', '.join(choices)}, got {text!r}"
            )
        return list(dict.fromkeys(values))

    return parse


def nonempty(parse: Callable[[str], list]) -> Callable[[str], list]:
    """`parse`, refusing an empty list."""

    def parse_nonempty(text: str) -> list:
        values = parse(text)
        if not values:
            raise argparse.ArgumentTypeError(f"expected at least one value, got {text!r}")
        return values

    return parse_nonempty


# -- workload flags -----------------------------------------------------------------------------
def add_workload_args(group) -> None:
    """The flags of `load` and `block_size`: the workloads, their arrivals and the outputs."""
    group.add_argument("--workloads", type=str_list, default=list(WORKLOAD_SHAPES),
                       help="workloads, comma-separated (default: sharegpt,alpaca)")  # fmt: skip
    group.add_argument("--num-prompts", type=int, default=48,
                       help="requests per run (default: 48)")  # fmt: skip
    group.add_argument("--sharegpt-scale", type=float, default=0.25,
                       help="length scale of the ShareGPT workload (default: 0.25)")  # fmt: skip
    group.add_argument("--alpaca-scale", type=float, default=1.0,
                       help="length scale of the Alpaca workload (default: 1)")  # fmt: skip
    group.add_argument("--workload-seed", type=int, default=0,
                       help="seed of the requests' lengths and tokens (default: 0)")  # fmt: skip
    group.add_argument("--arrival-seed", type=int, default=0,
                       help="seed of the Poisson arrivals (default: 0)")  # fmt: skip
    group.add_argument("--plot", type=Path, default=None, help="write a PNG figure here")
    group.add_argument("--output-json", type=Path, default=None,
                       help="write every figure to this JSON file")  # fmt: skip
