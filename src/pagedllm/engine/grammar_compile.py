"""Structured-output constraints compiled on their own threads, off the engine loop (a large
schema would otherwise stall every request's steps), each within a time limit: past it the
request is refused as bad input. llguidance's own resource limits bound the work behind. The
engine loop (engine/engine_core.py) submits one and looks at it between steps (submit(),
outcome())."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # engine/core_launch.py imports this module without torch
    from pagedllm.sampling_params import StructuredOutputsParams
    from pagedllm.structured_output import Grammar

GRAMMAR_COMPILE_TIMEOUT = 10.0  # seconds
GRAMMAR_COMPILE_THREADS = 2


@dataclass
class Compiling:
    future: concurrent.futures.Future
    deadline: float  # time.monotonic()


class GrammarCompiler:
    def __init__(
        self,
        compile_grammar: Callable[[StructuredOutputsParams], Grammar],
        timeout: float = GRAMMAR_COMPILE_TIMEOUT,
    ) -> None:
        self.compile_grammar = compile_grammar
        self.timeout = timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(
            GRAMMAR_COMPILE_THREADS, thread_name_prefix="pagedllm-grammar"
        )

    def timed_out(self) -> ValueError:
        return ValueError(
            f"the structured-output constraint did not compile within {self.timeout:g} s: "
            "simplify the schema or grammar"
        )

    def submit(self, structured_outputs: StructuredOutputsParams) -> Compiling:
        future = self._pool.submit(self.compile_grammar, structured_outputs)
        return Compiling(future, time.monotonic() + self.timeout)

    def outcome(self, compiling: Compiling) -> Grammar | BaseException | None:
        """The grammar, or the error that refuses the request (out of time: a ValueError), or
        None while it still compiles in time."""
        future = compiling.future
        if not future.done():
            if time.monotonic() < compiling.deadline:
                return None
            future.cancel()
            return self.timed_out()
        error = future.exception()
        return error if error is not None else future.result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
