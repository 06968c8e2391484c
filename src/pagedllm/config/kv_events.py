"""--kv-events-config: the prefix cache's changes published for KV-aware routers (vLLM's JSON).

A JSON object (or a dict, from `LLM(kv_events_config=...)`) with vLLM's fields:
`enable_kv_cache_events` (default false), `publisher` ("zmq"; "null": recorded, not sent),
`endpoint` (where the ZMQ PUB socket binds), `replay_endpoint` (a ROUTER socket that resends
the batches kept, from a sequence number on; null: none), `buffer_steps` (batches kept for
replay), `hwm` (the PUB socket's high-water mark: messages a slow subscriber may queue before it
misses some) and `topic` (the first frame of every message). Unknown fields and bad values are
errors that name the flag. engine/kv_events.py publishes; docs/distributed.md has the format."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedllm.config.json_flag import json_object

FLAG = "--kv-events-config"
PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, value: str | dict | None) -> KVEventsConfig | None:
        """The config from the flag's JSON text or a dict; None when not given or not enabled."""
        value = json_object(value, FLAG, cls)
        if value is None:
            return None
        config = cls(**value)
        config._check()
        return config if config.enable_kv_cache_events else None

    def for_rank(self, rank: int) -> KVEventsConfig:
        """Data-parallel replica `rank`'s sockets: TCP ports offset by the rank (an IPC path
        suffixed with it), so that replicas of one host do not collide."""
        if rank == 0:
            return self
        return dataclasses.replace(
            self,
            endpoint=_offset(self.endpoint, rank),
            replay_endpoint=self.replay_endpoint and _offset(self.replay_endpoint, rank),
        )

    def _check(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"{FLAG}: {what}")

        need(isinstance(self.enable_kv_cache_events, bool), "enable_kv_cache_events is a boolean")
        need(self.publisher in PUBLISHERS, f"publisher must be one of {', '.join(PUBLISHERS)}")
        for name in ("endpoint", "replay_endpoint"):
            address = getattr(self, name)
            ok = address is None or (isinstance(address, str) and "://" in address)
            need(ok, f"{name} must be a ZMQ address such as tcp://*:5557, got {address!r}")
        need(self.endpoint != self.replay_endpoint, "endpoint and replay_endpoint must differ")
        for name in ("buffer_steps", "hwm"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                 f"{name} must be an integer >= 0, got {value!r}")  # fmt: skip
        need(isinstance(self.topic, str), "topic must be a string")


def _offset(address: str, rank: int) -> str:
    scheme, _, rest = address.partition("://")
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        return f"tcp://{host}:{int(port) + rank}"
    return f"{address}_dp{rank}"
