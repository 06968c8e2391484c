"""The engine process: an LLMEngine (scheduler, KV cache, model, tensor-parallel workers) that
steps on its main thread and talks to the API server over ZMQ (engine/core_channel.py;
engine/core_client.py is the other end). The loop is EngineCore's (engine/engine_core.py),
here with a ZMQ inbox and outbox: every step's outputs (EngineCoreOutputs: token ids, the
server's side makes the text) go out with the engine's counters; idle, the counters go out
every HEARTBEAT seconds, so the server can tell a hung step (no message while requests are in
flight) from an idle engine. If the loop raises, it sends a Fatal message and exits; the
server starts another process. With tensor-parallel workers, a thread exits the process when
one of them is gone (`_watch_workers`)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from pagedllm.config import EngineArgs
from pagedllm.engine import core_channel as channel
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.faults import Faults
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.logger import init_logger
from pagedllm.procs import die_with_parent
from pagedllm.request import EngineCoreRequest

logger = logging.getLogger("pagedllm")

WORKER_WATCH_PERIOD = 0.5  # seconds between two looks at the tensor-parallel workers


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
    core = EngineCoreProc(engine, inputs, outputs, grammar_compile_timeout, faults)
    ready = channel.Ready(
        os.getpid(), engine.stats(), engine.lora_stats(), engine.config.device.device
    )
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


class ZmqInbox:
    """The server's messages, from the engine process's PULL socket."""

    def __init__(self, socket) -> None:
        import zmq

        self.socket = socket
        self._poller = zmq.Poller()
        self._poller.register(socket, zmq.POLLIN)
        self._again = zmq.Again
        self._noblock = zmq.NOBLOCK

    def take(self, timeout: float) -> list:
        if not self._poller.poll(timeout * 1000):
            return []
        messages = []
        while True:
            try:
                frame = self.socket.recv(self._noblock)
            except self._again:
                return messages
            messages.append(channel.decode_to_engine(frame))


class ZmqOutbox:
    """What the engine says back, on the engine process's PUSH socket, with its counters."""

    def __init__(self, socket, engine: LLMEngine) -> None:
        self.socket = socket
        self.engine = engine

    def deliver(self, outputs: list, num_steps: int) -> None:
        engine = self.engine
        message = channel.Outputs(outputs, engine.stats(), engine.lora_stats(), num_steps)
        self.socket.send(channel.encode(message))

    def added(self, core: EngineCoreRequest) -> None:
        pass  # the server's side tracks it since it sent it

    def reject(self, request_id: str, kind: str, message: str) -> None:
        self.socket.send(channel.encode(channel.Rejected(request_id, kind, message)))

    def reply(self, call_id: int, ok: bool, value) -> None:
        self.socket.send(channel.encode(channel.Reply(call_id, ok, value)))

    def forget(self, request_ids: list[str]) -> None:
        pass  # the server forgot them first


class EngineCoreProc(EngineCore):
    """The loop, with the faults a test injects."""

    def __init__(self, engine: LLMEngine, inputs, outputs, grammar_timeout: float, faults):
        super().__init__(engine, ZmqInbox(inputs), ZmqOutbox(outputs, engine), grammar_timeout)
        self.faults = faults or Faults()
        self._crash_ids: set[str] = set()

    def add(self, core: EngineCoreRequest, grammar) -> None:
        super().add(core, grammar)
        token = self.faults.crash_on_token
        group = self.engine.scheduler.requests.get(core.request_id)
        if token is not None and group is not None and token in group.first.prompt_token_ids:
            self._crash_ids.add(core.request_id)

    def before_step(self) -> None:
        faults = self.faults
        if faults.hang_at_step is not None and self.num_steps == faults.hang_at_step:
            logger.warning("injected fault: step %d hangs", self.num_steps)
            time.sleep(faults.hang_seconds)
        if self._crash_ids and not self._crash_ids.isdisjoint(self.engine.scheduler.requests):
            logger.warning("injected fault: a request crashes the engine process")
            os.abort()
