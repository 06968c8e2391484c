"""The API server's side of the engine process (engine/core_proc.py): the async engine the
serving layer calls (generate, abort, kv_snapshot, check_health, the engine's counters), with
the engine itself in another process, restarted when it fails.

A thread here reads the engine's messages and hands each output to its request's stream; it
also watches the process. When the process dies (a crash, a kill, the OOM killer, a lost
tensor-parallel worker) or stops making progress (no step finished for `step_timeout` seconds
while requests are in flight), it starts another one and resubmits every unfinished request
with the output it has handed out so far (a recompute preemption across processes, see
LLMEngine.add_request's `resumed`): open streams go on where they were, with no token lost or
repeated. Requests of several sequences (n > 1, best_of > 1, beam search) cannot resume: they
start over if nothing of theirs was handed out yet, else fail with a RequestFailedError.
Meanwhile `is_restarting` is True (/health answers 503) and new requests wait for the new
process. Poison requests (one that crashes or hangs every engine that runs it) are found by
probation: a request in flight at POISON_FAULTS failures blamed on requests (a crash or a hang,
not a kill from outside) runs again only alone among such requests, one at a time; if the
engine fails while it runs so, it is failed with a clear error and not retried, and the
others go on. More than `max_restarts` restarts within RESTART_WINDOW seconds: the engine is
declared dead, as an in-process one whose loop died.

The engine reports token ids (EngineCoreOutputs); the output processor here makes the text,
stops a sequence at its stop string (telling the engine), and assembles whole or delta outputs,
off the engine's thread. A resume sends back the token ids it handed out, nothing else.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import tempfile
import threading
from collections.abc import AsyncIterator

import msgspec

from pagedllm.config import EngineArgs
from pagedllm.engine import core_channel as channel
from pagedllm.engine.core_launch import EngineLaunch
from pagedllm.engine.core_supervisor import MAX_RESTARTS, RESTART_WINDOW, EngineProcess
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.faults import Faults
from pagedllm.engine.grammar_compile import GRAMMAR_COMPILE_TIMEOUT
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.stats import EngineStats
from pagedllm.engine.streams import (
    MAX_STREAM_BACKLOG,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
    rejection,
    settle,
)
from pagedllm.engine.tracked_request import TrackedRequest
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import EngineCoreRequest, PromptType, as_core_request
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")

STEP_TIMEOUT = 120.0  # seconds without a finished step, requests in flight: a hung engine
STARTUP_TIMEOUT = 600.0  # seconds an engine process may take to load its model
POISON_FAULTS = 2  # blamed failures a request was in flight for before its probation


class EngineCoreClient:
    def __init__(
        self,
        args: EngineArgs,
        *,
        step_timeout: float = STEP_TIMEOUT,
        max_restarts: int = MAX_RESTARTS,
        startup_timeout: float = STARTUP_TIMEOUT,
        grammar_compile_timeout: float = GRAMMAR_COMPILE_TIMEOUT,
        max_stream_backlog: int = MAX_STREAM_BACKLOG,
        faults: Faults | None = None,
        launched: EngineLaunch | None = None,
    ) -> None:
        """Start the engine process (or adopt `launched`, started early with the same args)
        and wait until its model is loaded (RuntimeError if it cannot start). `faults`:
        injected into the engine processes, for tests. The process
        dies with the thread that starts it (PR_SET_PDEATHSIG): build the client on a thread
        that lives as long as it (the main thread); restarts start from the client's own."""
        import zmq

        self.engine = EngineInfo(self, args)
        self.step_timeout = step_timeout
        self.max_restarts = max_restarts
        self.max_stream_backlog = max_stream_backlog
        self.dead_error: BaseException | None = None
        self.num_restarts = 0
        self.lora_stats: dict | None = None
        self._zmq = zmq
        socket_dir = launched.socket_dir if launched else tempfile.mkdtemp(prefix="pagedllm-")
        self._process = EngineProcess(args, socket_dir, grammar_compile_timeout, faults,
                                      startup_timeout, max_restarts)  # fmt: skip
        self._lock = threading.RLock()  # the request table, the input socket, the state
        self._tracked: dict[str, TrackedRequest] = {}
        self.output_processor = OutputProcessor(self.engine.tokenizer, self._finish)
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._stats = EngineStats()
        self._carried = EngineStats()  # the totals of the processes before this one
        self._state = "starting"  # running | restarting | dead | stopped
        self._start_process(launched)
        self._state = "running"
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine-io", daemon=True)
        self._thread.start()
        # Before multiprocessing's own exit hook, which would wait for the engine process.
        atexit.register(self.shutdown, 2.0)

    # -- the async engine's API ---------------------------------------------------------------
    @property
    def has_loop_thread(self) -> bool:
        return True

    @property
    def is_running(self) -> bool:
        return self._state in ("running", "restarting")

    @property
    def is_restarting(self) -> bool:
        return self._state == "restarting"

    @property
    def pid(self) -> int | None:
        """The engine process's pid."""
        proc = self._process.proc
        return proc.pid if proc is not None else None

    def check_health(self) -> None:
        if self._state == "stopped":
            raise EngineDeadError("the server is shutting down")
        if self._state == "dead":
            raise EngineDeadError(f"the engine process has stopped: {self.dead_error!r}")

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
        """As AsyncLLMEngine.generate."""
        self.check_health()
        core = as_core_request(
            self.engine.tokenizer, prompt, params, request_id,
            cache_salt=cache_salt, lora_request=lora_request, priority=priority,
        )  # fmt: skip
        try:  # what cannot cross fails here, as bad input; the first send sends this frame
            frame = channel.encode(channel.Add(core))
        except (RecursionError, TypeError, msgspec.EncodeError) as e:
            raise ValueError(
                f"the request cannot be sent to the engine ({e}): it is nested too deeply "
                "or holds what cannot be serialized"
            ) from None
        stream = RequestStream(request_id, self.abort, self.max_stream_backlog)
        tracked = TrackedRequest(core, stream)
        with self._lock:
            self.check_health()
            if request_id in self._tracked:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._tracked[request_id] = tracked
            self.output_processor.add_request(core, delta)
            if self._state == "running":
                tracked.sent = self._send(frame)
        try:
            async for output in stream.outputs():
                yield output
        finally:
            if not stream.ended:  # the caller left early
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            tracked = self._forget(request_id)
            if tracked is not None and tracked.sent and self._state == "running":
                self._send(channel.Abort([request_id]))

    async def kv_snapshot(self, check: bool = False) -> dict:
        return await asyncio.wrap_future(self._call("kv_snapshot", check))

    def call_blocking(self, method: str, *args, timeout: float = 120.0):
        return self._call(method, *args).result(timeout)

    def get_stats(self) -> dict:
        """The engine's latest counters; totals summed over every engine process so far."""
        stats = self._carried.plus(self._stats).as_dict()
        stats["num_engine_restarts_total"] = self.num_restarts
        return stats

    def engine_stats(self) -> dict[str, dict]:
        """The counters by data-parallel rank (this engine's alone)."""
        return {str(self.engine.config.parallel.data_parallel_rank): self.get_stats()}

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Abort what is in flight and stop the engine process (and this side's thread)."""
        with self._lock:
            if self._state == "stopped":
                return
            running = self._state == "running"
            self._state = "stopped"
            if running:
                self._send(channel.Stop())
            self._fail_all(EngineDeadError("the server is shutting down"))
        atexit.unregister(self.shutdown)
        self._process.stop(timeout or 0)
        if threading.current_thread() is not self._thread:
            self._thread.join(5)
        self._process.context.destroy(linger=0)

    # -- sending (under the lock) ---------------------------------------------------------------
    def _send(self, message) -> bool:
        """Send without blocking (a message, or its encoded frame); False when the engine
        process is gone (its socket has no peer: a blocking send would wait, holding the lock,
        for ever). The request it carried is resubmitted to the next process, like every
        unfinished one."""
        frame = message if isinstance(message, bytes) else channel.encode(message)
        return self._process.send(frame, lambda: self._state == "running")

    def _send_add(self, t: TrackedRequest) -> None:
        """Resubmit `t` to a new engine process, with what it had handed out."""
        resumed = self.output_processor.resumed_output(t.request.request_id)
        t.sent = self._send(channel.Add(msgspec.structs.replace(t.request, resumed=resumed)))

    def _finish(self, request_id: str, index: int | None) -> None:
        """The output processor ended a sample (a stop string) or the whole request: the
        engine process stops computing it."""
        t = self._tracked.get(request_id)
        if t is not None and t.sent and self._state == "running":
            self._send(channel.Finish(request_id, index))

    def _forget(self, request_id: str) -> TrackedRequest | None:
        """Drop a request that ended or was aborted; a request on probation that ends lets the
        next one run."""
        self.output_processor.remove([request_id])
        t = self._tracked.pop(request_id, None)
        if t is not None and t.probation and t.sent and self._state == "running":
            self._submit_waiting()
        return t

    def _submit_waiting(self) -> None:
        """Send what waits (after a restart), in arrival order: every request not on
        probation, and the first on probation unless one of them runs already."""
        waiting = sorted((t for t in self._tracked.values() if not t.sent),
                         key=lambda t: t.request.arrival_time)  # fmt: skip
        probation_running = any(t.sent and t.probation for t in self._tracked.values())
        for t in waiting:
            if t.probation:
                if probation_running:
                    continue
                probation_running = True
            self._send_add(t)

    def _call(self, method: str, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self.check_health()
            if self._state != "running":
                raise EngineDeadError("the engine process is restarting")
            call_id = next(self._call_ids)
            self._calls[call_id] = future
            if not self._send(channel.Call(call_id, method, list(args))):
                del self._calls[call_id]
                raise EngineDeadError("the engine process is restarting")
        return future

    # -- the engine process ---------------------------------------------------------------------
    def _start_process(self, launched: EngineLaunch | None = None) -> None:
        ready = self._process.start(launched)
        self._stats, self.lora_stats = ready.stats, ready.lora_stats
        self.engine.resolve_device(ready.device)

    # -- the thread: outputs, watching, restarting ---------------------------------------------
    def _run(self) -> None:
        while self._state not in ("stopped", "dead"):
            try:
                if self._process.output.poll(100):
                    self._take_messages()
            except self._zmq.ZMQError:
                if self._state in ("stopped", "dead"):
                    return
                raise
            in_flight = any(t.sent for t in self._tracked.values()) or bool(self._calls)
            failure = self._process.failure(in_flight, self.step_timeout)
            if failure is not None and self._state == "running":
                self._restart(*failure)

    def _take_messages(self) -> None:
        process = self._process
        while (message := process.receive()) is not None:
            if isinstance(message, channel.Outputs):
                self._stats, self.lora_stats = message.stats, message.lora_stats
                process.stepped = process.stepped or message.num_steps > 0
                if message.outputs:
                    self._deliver(message.outputs)
            elif isinstance(message, channel.Rejected):
                with self._lock:
                    tracked = self._forget(message.request_id)
                if tracked is not None:
                    tracked.stream.put(rejection(message.kind, message.message))
            elif isinstance(message, channel.Reply):
                future = self._calls.pop(message.call_id, None)
                settle(future, message.ok, message.value)
            elif isinstance(message, channel.Fatal):
                process.fatal = message

    def _deliver(self, core_outputs: list) -> None:
        with self._lock:  # the processor's requests are added and aborted under it too
            delivered = []
            for output in self.output_processor.process(core_outputs):
                t = self._tracked.get(output.request_id)
                if t is None:
                    continue
                if output.finished:
                    self._forget(output.request_id)
                t.handed_out = True
                delivered.append((t, output))
        for t, output in delivered:
            error = getattr(output, "error", None)
            t.stream.put(output if error is None else RequestFailedError(error))

    def _restart(self, reason: str, blame: bool) -> None:
        logger.error("%s: restarting the engine process", reason)
        with self._lock:
            self._state = "restarting"
            for future in self._calls.values():
                future.set_exception(EngineDeadError(f"{reason}: the call was lost"))
            self._calls.clear()
            self._carry_stats()
            self._sort_out_requests(reason, blame)
        self._process.stop(0)
        while True:
            if not self._process.may_restart():
                self._give_up(f"{reason}; {self.max_restarts} restarts in {RESTART_WINDOW:g} s")
                return
            self.num_restarts += 1
            if self._state == "stopped":
                return
            try:
                self._start_process()
                break
            except RuntimeError as e:
                reason = f"the engine process failed to start again: {e}"
                logger.error("%s", reason)
        with self._lock:
            if self._state == "stopped":
                self._process.stop(0)
                return
            self._state = "running"
            self._submit_waiting()
        logger.info("engine process restarted; %d requests resubmitted", len(self._tracked))

    def _sort_out_requests(self, reason: str, blame: bool) -> None:
        """Fail the requests that cannot go on (under the lock); the others wait to be
        resubmitted."""
        in_flight = [t for t in self._tracked.values() if t.sent]
        for request_id, t in list(self._tracked.items()):
            error = None
            if blame and t.sent:
                t.num_faults += 1
                if t.probation or (t.num_faults >= POISON_FAULTS and len(in_flight) == 1):
                    error = (
                        f"request {request_id} failed: the engine failed {t.num_faults} times "
                        f"while running it (the last: {reason}), the last time with no other "
                        "suspect request: it is not retried"
                    )
                t.probation = t.num_faults >= POISON_FAULTS
            if error is None and not t.resumable and t.handed_out:
                error = (
                    f"request {request_id} was lost with its engine ({reason}) and cannot "
                    "resume: requests of several sequences (n, best_of, beam search) restart "
                    "only before their first output"
                )
            if error is not None:
                del self._tracked[request_id]
                self.output_processor.remove([request_id])
                t.stream.put(RequestFailedError(error))
                continue
            t.sent = False
            if not t.resumable:
                self.output_processor.start_over(request_id)

    def _carry_stats(self) -> None:
        self._carried = self._carried.plus(self._stats.totals())
        self._stats = EngineStats()  # until the next process reports: nothing running

    def _give_up(self, reason: str) -> None:
        logger.error("%s: the engine is not restarted again", reason)
        self.dead_error = RuntimeError(reason)
        with self._lock:
            self._state = "dead"
            self._fail_all(EngineDeadError(f"the engine process has stopped: {reason}"))

    def _fail_all(self, error: BaseException) -> None:
        for t in self._tracked.values():
            t.stream.put(error)
        self._tracked.clear()
        self.output_processor.states.clear()
        for future in self._calls.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        self._calls.clear()
