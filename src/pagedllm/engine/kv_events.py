"""Publishing the prefix cache's events (core/kv_events.py) on ZMQ, as vLLM does, for KV-aware
routers: --kv-events-config (config/kv_events.py).

Every step's events go out as one KVEventBatch on a PUB socket bound at `endpoint`, as three
frames: the topic, a sequence number (8 bytes, big-endian, from 0 on for each engine), and the
batch's msgpack. A subscriber that sees a gap in the numbers (PUB drops messages for a subscriber
past `hwm`) asks the ROUTER socket at `replay_endpoint` for the batches from a number on (one
frame: that number, 8 bytes, big-endian; from a DEALER or REQ socket, with REQ's empty
delimiter frame): it answers each batch still kept (the last `buffer_steps`) as (number,
payload) and then (-1, empty payload) to mark the end. A thread owns the sockets, so a step
only hands its batch over (a send never waits for a subscriber)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec

from pagedllm.config.kv_events import KVEventsConfig
from pagedllm.core.kv_events import KVCacheEvent, KVEventBatch

logger = logging.getLogger("pagedllm")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
MAX_QUEUED = 10_000  # batches the thread has not sent yet; more are dropped (and logged)


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None) -> None:
        """Bind the sockets (an address in use is an error now, not in the thread)."""
        import zmq

        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.num_dropped = 0
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(MAX_QUEUED)
        self._context = zmq.Context()
        self._pub = self._replay = None
        if config.publisher == "zmq":
            try:
                self._pub = self._context.socket(zmq.PUB)
                self._pub.setsockopt(zmq.SNDHWM, config.hwm)
                self._pub.bind(config.endpoint)
                if config.replay_endpoint is not None:
                    self._replay = self._context.socket(zmq.ROUTER)
                    self._replay.bind(config.replay_endpoint)
            except zmq.ZMQError as e:
                self._context.destroy(linger=0)
                raise ValueError(f"--kv-events-config: cannot bind {e}") from None
            logger.info("KV cache events: published at %s (topic %r)%s", config.endpoint,
                        config.topic, f", replay at {config.replay_endpoint}"
                        if self._replay is not None else "")  # fmt: skip
        self._thread = threading.Thread(target=self._run, name="pagedllm-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Hand a step's events to the thread (nothing when there are none)."""
        if not events:
            return
        batch = KVEventBatch(time.time(), events, self.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1:
                logger.warning("KV cache events: the publisher fell behind; batches dropped")

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued (within `timeout`), then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        self._context.destroy(linger=0)

    def _run(self) -> None:
        import zmq

        encoder = msgspec.msgpack.Encoder()
        topic = self.config.topic.encode()
        kept: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        seq = 0
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                batch = False
            if batch is None:
                return
            if batch is not False:
                payload = encoder.encode(batch)
                number = seq.to_bytes(8, "big")
                if self._pub is not None:
                    self._pub.send_multipart((topic, number, payload))
                kept.append((seq, payload))
                seq += 1
            if self._replay is not None and poller.poll(0):
                self._answer_replay(kept)

    def _answer_replay(self, kept: deque[tuple[int, bytes]]) -> None:
        import zmq

        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, *delimiter, start = frames
            try:
                first = int.from_bytes(start, "big")
            except ValueError:
                continue
            for seq, payload in kept:
                if seq >= first:
                    self._replay.send_multipart((identity, *delimiter, seq.to_bytes(8, "big"),
                                                 payload))  # fmt: skip
            self._replay.send_multipart((identity, *delimiter, END_OF_REPLAY, b""))
