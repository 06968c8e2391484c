"""AsyncLLMEngine: the step loop on one thread, a stream of outputs per request.

The loop runs on a background thread, or (`start_thread=False`) on whichever thread calls
`run_loop()`: `pagedllm serve` gives it the main thread and serves HTTP from another, because
oneDNN's bf16 matmuls run about 1.7x slower off the main thread (docs/performance.md).
Every engine call happens on the loop's thread: `generate` and `abort` only post commands, which the
loop applies between two steps. So an abort never lands between scheduling a step and running it
(the blocks a scheduled step registers in the prefix cache are always written), and the engine
needs no locks. Outputs reach each request's asyncio queue through its event loop. If a step
raises, the loop stops, every open stream gets an `EngineDeadError`, and so does every later call.
A failure tied to one request (adding it, or processing its output) ends that request only, with
a `RequestFailedError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator

from pagedllm.engine.core_request import EngineCoreRequest, as_core_request
from pagedllm.engine.grammar_compile import GRAMMAR_COMPILE_TIMEOUT, GrammarCompiler
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.engine.streams import (
    MAX_STREAM_BACKLOG,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
)
from pagedllm.heap import trim_heap
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")

__all__ = ["AsyncLLMEngine", "EngineDeadError", "RequestFailedError"]


class AsyncLLMEngine:
    def __init__(
        self,
        engine: LLMEngine,
        start_thread: bool = True,
        grammar_compile_timeout: float = GRAMMAR_COMPILE_TIMEOUT,
        max_stream_backlog: int = MAX_STREAM_BACKLOG,
    ) -> None:
        """`max_stream_backlog`: unread outputs a request's stream holds before the request is
        aborted (0: no bound; engine/streams.py)."""
        self.engine = engine
        self.max_stream_backlog = max_stream_backlog
        self._grammars = GrammarCompiler(engine.compile_grammar, grammar_compile_timeout)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self.dead_error: BaseException | None = None
        self._stopping = False
        self._loop_done = threading.Event()
        self._thread = None
        if start_thread:
            self._thread = threading.Thread(
                target=self.run_loop, name="pagedllm-engine", daemon=True
            )
            self._thread.start()

    # -- the API (any thread, any event loop) --------------------------------------------------
    @property
    def has_loop_thread(self) -> bool:
        """False when the owner must call run_loop() (start_thread=False)."""
        return self._thread is not None

    @property
    def is_running(self) -> bool:
        return not self._loop_done.is_set() and self.dead_error is None

    @property
    def is_restarting(self) -> bool:
        """Never: an engine in this process is not restarted (engine/core_client.py is)."""
        return False

    def check_health(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine loop has stopped: {self.dead_error!r}")
        try:  # a lost worker can leave the loop waiting in a collective, still "running"
            self.engine.check_workers()
        except RuntimeError as e:
            raise EngineDeadError(str(e)) from None

    async def generate(
        self,
        prompt: PromptType | EngineCoreRequest,
        params: SamplingParams | PoolingParams,
        request_id: str,
        delta: bool = False,
        cache_salt: str | None = None,
        lora_request=None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes (an embedding request, PoolingParams:
        its one PoolingRequestOutput). Bad input raises ValueError on the first
        iteration. Leaving the loop early (a client disconnects, the task is cancelled) aborts
        the request, which frees its blocks before the next step."""
        self.check_health()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        core = as_core_request(
            self.engine.tokenizer, prompt, params, request_id,
            cache_salt=cache_salt, lora_request=lora_request, priority=priority,
        )  # fmt: skip
        grammar = None
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            grammar = await self._grammars.compile(params.structured_outputs)
        stream = RequestStream(request_id, self.abort, self.max_stream_backlog)
        self._streams[request_id] = stream
        # The loop may have died (or been stopped) between the check above and registering the
        # stream, after telling the streams it knew of: nobody would answer this one.
        if self.dead_error is not None or self._stopping or self._loop_done.is_set():
            self._streams.pop(request_id, None)
            self.check_health()
            raise EngineDeadError("the server is shutting down")
        self._commands.put(("add", core, delta, grammar))
        try:
            async for output in stream.outputs():
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not stream.ended:  # the caller left early: free what the engine holds
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def kv_snapshot(self, check: bool = False) -> dict:
        """`LLMEngine.kv_snapshot`, taken by the loop between two steps (the pool is never seen
        half-updated); it waits at most one step."""
        self.check_health()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("snapshot", future, check))
        if self._loop_done.is_set():  # stopped after the check: nobody will take the command
            self.check_health()
        return await asyncio.wrap_future(future)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Abort whatever is in flight and stop the loop."""
        self._stopping = True
        self._commands.put(("stop",))
        self._loop_done.wait(timeout)
        self._grammars.shutdown()

    # -- the loop (its own thread) -------------------------------------------------------------
    def run_loop(self) -> None:
        """Step the engine until shutdown() or a failure (the background thread's target, or
        called by the owner with start_thread=False)."""
        try:
            self._run()
        finally:
            self.engine.shutdown()  # tensor-parallel workers stop with the loop
            self._loop_done.set()
            self._fail_pending_snapshots()

    def _fail_pending_snapshots(self) -> None:
        """Snapshots asked for after the last command the loop took (their callers wait)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "snapshot" and command[1].set_running_or_notify_cancel():
                command[1].set_exception(EngineDeadError("the engine loop has stopped"))

    def _run(self) -> None:
        engine = self.engine
        busy = False
        try:
            while True:
                # Block for work when idle; between steps, take whatever has arrived.
                block = not engine.has_unfinished_requests()
                if block and busy:
                    trim_heap()  # the load is gone: give its freed heap pages back
                busy = not block
                if not self._apply_commands(block):
                    return
                if engine.has_unfinished_requests():
                    for output in engine.step():
                        stream = self._streams.get(output.request_id)
                        if stream is None:
                            continue
                        item = output if output.error is None else RequestFailedError(output.error)
                        if not stream.put(item) and not output.finished:
                            self._streams.pop(output.request_id, None)
                            engine.abort_request(output.request_id)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the clients
            logger.exception("the engine loop died")
            self.dead_error = e
            error = EngineDeadError(f"the engine loop died: {e!r}")
            for stream in list(self._streams.values()):
                stream.put(error)

    def _apply_commands(self, block: bool) -> bool:
        """Apply pending commands (waiting for one if `block`); False once told to stop."""
        engine = self.engine
        while True:
            try:
                command = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                if block and not self._stopping:
                    engine.check_workers()  # idle: a dead worker still stops the loop (/health)
                    continue
                return not self._stopping
            block = False
            kind = command[0]
            if kind == "stop":
                ids = list(engine.scheduler.requests)
                engine.abort_request(ids)
                # A snapshot: the event loop's threads remove streams as their clients leave.
                for stream in list(self._streams.values()):
                    stream.put(EngineDeadError("the server is shutting down"))
                return False
            if kind == "abort":
                engine.abort_request(command[1])
                continue
            if kind == "snapshot":
                _, future, check = command
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(engine.kv_snapshot(check))
                    except Exception as e:  # noqa: BLE001 - the caller's error, not the loop's
                        future.set_exception(e)
                continue
            _, core, delta, grammar = command
            request_id = core.request_id
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # its client left before the request was added
            try:
                engine.add_core_request(core, delta, grammar)
            except ValueError as e:
                stream.put(e)
            except Exception as e:  # noqa: BLE001 - one request's failure, not the engine's
                logger.error("request %s failed: %r", request_id, e, exc_info=e)
                engine.abort_request(request_id)
                stream.put(RequestFailedError(f"request {request_id} failed: {e!r}"))
