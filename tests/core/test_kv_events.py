"""KV cache events (core/kv_events.py): replaying them gives the prefix cache's hashes after
every step, through shared prefixes, evictions and a reset; a BlockStored's hashes follow from
its tokens; a batch encodes as vLLM's msgpack shape. No torch."""

import msgspec
import pytest

from pagedllm.config.kv_events import KVEventsConfig
from pagedllm.core.block_hash import hash_block_tokens
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventLog,
)
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from tests.core.test_prefix_caching import make_request, run_to_completion, step


def replay(events, cached: set) -> None:
    """A router's view: apply events to the set of cached hashes, checking them on the way."""
    for event in events:
        if isinstance(event, AllBlocksCleared):
            cached.clear()
        elif isinstance(event, BlockStored):
            bs = event.block_size
            assert len(event.token_ids) == bs * len(event.block_hashes) and event.medium == "CPU"
            parent = event.parent_block_hash
            for i, block_hash in enumerate(event.block_hashes):
                assert block_hash == hash_block_tokens(
                    parent, event.token_ids[i * bs : (i + 1) * bs]
                )
                assert block_hash not in cached
                cached.add(block_hash)
                parent = block_hash
        else:
            assert isinstance(event, BlockRemoved) and event.medium == "CPU"
            for block_hash in event.block_hashes:
                cached.remove(block_hash)  # KeyError: removed what was never stored


def test_replayed_events_are_the_prefix_cache_after_every_step():
    kv = KVCacheManager(12, 4, enable_prefix_caching=True)  # 12 blocks of 4: evictions come
    log = kv.record_events("CPU")
    s = Scheduler(SchedulerConfig(4, 64, 64), kv)
    cached: set = set()
    shared = list(range(100, 108))  # two full blocks every request below starts with
    prompts = [shared + [200 + i] * 5 for i in range(6)] + [list(range(300, 310))]
    kinds = set()
    for i, prompt in enumerate(prompts):
        s.add_request(make_request(prompt, max_tokens=3 + i % 4))
        if i % 2:
            for _ in range(2):
                step(s)
                events = log.take()
                kinds |= {type(e) for e in events}
                replay(events, cached)
                assert cached == set(kv.block_pool.cached_block_hash_to_block)
    while s.has_unfinished_requests():
        step(s)
        replay(log.take(), cached)
        assert cached == set(kv.block_pool.cached_block_hash_to_block)
    assert {BlockStored, BlockRemoved} <= kinds
    assert kv.reset_prefix_cache()
    events = log.take()
    assert events == [AllBlocksCleared()]
    replay(events, cached)
    assert cached == set() == set(kv.block_pool.cached_block_hash_to_block)


def test_a_shared_prefix_is_stored_once_and_runs_chain_onto_it():
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    log = kv.record_events("CPU")
    assert log.take() == [AllBlocksCleared()]  # a new cache: routers drop what they knew
    s = Scheduler(SchedulerConfig(4, 64, 64), kv)
    first = make_request(list(range(100, 112)), max_tokens=1)
    s.add_request(first)
    run_to_completion(s)
    (stored,) = log.take()
    assert stored.block_hashes == first.block_hashes[:3] and stored.parent_block_hash is None
    second = make_request(list(range(100, 108)) + [7, 7, 7, 7, 7], max_tokens=1)
    s.add_request(second)
    run_to_completion(s)
    (stored,) = log.take()  # its first two blocks were hits: only the third is new
    assert stored.block_hashes == [second.block_hashes[2]]
    assert stored.parent_block_hash == first.block_hashes[1]
    assert stored.token_ids == [7, 7, 7, 7]


def test_a_batch_is_vllms_msgpack_shape():
    log = KVEventLog("CPU")
    log.stored([b"a" * 32, b"b" * 32], None, list(range(8)), 4, None)
    log.removed(b"a" * 32)
    log.removed(b"b" * 32)  # evictions in a row: one event
    batch = KVEventBatch(12.5, log.take())
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert raw == [
        12.5,
        [["AllBlocksCleared"],
         ["BlockStored", [b"a" * 32, b"b" * 32], None, list(range(8)), 4, None, "CPU"],
         ["BlockRemoved", [b"a" * 32, b"b" * 32], "CPU"]],
        None,  # data_parallel_rank
    ]  # fmt: skip
    typed = msgspec.msgpack.Decoder(KVEventBatch).decode(msgspec.msgpack.encode(batch))
    assert typed == batch


def test_the_flag_is_checked():
    assert KVEventsConfig.parse(None) is None
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false}') is None
    config = KVEventsConfig.parse({"enable_kv_cache_events": True, "topic": "kv"})
    assert config.endpoint == "tcp://*:5557" and config.topic == "kv"
    for bad, message in [
        ("{", "not valid JSON"),
        ('{"enable_kv_cache_events": true, "port": 1}', "unknown field"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be"),
        ('{"enable_kv_cache_events": true, "endpoint": "5557"}', "ZMQ address"),
        ('{"enable_kv_cache_events": true, "buffer_steps": -1}', "buffer_steps"),
    ]:
        with pytest.raises(ValueError, match=message):
            KVEventsConfig.parse(bad)
