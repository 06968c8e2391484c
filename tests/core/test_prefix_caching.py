"""Automatic prefix caching: block hashes, hits, ref counts, LRU eviction, reset. No torch."""

import itertools

from pagedllm.core.block_hash import hash_block_tokens, update_block_hashes
from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceStatus

_ids = itertools.count()


def make_request(prompt, max_tokens=4, arrival=None, salt=None) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence.of(
        f"p{next(_ids)}",
        list(prompt),
        params,
        eos_token_ids=[0],
        arrival_time=arrival,
        cache_salt=salt,
    )


def make_scheduler(num_blocks=64, block_size=4, budget=64, max_model_len=64, caching=True):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(8, budget, max_model_len), kv)


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {r.seq_id: [token] for r in out.scheduled_requests if out.needs_sample(r)}
    groups = s.update_from_output(out, ModelRunnerOutput(sampled))
    finished = [g.first for g in groups if g.is_finished()]
    s.check_integrity()
    return out, finished


def run_to_completion(s: Scheduler):
    for _ in range(1000):
        if not s.has_unfinished_requests():
            return
        step(s)
    raise AssertionError("did not finish")


PROMPT = list(range(100, 112))  # 12 tokens = 3 full blocks of 4


def test_block_hashes_chain_over_the_prefix_and_salt():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, (1, 2, 3, 4))  # stable, list or tuple
    assert h0 != hash_block_tokens(None, [1, 2, 3, 5])
    assert h0 != hash_block_tokens(None, [1, 2, 3, 4], "tenant-a")
    # The same tokens after a different prefix are a different block.
    a = make_request([1, 2, 3, 4, 9, 9, 9, 9])
    b = make_request([1, 2, 3, 5, 9, 9, 9, 9])
    ha, hb = update_block_hashes(a, 4), update_block_hashes(b, 4)
    assert ha[1] != hb[1]
    assert ha[1] == hash_block_tokens(ha[0], [9, 9, 9, 9])
    # The salt goes into the first block and, through the chain, into every later one.
    c = make_request([1, 2, 3, 4, 9, 9, 9, 9], salt="x")
    hc = update_block_hashes(c, 4)
    assert hc[0] != ha[0] and hc[1] != ha[1]
    # Only full blocks are hashed, and hashes extend incrementally as tokens are appended.
    d = make_request([1, 2, 3, 4, 9, 9])
    hd = update_block_hashes(d, 4)
    assert len(hd) == 1 and d.block_hashes is hd
    first = hd[0]
    d.append_output_token(9)
    assert len(update_block_hashes(d, 4)) == 1
    d.append_output_token(9)
    assert update_block_hashes(d, 4) == ha and d.block_hashes[0] is first


def test_same_prompt_shares_blocks_but_computes_the_last_token():
    s = make_scheduler()
    a = make_request(PROMPT)
    s.add_request(a)
    step(s)
    kv = s.kv_cache_manager
    assert kv.block_pool.num_cached_blocks == 3
    # b: the whole prompt hits on a block boundary, so the last block is recomputed.
    # c: the first 9 tokens are equal: a hit of 2 blocks ending mid-prompt.
    b = make_request(PROMPT)
    c = make_request(PROMPT[:9] + [1, 2, 3, 4, 5])
    s.add_request(b)
    s.add_request(c)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {a.request_id: 1, b.request_id: 4, c.request_id: 6}
    ids_a, ids_b, ids_c = (kv.get_block_ids(r.request_id) for r in (a, b, c))
    assert ids_b[:2] == ids_a[:2] == ids_c[:2]
    assert ids_b[2] != ids_a[2] and ids_c[2] != ids_a[2]
    pool = kv.block_pool
    assert [pool.blocks[i].ref_cnt for i in ids_a[:2]] == [3, 3]
    assert pool.blocks[ids_a[2]].ref_cnt == 1
    s.check_integrity()
    run_to_completion(s)
    assert all(r.num_output_tokens == 4 for r in (a, b, c))
    assert all(blk.ref_cnt == 0 for blk in pool.blocks)
    assert kv.num_free_blocks == 64
    assert pool.num_cached_blocks > 3  # freed blocks keep their hashes (lazy eviction)
    s.check_integrity()


def test_requests_admitted_in_the_same_step_share_blocks():
    s = make_scheduler()
    a, b = make_request(PROMPT), make_request(PROMPT)
    s.add_request(a)
    s.add_request(b)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {a.request_id: 12, b.request_id: 4}
    assert b.num_computed_tokens == 12 and b.num_output_tokens == 1


def test_hit_counters_in_tokens_and_disabled_caching():
    s = make_scheduler()
    for _ in range(2):
        s.add_request(make_request(PROMPT))
        run_to_completion(s)
    kv = s.kv_cache_manager
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (24, 8)
    assert kv.prefix_cache_hit_rate == 8 / 24

    off = make_scheduler(caching=False)
    for _ in range(2):
        off.add_request(make_request(PROMPT))
        out, _ = step(off)
        assert out.total_num_scheduled_tokens == 12
        run_to_completion(off)
    kv = off.kv_cache_manager
    assert kv.prefix_cache_hits == kv.prefix_cache_queries == 0
    assert kv.block_pool.num_cached_blocks == 0


def test_cache_salt_isolates_requests():
    s = make_scheduler()
    s.add_request(make_request(PROMPT, salt="alice"))
    run_to_completion(s)
    for salt, hit in [(None, 0), ("bob", 0), ("alice", 8)]:
        before = s.kv_cache_manager.prefix_cache_hits
        s.add_request(make_request(PROMPT, salt=salt))
        run_to_completion(s)
        assert s.kv_cache_manager.prefix_cache_hits - before == hit, salt


def test_generated_tokens_fill_cacheable_blocks():
    s = make_scheduler()
    # 6 + 7 = 13 tokens, of which 12 are computed (the last sampled one never is): 3 full blocks.
    a = make_request(PROMPT[:6], max_tokens=7)
    s.add_request(a)
    run_to_completion(s)
    assert s.kv_cache_manager.block_pool.num_cached_blocks == 3
    # A follow-up turn whose prompt is the previous conversation hits all 12 computed tokens:
    # the blocks filled by generated tokens were cached too.
    b = make_request(a.all_token_ids[:12] + [55])
    s.add_request(b)
    out, _ = step(s)
    assert out.num_scheduled_tokens[b.request_id] == 1
    assert b.num_computed_tokens == 13


def test_eviction_is_lru_and_tail_blocks_go_first():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    pool = kv.block_pool

    def prefill(request):
        blocks, hit = kv.get_computed_blocks(request)
        assert kv.allocate_slots(request, request.num_tokens - hit, blocks)
        request.num_computed_tokens = request.num_tokens
        return hit

    a = make_request([1, 2, 3, 4, 5, 6, 7])  # 3 full blocks + 1 partial
    assert prefill(a) == 0
    a_blocks = list(kv.req_to_blocks[a.request_id])
    kv.free(a)
    kv.check_integrity()
    assert pool.num_cached_blocks == 3
    # Freed in reverse: the unused blocks first, then a's tail ... a's head.
    x = make_request([50, 51, 52, 53, 54, 55])  # 3 blocks: the never-used 4, 5 and a's partial 3
    prefill(x)
    assert pool.num_cached_blocks == 3 + 3
    y = make_request([60, 61])  # 1 block: evicts a's tail full block, not its head
    prefill(y)
    assert kv.req_to_blocks[y.request_id] == [a_blocks[2]]
    assert pool.get_cached_block(a.block_hashes[2]) is None
    assert pool.get_cached_block(a.block_hashes[0]) is a_blocks[0]
    kv.check_integrity()
    # The same prompt again: its two surviving head blocks are touched out of the free queue.
    a2 = make_request([1, 2, 3, 4, 5, 6, 7])
    hits, hit = kv.get_computed_blocks(a2)
    (blocks,) = hits  # one KV cache group
    assert blocks == a_blocks[:2] and hit == 4
    assert not kv.allocate_slots(a2, 3, hits)  # 2 hits + 2 new > 2 free: nothing changes
    assert all(b.ref_cnt == 0 for b in blocks)
    assert kv.get_block_ids(a2.request_id) == []
    x_blocks = list(kv.req_to_blocks[x.request_id])
    kv.free(x)  # x's blocks join the tail of the queue, x's tail block first
    assert kv.allocate_slots(a2, 3, hits)
    assert [b.ref_cnt for b in blocks] == [1, 1]
    # a2's two new blocks were x's two tail blocks (evicted); x's head block is still cached.
    assert kv.req_to_blocks[a2.request_id][2:] == [x_blocks[2], x_blocks[1]]
    assert [pool.get_cached_block(h) is not None for h in x.block_hashes] == [True, False, False]
    kv.check_integrity()
    # Least recently freed goes first across requests: x's head was freed before y and a2.
    kv.free(y)
    a2.num_computed_tokens = 7
    kv.free(a2)
    pool.allocate(1)
    assert pool.get_cached_block(x.block_hashes[0]) is None
    assert pool.get_cached_block(y.block_hashes[0]) is not None
    assert all(pool.get_cached_block(h) is not None for h in a2.block_hashes)


def test_free_queue_touch_and_integrity_on_the_pool():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.cache_block(a[0], b"h0")
    pool.cache_block(a[1], b"h0")  # same contents computed twice: only the first is cached
    assert a[1].block_hash is None and pool.get_cached_block(b"h0") is a[0]
    pool.free(reversed(a))
    pool.check_integrity([])
    pool.touch([a[0]])
    assert a[0].ref_cnt == 1 and pool.num_free_blocks == 3
    pool.check_integrity([[a[0]]])
    a[0].block_hash = b"other"  # corrupt the map
    try:
        pool.check_integrity([[a[0]]])
    except AssertionError:
        pass
    else:
        raise AssertionError("integrity check missed a hash that disagrees with the map")


def test_reset_prefix_cache_only_when_idle():
    s = make_scheduler()
    a = make_request(PROMPT, max_tokens=2)
    s.add_request(a)
    step(s)
    kv = s.kv_cache_manager
    assert kv.block_pool.num_cached_blocks == 3
    assert kv.reset_prefix_cache() is False  # a still holds blocks
    assert kv.block_pool.num_cached_blocks == 3
    run_to_completion(s)
    assert kv.reset_prefix_cache() is True
    assert kv.block_pool.num_cached_blocks == 0
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    kv.check_integrity()
    b = make_request(PROMPT)
    s.add_request(b)
    out, _ = step(s)
    assert out.num_scheduled_tokens[b.request_id] == 12  # nothing left to hit


def test_preempted_request_resumes_from_its_own_cached_blocks():
    # 5 blocks of 4: `first` (8 + 8 tokens) grows until `second` (6 + 8) is preempted; `first`
    # takes only second's tail block, so second's head block is still cached when it resumes.
    s = make_scheduler(num_blocks=5, block_size=4, max_model_len=20)
    first = make_request(range(200, 208), max_tokens=8, arrival=1.0)
    second = make_request(range(300, 306), max_tokens=8, arrival=2.0)
    s.add_request(first)
    s.add_request(second)
    while second.status != SequenceStatus.PREEMPTED:
        step(s)
    generated = second.num_output_tokens
    kv = s.kv_cache_manager
    while True:
        hits_before = kv.prefix_cache_hits
        out, _ = step(s)
        if second.request_id in out.num_scheduled_tokens:
            break
    hit = kv.prefix_cache_hits - hits_before
    assert hit > 0 and hit % 4 == 0
    assert out.num_scheduled_tokens[second.request_id] == 6 + generated - hit
    assert second.num_output_tokens == generated + 1  # sampling continues, nothing lost
    run_to_completion(s)
    assert first.num_output_tokens == second.num_output_tokens == 8
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_cli_flag_and_engine_args_default():
    from pagedllm.config import EngineArgs
    from pagedllm.entrypoints.cli import build_parser, engine_args_from

    assert EngineArgs().enable_prefix_caching is True
    parser = build_parser()
    on = engine_args_from(parser.parse_args(["generate", "hi"]))
    off = engine_args_from(parser.parse_args(["generate", "hi", "--no-enable-prefix-caching"]))
    assert on.enable_prefix_caching is True and off.enable_prefix_caching is False
