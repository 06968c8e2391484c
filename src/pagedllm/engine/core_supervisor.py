"""The engine process as engine/core_client.py supervises it: one process at a time (each a new
generation, with fresh sockets, so nothing meant for a dead process reaches the next), started
(or adopted from an early launch, engine/core_launch.py) and waited for until Ready; sends that
never block; why it must be replaced (it failed, exited, or went silent while requests were in
flight); and when a restart may happen (the crash-loop pause, the restart budget)."""

from __future__ import annotations

import logging
import signal
import time

from pagedllm.config import EngineArgs
from pagedllm.engine import core_channel as channel
from pagedllm.engine.core_launch import EngineLaunch

logger = logging.getLogger("pagedllm")

MAX_RESTARTS = 5  # within RESTART_WINDOW; one more and the engine is declared dead
RESTART_WINDOW = 600.0


class EngineProcess:
    def __init__(
        self,
        args: EngineArgs,
        socket_dir: str,
        grammar_compile_timeout: float,
        faults,
        startup_timeout: float,
        max_restarts: int,
    ) -> None:
        import zmq

        self._zmq = zmq
        self.context = zmq.Context()
        self.args = args
        self.socket_dir = socket_dir
        self.grammar_compile_timeout = grammar_compile_timeout
        self.faults = faults
        self.startup_timeout = startup_timeout
        self.max_restarts = max_restarts
        self.generation = 0
        self.proc = None
        self.input = self.output = None
        self.fatal: channel.Fatal | None = None
        self.last_message = time.monotonic()
        self.stepped = False  # the current process finished a step
        self._num_futile = 0  # processes in a row that failed before any step
        self._restart_times: list[float] = []

    def start(self, launched: EngineLaunch | None = None) -> channel.Ready:
        """Fresh sockets, the process (or the one `launched` for them), and its Ready;
        RuntimeError if it exits or fails to start in time."""
        zmq = self._zmq
        self.generation += 1
        base = f"ipc://{self.socket_dir}/{self.generation}"
        self.input = self.context.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)  # no bound: a send never waits for the engine
        self.input.bind(f"{base}-in")
        self.output = self.context.socket(zmq.PULL)
        self.output.bind(f"{base}-out")
        self.fatal = None
        self.stepped = False
        if launched is None:
            launched = EngineLaunch.start(self.args, self.socket_dir, self.generation - 1,
                                          self.grammar_compile_timeout, self.faults)  # fmt: skip
        assert launched.base == base, (launched.base, base)
        launched.adopted = True
        self.proc = launched.process
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.output.poll(100):
                message = channel.decode_from_engine(self.output.recv())
                if isinstance(message, channel.Ready):
                    self.last_message = time.monotonic()
                    logger.info("engine process %d ready", message.pid)
                    return message
                if isinstance(message, channel.Fatal):
                    self.stop(5)
                    raise RuntimeError(message.message)
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine process exited (code {self.proc.exitcode})")
        self.stop(0)
        raise RuntimeError(f"the engine process did not start within {self.startup_timeout:g} s")

    def stop(self, timeout: float) -> None:
        proc = self.proc
        if proc is None:
            return
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
        for sock in (self.input, self.output):
            sock.close(linger=0)

    def send(self, frame: bytes, running) -> bool:
        """Send without blocking; False when the process is gone (its socket has no peer: a
        blocking send would wait for ever) or `running()` turned False meanwhile."""
        while True:
            try:
                self.input.send(frame, self._zmq.NOBLOCK)
                return True
            except self._zmq.Again:
                if not running() or not self.proc.is_alive():
                    return False
                time.sleep(0.001)  # a process that just started: its connection is under way

    def receive(self):
        """The next message the process sent, if one has arrived (else None)."""
        try:
            frame = self.output.recv(self._zmq.NOBLOCK)
        except self._zmq.Again:
            return None
        self.last_message = time.monotonic()
        return channel.decode_from_engine(frame)

    def failure(self, in_flight: bool, step_timeout: float) -> tuple[str, bool] | None:
        """Why the process must be replaced (and whether to blame its requests)."""
        proc = self.proc
        if self.fatal is not None:
            return f"the engine failed: {self.fatal.message}", self.fatal.blame
        if not proc.is_alive():
            code = proc.exitcode
            if code == channel.WORKER_LOST_EXIT_CODE:
                return "the engine process lost a tensor-parallel worker", False
            external = code in (-signal.SIGKILL, -signal.SIGTERM)  # an operator, the OOM killer
            return f"the engine process exited (code {code})", not external
        silent = time.monotonic() - self.last_message
        if in_flight and silent > step_timeout:
            return f"no engine step finished in {silent:.0f} s (--engine-step-timeout)", True
        return None

    def may_restart(self) -> bool:
        """False once max_restarts restarts happened within RESTART_WINDOW seconds; else
        counts this one and waits as a crash loop must: a process that stepped is replaced at
        once, one that failed before its first step (or did not start) after a growing pause."""
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < RESTART_WINDOW]
        if len(self._restart_times) >= self.max_restarts:
            return False
        self._restart_times.append(now)
        self._num_futile = 0 if self.stepped else self._num_futile + 1
        if self._num_futile:
            time.sleep(min(10.0, 0.5 * 2 ** (self._num_futile - 1)))
        return True
