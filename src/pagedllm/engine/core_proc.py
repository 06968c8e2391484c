"""The engine process: an LLMEngine (scheduler, KV cache, model, tensor-parallel workers) that
steps on its main thread and talks to the API server over ZMQ (engine/core_channel.py;
engine/core_client.py is the other end).

Between two steps it takes what the server sent: requests (added as soon as their structured-
output constraint, if any, has compiled on a compile thread), aborts, calls (a KV snapshot,
checking a LoRA adapter, engine/diagnostics.py's reports). After every step it sends the step's
outputs (EngineCoreOutputs: token ids, the server's side makes the text) and the engine's
counters; idle, it sends the counters every HEARTBEAT
seconds, so the server can tell a hung step (no message while requests are in flight) from an
idle engine. If the loop raises, it sends a Fatal message and exits; the server starts another
process. With tensor-parallel workers, a thread exits the process when one of them is gone
(`_watch_workers`)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from pagedllm.config import EngineArgs
from pagedllm.engine import core_channel as channel
from pagedllm.engine import diagnostics
from pagedllm.engine.core_request import EngineCoreRequest
from pagedllm.engine.grammar_compile import Compiling, GrammarCompiler
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.heap import trim_heap
from pagedllm.logger import init_logger
from pagedllm.procs import die_with_parent

logger = logging.getLogger("pagedllm")

HEARTBEAT = 1.0  # seconds between two messages of an idle engine
WORKER_WATCH_PERIOD = 0.5  # seconds between two looks at the tensor-parallel workers


@dataclass
class Faults:
    """Faults a test injects into engine processes (never set when serving)."""

    hang_at_step: int | None = None  # the first engine process sleeps in this step ...
    hang_seconds: float = 3600.0  # ... this long
    crash_on_token: int | None = None  # a process aborts when it runs a prompt with this token


def run_engine_core(
    args: EngineArgs,
    input_address: str,
    output_address: str,
    parent_pid: int,
    generation: int,
    grammar_compile_timeout: float,
    faults: Faults | None,
) -> None:
    """The engine process's target: build the engine, say Ready, serve until told to stop."""
    import zmq

    die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group, a service manager's SIGTERM the whole cgroup:
    # the server drains its requests first, then stops this process (or it dies with it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    init_logger()
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    try:
        engine = LLMEngine(args, output_processing=False)  # the server's side does it
    except BaseException as e:  # the server reports it (a bad flag is not a crash to trace)
        outputs.send(channel.encode(channel.Fatal(f"the engine failed to start: {e!r}", False)))
        outputs.close(linger=2000)
        sys.exit(1)
    if faults is not None and generation > 0:
        faults = Faults(crash_on_token=faults.crash_on_token)  # a hang happens once
    core = EngineCore(engine, inputs, outputs, grammar_compile_timeout, faults)
    ready = channel.Ready(os.getpid(), engine.stats(), engine.lora_stats())
    outputs.send(channel.encode(ready))
    stopping = threading.Event()
    if engine.config.parallel.tensor_parallel_size > 1:
        threading.Thread(target=_watch_workers, args=(engine.executor, stopping),
                         name="pagedllm-worker-watch", daemon=True).start()  # fmt: skip
    try:
        core.run()
    except BaseException as e:
        logger.exception("the engine process failed")
        # A lost worker is not the requests' fault (it may be seen first as a failed collective),
        # nor is a collective that timed out (a lost host or link).
        blame = engine.executor.dead(wait=2.0) is None and not _collective_failed(e)
        outputs.send(channel.encode(channel.Fatal(repr(e), blame)))
        outputs.close(linger=2000)
        sys.exit(1)
    finally:
        stopping.set()  # the workers exit now, as told
        engine.shutdown()
    outputs.close(linger=2000)
    inputs.close(linger=0)


def _collective_failed(e: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(e, dist.DistError)


def _watch_workers(executor, stopping: threading.Event) -> None:
    """A collective with a dead worker does not always fail (gloo can leave rank 0 waiting in a
    gather for good, seen in tests/entrypoints/test_engine_restart_server.py), so a lost worker
    ends the process from this thread; the server replaces it and its whole group."""
    while not stopping.wait(WORKER_WATCH_PERIOD):
        why = executor.dead()
        if why is not None and not stopping.is_set():
            logger.error("%s: the engine process exits", why)
            os._exit(channel.WORKER_LOST_EXIT_CODE)


class EngineCore:
    def __init__(self, engine: LLMEngine, inputs, outputs, grammar_timeout: float, faults):
        import zmq

        self.engine = engine
        self.inputs = inputs
        self.outputs = outputs
        self.faults = faults or Faults()
        self._grammars = GrammarCompiler(engine.compile_grammar, grammar_timeout)
        # request id -> (its constraint compiling, the request)
        self._compiling: dict[str, tuple[Compiling, EngineCoreRequest]] = {}
        self._poller = zmq.Poller()
        self._poller.register(inputs, zmq.POLLIN)
        self._zmq_again = zmq.Again
        self._noblock = zmq.NOBLOCK
        self._crash_ids: set[str] = set()
        self.num_steps = 0

    def run(self) -> None:
        engine = self.engine
        busy = False
        last_sent = time.monotonic()
        while True:
            idle = not engine.has_unfinished_requests()
            if idle and busy:
                trim_heap()  # the load is gone: give its freed heap pages back
            busy = not idle
            timeout = 10 if self._compiling else HEARTBEAT * 1000
            if not self._take_messages(timeout if idle else 0):
                return
            self._add_compiled()
            if engine.has_unfinished_requests():
                self._inject_faults()
                step_outputs = engine.step_core()
                self.num_steps += 1
                self._send_outputs(step_outputs)
                last_sent = time.monotonic()
            elif time.monotonic() - last_sent >= HEARTBEAT:
                engine.check_workers()
                self._send_outputs([])
                last_sent = time.monotonic()

    def _take_messages(self, timeout_ms: float) -> bool:
        """Handle what has arrived, waiting up to `timeout_ms` for the first; False on Stop."""
        if not self._poller.poll(timeout_ms):
            return True
        while True:
            try:
                frame = self.inputs.recv(self._noblock)
            except self._zmq_again:
                return True
            message = channel.decode_to_engine(frame)
            if isinstance(message, channel.Stop):
                self.engine.abort_request(list(self.engine.scheduler.requests))
                return False
            self._handle(message)

    def _handle(self, message) -> None:
        engine = self.engine
        if isinstance(message, channel.Abort):
            for request_id in message.request_ids:
                if self._compiling.pop(request_id, None) is None:
                    engine.abort_request(request_id)
        elif isinstance(message, channel.Finish):
            engine.finish_sample(message.request_id, message.index)
        elif isinstance(message, channel.Add):
            core = message.request
            params = core.sampling_params
            if params is not None and params.structured_outputs is not None:
                compiling = self._grammars.submit(params.structured_outputs)
                self._compiling[core.request_id] = (compiling, core)
            else:
                self._add(core, None)
        elif isinstance(message, channel.Call):
            self._call(message)

    def _add_compiled(self) -> None:
        for request_id, (compiling, core) in list(self._compiling.items()):
            outcome = self._grammars.outcome(compiling)
            if outcome is None:
                continue  # still compiling, in time
            del self._compiling[request_id]
            if isinstance(outcome, ValueError):
                self._reject(request_id, "bad_request", str(outcome))
            elif isinstance(outcome, BaseException):
                self._reject(request_id, "failed", repr(outcome))
            else:
                self._add(core, outcome)

    def _add(self, core: EngineCoreRequest, grammar) -> None:
        request_id = core.request_id
        try:
            self.engine.add_core_request(core, grammar=grammar)
        except ValueError as e:
            self._reject(request_id, "bad_request", str(e))
            return
        except Exception as e:  # noqa: BLE001 - one request's failure, not the engine's
            logger.error("request %s failed: %r", request_id, e, exc_info=e)
            self.engine.abort_request(request_id)
            self._reject(request_id, "failed", f"request {request_id} failed: {e!r}")
            return
        token = self.faults.crash_on_token
        group = self.engine.scheduler.requests[request_id]
        if token is not None and token in group.first.prompt_token_ids:
            self._crash_ids.add(request_id)

    def _reject(self, request_id: str, kind: str, message: str) -> None:
        self.outputs.send(channel.encode(channel.Rejected(request_id, kind, message)))

    def _call(self, message: channel.Call) -> None:
        engine = self.engine
        calls = {
            "kv_snapshot": engine.kv_snapshot,
            "check_lora": engine.check_lora,
            "reset_prefix_cache": engine.reset_prefix_cache,
            # Diagnostics (a soak, a leak hunt): engine/diagnostics.py.
            "memory_report": diagnostics.memory_report,
            "leak_report": self._leak_report,
            "make_pool_resident": self._make_pool_resident,
        }
        try:
            value, ok = calls[message.method](*channel.unpack(message.args)), True
        except Exception as e:  # noqa: BLE001 - the caller's error, not the engine's
            value, ok = f"{type(e).__name__}: {e}", False
        reply = channel.Reply(message.call_id, ok, channel.pack(value))
        self.outputs.send(channel.encode(reply))

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

    def _send_outputs(self, step_outputs: list) -> None:
        engine = self.engine
        message = channel.Outputs(step_outputs, engine.stats(), engine.lora_stats(), self.num_steps)
        self.outputs.send(channel.encode(message))

    def _inject_faults(self) -> None:
        faults = self.faults
        if faults.hang_at_step is not None and self.num_steps == faults.hang_at_step:
            logger.warning("injected fault: step %d hangs", self.num_steps)
            time.sleep(faults.hang_seconds)
        if self._crash_ids & set(self.engine.scheduler.requests):
            logger.warning("injected fault: a request crashes the engine process")
            os.abort()
