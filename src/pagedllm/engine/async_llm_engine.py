"""AsyncLLMEngine: the engine loop on one thread of this process, a stream of outputs per
request.

The loop is EngineCore's (engine/engine_core.py), the same the engine process runs, here with
a queue for its inbox and this object for its outbox. It runs on a background thread, or
(`start_thread=False`) on whichever thread calls `run_loop()`: `pagedllm serve
--no-engine-process` gives it the main thread and serves HTTP from another, because oneDNN's
bf16 matmuls run about 1.7x slower off the main thread (docs/performance.md). `generate` and
`abort` only post messages, which the loop applies between two steps. The engine's outputs
(token ids) become RequestOutputs in this side's output processor (engine/output_processor.py),
on the loop's thread, and reach each request's asyncio queue through its event loop. If a step
raises, the loop stops, every open stream gets an `EngineDeadError`, and so does every later
call. A failure tied to one request (adding it, or processing its output) ends that request
only, with a `RequestFailedError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator

from pagedllm.engine import core_channel as channel
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.grammar_compile import GRAMMAR_COMPILE_TIMEOUT
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.streams import (
    MAX_STREAM_BACKLOG,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
    rejection,
    settle,
)
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import EngineCoreRequest, as_core_request
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")

__all__ = ["AsyncLLMEngine", "EngineDeadError", "RequestFailedError"]


class QueueInbox:
    """The loop's messages from this process's threads (no encoding: the objects as sent)."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, message) -> None:
        self.queue.put(message)

    def take(self, timeout: float) -> list:
        try:
            messages = [self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                messages.append(self.queue.get_nowait())
            except queue.Empty:
                return messages


class AsyncLLMEngine:
    def __init__(
        self,
        engine: LLMEngine,
        start_thread: bool = True,
        grammar_compile_timeout: float = GRAMMAR_COMPILE_TIMEOUT,
        max_stream_backlog: int = MAX_STREAM_BACKLOG,
    ) -> None:
        """`max_stream_backlog`: unread outputs a request's stream holds before the request is
        aborted (0: no bound; engine/streams.py). The engine's outputs are processed here from
        now on (its own output processor moves to this object)."""
        self.engine = engine
        self.max_stream_backlog = max_stream_backlog
        self.output_processor = engine.output_processor or OutputProcessor(
            engine.tokenizer, engine.finish_sample
        )
        engine.output_processor = None
        self._inbox = QueueInbox()
        self.core = EngineCore(engine, self._inbox, self, grammar_compile_timeout)
        self._streams: dict[str, RequestStream] = {}
        self._deltas: dict[str, bool] = {}  # until the loop adds the request
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
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
        stream = RequestStream(request_id, self.abort, self.max_stream_backlog)
        self._streams[request_id] = stream
        # The loop may have died (or been stopped) between the check above and registering the
        # stream, after telling the streams it knew of: nobody would answer this one.
        if self.dead_error is not None or self._stopping or self._loop_done.is_set():
            self._streams.pop(request_id, None)
            self.check_health()
            raise EngineDeadError("the server is shutting down")
        self._deltas[request_id] = delta
        self._inbox.put(channel.Add(core))
        try:
            async for output in stream.outputs():
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not stream.ended:  # the caller left early: free what the engine holds
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(channel.Abort([request_id]))

    async def kv_snapshot(self, check: bool = False) -> dict:
        """`LLMEngine.kv_snapshot`, taken by the loop between two steps (the pool is never seen
        half-updated); it waits at most one step."""
        return await asyncio.wrap_future(self._call("kv_snapshot", check))

    def call_blocking(self, method: str, *args, timeout: float = 120.0):
        """One of the loop's calls (EngineCore.calls), from a thread that may block."""
        return self._call(method, *args).result(timeout)

    def _call(self, method: str, *args) -> concurrent.futures.Future:
        self.check_health()
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        self._inbox.put(channel.Call(call_id, method, list(args)))
        if self._loop_done.is_set():  # stopped after the check: nobody will take the call
            self._fail_pending_calls()
        return future

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Abort whatever is in flight and stop the loop."""
        self._stopping = True
        self._inbox.put(channel.Stop())
        self._loop_done.wait(timeout)

    # -- the loop (its own thread) -------------------------------------------------------------
    def run_loop(self) -> None:
        """Step the engine until shutdown() or a failure (the background thread's target, or
        called by the owner with start_thread=False)."""
        error = EngineDeadError("the engine loop has stopped")
        try:
            self.core.run()
            error = EngineDeadError("the server is shutting down")
        except BaseException as e:  # noqa: BLE001 - every failure must reach the clients
            logger.exception("the engine loop died")
            self.dead_error = e
            error = EngineDeadError(f"the engine loop died: {e!r}")
        finally:
            # A snapshot: the event loops' threads remove streams as their clients leave.
            for stream in list(self._streams.values()):
                stream.put(error)
            self.engine.shutdown()  # tensor-parallel workers stop with the loop
            self._loop_done.set()
            self._fail_pending_calls()

    def _fail_pending_calls(self) -> None:
        """Calls made after the last message the loop took (their callers wait)."""
        for call_id in list(self._calls):
            future = self._calls.pop(call_id, None)
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError("the engine loop has stopped"))

    # -- the loop's outbox (on its thread) -----------------------------------------------------
    def deliver(self, outputs: list, num_steps: int) -> None:
        for output in self.output_processor.process(outputs):
            request_id = output.request_id
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            item = output if output.error is None else RequestFailedError(output.error)
            if not stream.put(item) and not output.finished:  # a client that reads no more
                self._streams.pop(request_id, None)
                self.abort(request_id)  # taken before the next step

    def added(self, core: EngineCoreRequest) -> None:
        self.output_processor.add_request(core, self._deltas.pop(core.request_id, False))

    def reject(self, request_id: str, kind: str, message: str) -> None:
        self._deltas.pop(request_id, None)
        self.output_processor.remove([request_id])
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(rejection(kind, message))

    def reply(self, call_id: int, ok: bool, value) -> None:
        settle(self._calls.pop(call_id, None), ok, value)

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._deltas.pop(request_id, None)
        self.output_processor.remove(request_ids)
