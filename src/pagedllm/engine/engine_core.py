"""EngineCore: the one loop that steps an LLMEngine, wherever it runs: on a thread of the
server's process (engine/async_llm_engine.py) or on the main thread of the engine process
(engine/core_proc.py, over ZMQ). Its inbox brings the server's messages (core_channel's Add,
Abort, Finish, Call, Stop); its outbox takes what the engine says back: every step's
EngineCoreOutputs (token ids), requests refused, calls' replies.

Between two steps the loop takes what has arrived: a request is added once its
structured-output constraint, if any, has compiled on a compile thread (within a time limit),
so a large schema stalls no step; aborts, finishes and calls (a KV snapshot, checking a LoRA
adapter, engine/diagnostics.py's reports) are applied at once. So an abort never lands
between scheduling a step and running it, and the engine needs no locks. Idle, it waits for a
message and every HEARTBEAT seconds checks the workers (a lost tensor-parallel worker stops the
loop) and tells the outbox, so a watcher can tell a hung step from an idle engine. If a step
raises, `run` raises: its owner reports it."""

from __future__ import annotations

import logging
import time
from typing import Protocol

from pagedllm.engine import core_channel as channel
from pagedllm.engine import diagnostics
from pagedllm.engine.core_output import EngineCoreOutput
from pagedllm.engine.grammar_compile import Compiling, GrammarCompiler
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.heap import trim_heap
from pagedllm.request import EngineCoreRequest

logger = logging.getLogger("pagedllm")

HEARTBEAT = 1.0  # seconds between two messages of an idle engine


class Inbox(Protocol):
    def take(self, timeout: float) -> list[channel.ToEngine]:
        """What has arrived, waiting up to `timeout` seconds for the first (0: none)."""


class Outbox(Protocol):
    def deliver(self, outputs: list[EngineCoreOutput], num_steps: int) -> None:
        """A step's outputs (none: the idle engine's heartbeat)."""

    def added(self, core: EngineCoreRequest) -> None:
        """A request the engine took (its outputs follow)."""

    def reject(self, request_id: str, kind: str, message: str) -> None:
        """A request refused (kind "bad_request": a ValueError's message) or failed on its
        way in ("failed")."""

    def reply(self, call_id: int, ok: bool, value) -> None:
        """A call's value, or (not ok) its error's message."""

    def forget(self, request_ids: list[str]) -> None:
        """Requests aborted in the engine."""


class EngineCore:
    def __init__(self, engine: LLMEngine, inbox: Inbox, outbox: Outbox, grammar_timeout: float):
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.grammars = GrammarCompiler(engine.compile_grammar, grammar_timeout)
        # request id -> (its constraint compiling, the request)
        self._compiling: dict[str, tuple[Compiling, EngineCoreRequest]] = {}
        self.num_steps = 0
        # Looked up on the engine when called (a test may wrap one of its methods).
        self.calls = {
            "kv_snapshot": lambda *args: engine.kv_snapshot(*args),
            "check_lora": lambda *args: engine.check_lora(*args),
            "reset_prefix_cache": lambda: engine.reset_prefix_cache(),
            # Diagnostics (a soak, a leak hunt): engine/diagnostics.py.
            "memory_report": diagnostics.memory_report,
            "leak_report": self._leak_report,
            "make_pool_resident": self._make_pool_resident,
        }

    def run(self) -> None:
        """Step until told to stop (every request is then aborted)."""
        engine = self.engine
        busy = False
        last_sent = time.monotonic()
        try:
            while True:
                idle = not engine.has_unfinished_requests()
                if idle and busy:
                    trim_heap()  # the load is gone: give its freed heap pages back
                busy = not idle
                timeout = 0.01 if self._compiling else HEARTBEAT
                if not self._take_messages(timeout if idle else 0):
                    return
                self._add_compiled()
                if engine.has_unfinished_requests():
                    self.before_step()
                    step_outputs = engine.step_core()
                    self.num_steps += 1
                    self.outbox.deliver(step_outputs, self.num_steps)
                    last_sent = time.monotonic()
                elif time.monotonic() - last_sent >= HEARTBEAT:
                    engine.check_workers()
                    self.outbox.deliver([], self.num_steps)
                    last_sent = time.monotonic()
        finally:
            self.grammars.shutdown()

    def before_step(self) -> None:
        """A hook (the engine process's injected faults)."""

    def _take_messages(self, timeout: float) -> bool:
        """Handle what has arrived, waiting up to `timeout` for the first; False on Stop."""
        for message in self.inbox.take(timeout):
            if isinstance(message, channel.Stop):
                ids = list(self.engine.scheduler.requests)
                self.engine.abort_request(ids)
                self.outbox.forget(ids)
                return False
            self._handle(message)
        return True

    def _handle(self, message) -> None:
        engine = self.engine
        if isinstance(message, channel.Abort):
            for request_id in message.request_ids:
                if self._compiling.pop(request_id, None) is None:
                    engine.abort_request(request_id)
            self.outbox.forget(message.request_ids)
        elif isinstance(message, channel.Finish):
            engine.finish_sample(message.request_id, message.index)
        elif isinstance(message, channel.Add):
            core = message.request
            params = core.sampling_params
            if params is not None and params.structured_outputs is not None:
                compiling = self.grammars.submit(params.structured_outputs)
                self._compiling[core.request_id] = (compiling, core)
            else:
                self.add(core, None)
        elif isinstance(message, channel.Call):
            self._call(message)

    def _add_compiled(self) -> None:
        for request_id, (compiling, core) in list(self._compiling.items()):
            outcome = self.grammars.outcome(compiling)
            if outcome is None:
                continue  # still compiling, in time
            del self._compiling[request_id]
            if isinstance(outcome, ValueError):
                self.outbox.reject(request_id, "bad_request", str(outcome))
            elif isinstance(outcome, BaseException):
                self.outbox.reject(request_id, "failed", repr(outcome))
            else:
                self.add(core, outcome)

    def add(self, core: EngineCoreRequest, grammar) -> None:
        request_id = core.request_id
        try:
            self.engine.add_core_request(core, grammar=grammar)
        except ValueError as e:
            self.outbox.reject(request_id, "bad_request", str(e))
            return
        except Exception as e:  # noqa: BLE001 - one request's failure, not the engine's
            logger.error("request %s failed: %r", request_id, e, exc_info=e)
            self.engine.abort_request(request_id)
            self.outbox.reject(request_id, "failed", f"request {request_id} failed: {e!r}")
            return
        self.outbox.added(core)

    def _call(self, message: channel.Call) -> None:
        try:
            args = channel.call_args(message)  # first: ValueError for an unknown method
            value, ok = self.calls[message.method](*args), True
        except Exception as e:  # noqa: BLE001 - the caller's error, not the engine's
            value, ok = f"{type(e).__name__}: {e}", False
        self.outbox.reply(message.call_id, ok, value)

    def _leak_report(self) -> dict:
        """diagnostics.leak_report, counting the requests whose constraint still compiles (not
        yet in the engine) too."""
        report = diagnostics.leak_report(self.engine)
        report["compiling_requests"] = len(self._compiling)
        report["idle"] = report["idle"] and not self._compiling
        return report

    def _make_pool_resident(self) -> int:
        if self._compiling:
            raise ValueError("the KV pool can be made resident only while no request is pending")
        return diagnostics.make_pool_resident(self.engine)
