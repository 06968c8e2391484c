"""Starting an engine process (engine/core_proc.py) without importing what it runs: this module
needs no torch, so `pagedllm serve` starts the engine first and imports the server (torch,
fastapi, the protocol's models: about 1.8 s) while the engine process imports and loads its
model on another core. EngineCoreClient adopts the started process; every restart goes
through here as well."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.grammar_compile import GRAMMAR_COMPILE_TIMEOUT


def _run(*args: Any) -> None:
    """The process's target: imported by name in the new process, which then imports the engine."""
    from pagedllm.engine.core_proc import run_engine_core

    run_engine_core(*args)


@dataclass
class EngineLaunch:
    """A started engine process and the addresses it connects to: `{base}-in` (requests) and
    `{base}-out` (outputs, Ready first). ZeroMQ lets it connect before the client binds."""

    process: mp.process.BaseProcess
    socket_dir: str
    base: str
    adopted: bool = False  # an EngineCoreClient owns it (and stops it)

    @classmethod
    def start(cls, args, socket_dir: str, generation: int, grammar_compile_timeout: float,
              faults=None) -> EngineLaunch:  # fmt: skip
        base = f"ipc://{socket_dir}/{generation + 1}"
        process = mp.get_context("spawn").Process(
            target=_run,
            args=(args, f"{base}-in", f"{base}-out", os.getpid(), generation,
                  grammar_compile_timeout, faults),
            name="pagedllm-engine",
        )  # fmt: skip
        process.start()
        return cls(process, socket_dir, base)

    @classmethod
    def early(cls, args) -> EngineLaunch:
        """The first engine process of a server, started before its imports."""
        return cls.start(args, tempfile.mkdtemp(prefix="pagedllm-"), 0, GRAMMAR_COMPILE_TIMEOUT)

    def kill(self) -> None:
        """Not adopted (the server failed to start): stop it now."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
