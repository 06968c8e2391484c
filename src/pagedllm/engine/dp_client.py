"""Data parallelism behind one API server (`--data-parallel-size N`): N replicas of the whole
engine, each in its own engine process (engine/core_client.py: restarted on failure, its own KV
cache and its share of the CPU cores), and a balancer in front that sends each request to a
replica.

The balancer picks the replica with the fewest unfinished requests (waiting + running, as this
server counts them: exact and current, where the engines' own gauges lag a step); among equally
loaded replicas, the one that most recently served the longest prefix of this prompt (its
prefix cache probably still holds it), else the next in turn. A replica that is restarting or
dead gets nothing new while another can take the request; /health is 200 while any replica
serves.

The serving layer sees one engine: counters summed over the replicas (engine_stats() keeps them
apart, for metrics labelled per engine), the tokenizer and config of replica 0 (all are the
same model).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections import OrderedDict
from collections.abc import AsyncIterator

from pagedllm.config import EngineArgs
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.engine.counters import sum_counters
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.stats import EngineStats
from pagedllm.engine.streams import EngineDeadError
from pagedllm.outputs import RequestOutput
from pagedllm.request import EngineCoreRequest, PromptType

# Prefix affinity: a prompt's prefixes at these lengths (characters of a text prompt, tokens of
# a tokenized one), each remembered for the replica last sent it, up to AFFINITY_ENTRIES.
AFFINITY_LENGTHS = (32, 128, 512, 2048)
AFFINITY_ENTRIES = 4096


def prefix_keys(prompt: PromptType | EngineCoreRequest) -> list[bytes]:
    """Digests of the prompt's leading pieces, longest first (a short prompt: itself)."""
    if isinstance(prompt, EngineCoreRequest):
        prompt = prompt.prompt_token_ids
    elif isinstance(prompt, dict):
        prompt = prompt.get("prompt_token_ids") or prompt.get("prompt") or ""
    lengths = {*(n for n in AFFINITY_LENGTHS if n < len(prompt)), len(prompt)}
    keys = []
    for n in sorted(lengths, reverse=True):
        piece = prompt[:n]
        raw = piece.encode() if isinstance(piece, str) else b",".join(b"%d" % t for t in piece)
        keys.append(hashlib.blake2b(raw, digest_size=12).digest())
    return keys


class DataParallelClient:
    """N engine processes behind one async-engine interface (as EngineCoreClient's)."""

    def __init__(self, args: EngineArgs, **client_kwargs) -> None:
        """Start the replicas one after another, on this thread (each engine process dies
        with the thread that starts it: build this on the main thread)."""
        size = args.data_parallel_size
        local = dataclasses.replace(args, data_parallel_size_local=size)
        self.replicas: list[EngineCoreClient] = []
        try:
            for rank in range(size):
                replica_args = dataclasses.replace(local, data_parallel_rank=rank)
                self.replicas.append(EngineCoreClient(replica_args, **client_kwargs))
        except BaseException:
            self.shutdown(2.0)
            raise
        self.engine = EngineInfo(self, args)
        self.engine.resolve_device(self.replicas[0].engine.config.device.device)
        self._load = [0] * size  # unfinished requests sent to each replica
        self._owner: dict[str, int] = {}  # request id -> replica
        self._affinity: OrderedDict[bytes, int] = OrderedDict()
        self._turn = itertools.count()
        self.routed = [0] * size  # requests sent to each replica so far

    # -- the async engine's API ---------------------------------------------------------------
    @property
    def has_loop_thread(self) -> bool:
        return True

    @property
    def is_running(self) -> bool:
        return any(r.is_running for r in self.replicas)

    @property
    def is_restarting(self) -> bool:
        """Every replica still alive is restarting: nothing can serve now."""
        live = [r for r in self.replicas if r.is_running]
        return bool(live) and all(r.is_restarting for r in live)

    @property
    def lora_stats(self) -> dict | None:
        return self.replicas[0].lora_stats

    def check_health(self) -> None:
        errors = []
        for r in self.replicas:
            try:
                r.check_health()
                return
            except EngineDeadError as e:
                errors.append(e)
        raise errors[0]

    def pick(self, prompt: PromptType | EngineCoreRequest) -> int:
        """The replica for a new request: least loaded, then prefix affinity, then in turn."""
        serving = [i for i, r in enumerate(self.replicas) if r.is_running]
        ready = [i for i in serving if not self.replicas[i].is_restarting] or serving
        if not ready:
            self.check_health()  # raises: every replica is dead
        least = min(self._load[i] for i in ready)
        tied = [i for i in ready if self._load[i] == least]
        keys = prefix_keys(prompt)
        choice = next((self._affinity[k] for k in keys if self._affinity.get(k) in tied), None)
        if choice is None:
            choice = tied[next(self._turn) % len(tied)]
        for k in keys:
            self._affinity[k] = choice
            self._affinity.move_to_end(k)
        while len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        return choice

    async def generate(
        self, prompt: PromptType | EngineCoreRequest, params, request_id: str, *args, **kwargs
    ) -> AsyncIterator[RequestOutput]:
        """As EngineCoreClient.generate, on the replica pick() chooses."""
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        index = self.pick(prompt)
        self._owner[request_id] = index
        self._load[index] += 1
        self.routed[index] += 1
        try:
            async for output in self.replicas[index].generate(
                prompt, params, request_id, *args, **kwargs
            ):
                yield output
        finally:
            self._load[index] -= 1
            del self._owner[request_id]

    def abort(self, request_id: str) -> None:
        index = self._owner.get(request_id)
        if index is not None:
            self.replicas[index].abort(request_id)

    async def kv_snapshot(self, check: bool = False, engine: int = 0) -> dict:
        """Replica `engine`'s KV cache snapshot."""
        return await self.replicas[engine].kv_snapshot(check)

    def call_blocking(self, method: str, *args, timeout: float = 120.0):
        """A call every replica answers alike (check_lora): replica 0's answer."""
        return self.replicas[0].call_blocking(method, *args, timeout=timeout)

    def get_stats(self) -> dict:
        """Counters summed over the replicas (fractions averaged)."""
        readings = [r.get_stats() for r in self.replicas]
        stats = sum_counters(readings)
        for key in EngineStats.MEANS & stats.keys():
            stats[key] /= len(readings)
        return stats

    def engine_stats(self) -> dict[str, dict]:
        """Each replica's counters, by its data-parallel rank."""
        return {k: v for r in self.replicas for k, v in r.engine_stats().items()}

    def shutdown(self, timeout: float | None = 10.0) -> None:
        for r in self.replicas:
            r.shutdown(timeout)
