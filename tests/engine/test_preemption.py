"""Preemption end to end: a KV demand 5-10x the pool, by swap and by recompute, gives the
outputs of an unconstrained run, and leaves both pools free. Tiny random Llama (fast), and the
real default model (slow). Also: the swap space falling back to recompute, aborting a swapped
request, the stats counters, the preemption warning, the K/V the swap copies move, and requests
that could never run."""

import logging

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.selector import copy_blocks_torch
from pagedllm.config import ModelArchConfig
from pagedllm.core.kv_cache_spec import cdiv
from pagedllm.worker.kv_cache import KVCache, kv_cache_spec
from tests.conftest import runner_of, save_tiny_llama

BLOCK = 4
POOL = 16  # blocks of 4 tokens: one request of max_model_len 64
# 12 greedy requests: prompts of 4-15 tokens, 12-24 new tokens each.
PROMPTS = [[(7 * i + 13 * j) % 120 + 3 for j in range(4 + (7 * i) % 12)] for i in range(12)]
MAX_TOKENS = [12 + (5 * i) % 13 for i in range(12)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-preemption")
    save_tiny_llama(path)
    return str(path)


def make_llm(path, **kwargs):
    kwargs.setdefault("block_size", BLOCK)
    kwargs.setdefault("max_model_len", 64)
    return LLM(model=path, dtype="float32", **kwargs)


def greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def swap_space_for(llm, num_blocks) -> float:
    """--swap-space (GiB) that makes exactly `num_blocks` blocks of swap space."""
    engine = llm.llm_engine
    per_block = engine.kv_cache_spec.bytes_per_block
    return (num_blocks + 0.5) * per_block / 2**30


def check_pools(llm, aborted=False):
    """Device pool and swap space entirely free, every table gone, integrity holds."""
    engine = llm.llm_engine
    scheduler = engine.scheduler
    scheduler.check_integrity()
    kv = scheduler.kv_cache_manager
    assert not scheduler.has_unfinished_requests() and not engine.output_processor.states
    assert not kv.req_to_blocks and not kv.swapped_blocks
    assert kv.num_free_blocks == engine.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.num_free_cpu_blocks == kv.num_cpu_blocks == engine.num_cpu_blocks
    stats = engine.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == stats["num_swapped"] == 0
    assert stats["kv_cache_usage"] == 0 and stats["swap_space_usage"] == 0
    if not aborted:  # every block swapped out came back
        kv_cache = runner_of(engine).kv_cache
        assert kv_cache.num_swapped_out_blocks == kv_cache.num_swapped_in_blocks


def run_engine(llm, prompts, params, stats=None):
    """Add every request, step to the end; returns the token ids per request, in order.
    `stats`, a list, receives get_stats() after every step."""
    engine = llm.llm_engine
    ids = [engine.add_request(None, {"prompt_token_ids": p}, sp)
           for p, sp in zip(prompts, params, strict=True)]  # fmt: skip
    done = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        assert engine.get_num_unfinished_requests() == len(ids) - len(done)
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if stats is not None:
            stats.append(engine.get_stats())
    else:
        raise AssertionError("the engine did not finish")
    check_pools(llm)
    return [[c.token_ids for c in done[i].outputs] for i in ids]


@pytest.fixture(scope="module")
def unconstrained(tiny):
    llm = make_llm(tiny, num_gpu_blocks_override=1000)
    got = run_engine(llm, PROMPTS, [greedy(m) for m in MAX_TOKENS])
    assert llm.llm_engine.scheduler.num_preemptions_total == 0
    return got


def test_workload_demands_5_to_10x_the_pool():
    demand = sum(cdiv(len(p) + m, BLOCK) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True))
    assert 5 <= demand / POOL <= 10, demand / POOL


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_heavy_preemption_gives_the_unconstrained_outputs(tiny, unconstrained, mode,
                                                          prefix_caching):  # fmt: skip
    llm = make_llm(tiny, num_gpu_blocks_override=POOL, preemption_mode=mode, swap_space=0.001,
                   enable_prefix_caching=prefix_caching)  # fmt: skip
    engine = llm.llm_engine
    stats = []
    got = run_engine(llm, PROMPTS, [greedy(m) for m in MAX_TOKENS], stats)
    assert got == unconstrained
    scheduler = engine.scheduler
    assert scheduler.num_preemptions_total >= 5
    assert stats[-1]["num_preemptions_total"] == scheduler.num_preemptions_total
    if mode == "swap":
        assert engine.num_cpu_blocks == POOL  # 0.001 GiB is more than the pool: capped to it
        assert scheduler.num_swap_preemptions_total > 0
        assert max(s["num_swapped"] for s in stats) > 0
        assert max(s["swap_space_usage"] for s in stats) > 0
        kv_cache = runner_of(engine).kv_cache
        assert kv_cache.num_swapped_out_blocks > 0
        assert stats[-1]["num_swapped_out_blocks"] == kv_cache.num_swapped_in_blocks
    else:
        assert engine.num_cpu_blocks == 0 and scheduler.num_swap_preemptions_total == 0
        assert all(s["num_swapped"] == 0 for s in stats)
        assert runner_of(engine).kv_cache.num_swapped_out_blocks == 0


@pytest.mark.parametrize("num_swap_blocks", [0, 3])
def test_swap_space_too_small_falls_back_to_recompute(tiny, unconstrained, num_swap_blocks):
    probe = make_llm(tiny, num_gpu_blocks_override=POOL)
    llm = make_llm(tiny, num_gpu_blocks_override=POOL, preemption_mode="swap",
                   swap_space=swap_space_for(probe, num_swap_blocks))  # fmt: skip
    engine = llm.llm_engine
    assert engine.num_cpu_blocks == num_swap_blocks
    got = run_engine(llm, PROMPTS, [greedy(m) for m in MAX_TOKENS])
    assert got == unconstrained
    scheduler = engine.scheduler
    assert scheduler.num_swap_preemptions_total < scheduler.num_preemptions_total
    if num_swap_blocks:
        assert scheduler.num_swap_preemptions_total > 0  # what fit was swapped
    else:
        assert runner_of(engine).kv_cache.num_swapped_out_blocks == 0


def test_groups_are_swapped_whole_and_give_the_same_outputs(tiny):
    """Greedy, n=3 seeded samples, best_of and beams under a pool small enough to swap groups
    of several sequences out and back in."""
    prompts = PROMPTS[:6]
    params = [
        greedy(18),
        SamplingParams(n=3, seed=11, temperature=0.9, max_tokens=9, ignore_eos=True),
        SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=14),
        SamplingParams(n=2, best_of=3, seed=5, temperature=1.2, max_tokens=7),
        SamplingParams(n=3, seed=3, temperature=1.0, max_tokens=12, ignore_eos=True),
        greedy(22),
    ]
    expected = run_engine(make_llm(tiny, num_gpu_blocks_override=1000), prompts, params)
    llm = make_llm(tiny, num_gpu_blocks_override=POOL, preemption_mode="swap", swap_space=0.001)
    scheduler = llm.llm_engine.scheduler
    swapped_sizes, swap_out = [], scheduler.kv_cache_manager.swap_out

    def record(seqs):
        swapped_sizes.append(len(seqs))
        assert len({q.status for q in seqs}) == 1
        return swap_out(seqs)

    scheduler.kv_cache_manager.swap_out = record
    assert run_engine(llm, prompts, params) == expected
    assert max(swapped_sizes) > 1  # whole groups went out and came back
    assert scheduler.num_swap_preemptions_total == len(swapped_sizes)


def test_abort_of_a_swapped_request_frees_its_swap_blocks(tiny, unconstrained):
    llm = make_llm(tiny, num_gpu_blocks_override=POOL, preemption_mode="swap", swap_space=0.001)
    engine = llm.llm_engine
    scheduler = engine.scheduler
    kv = scheduler.kv_cache_manager
    ids = [engine.add_request(f"r{i}", {"prompt_token_ids": p}, greedy(m))
           for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))]  # fmt: skip
    done = {}
    for _ in range(500):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if scheduler.swapped:
            break
    victim = scheduler.swapped[0].request_id
    held = kv.num_cpu_blocks - kv.num_free_cpu_blocks
    assert held > 0
    others = sum(len({b.block_id for q in g.seqs for b in kv.swapped_blocks[q.seq_id]})
                 for g in scheduler.swapped[1:])  # fmt: skip
    engine.abort_request(victim)
    scheduler.check_integrity()
    assert kv.num_cpu_blocks - kv.num_free_cpu_blocks == others < held
    assert victim not in scheduler.requests and victim not in engine.output_processor.states
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    check_pools(llm, aborted=True)
    assert victim not in done
    for i, request_id in enumerate(ids):
        if request_id != victim:
            assert [c.token_ids for c in done[request_id].outputs] == unconstrained[i]


def test_preemption_warning_is_logged_and_rate_limited(tiny, caplog):
    logger = logging.getLogger("pagedllm")  # does not propagate: listen on it directly
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="pagedllm"):
            llm = make_llm(tiny, num_gpu_blocks_override=POOL, preemption_mode="swap",
                           swap_space=0.001)  # fmt: skip
            run_engine(llm, PROMPTS, [greedy(m) for m in MAX_TOKENS])
    finally:
        logger.removeHandler(caplog.handler)
    total = llm.llm_engine.scheduler.num_preemptions_total
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "preempted" in r.getMessage()]  # fmt: skip
    assert total > 1 and 1 <= len(warnings) <= 1 + total // 50
    assert "--preemption-mode swap" in warnings[0] and "KV cache is too small" in warnings[0]


# -- requests that could never run --------------------------------------------------------------
def test_impossible_groups_are_rejected_and_the_rest_runs_on(tiny, unconstrained):
    llm = make_llm(tiny, num_gpu_blocks_override=POOL, preemption_mode="swap", swap_space=0.001,
                   max_num_batched_tokens=64)  # fmt: skip
    engine = llm.llm_engine
    ids = [engine.add_request(f"r{i}", {"prompt_token_ids": p}, greedy(m))
           for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))]  # fmt: skip
    done = {}
    for _ in range(6):  # in flight, with preemptions under way
        done.update({o.request_id: o for o in engine.step() if o.finished})
    impossible = [
        # 4 sequences of up to 10 + 30 tokens: 4 x 10 blocks, the pool has 16.
        (SamplingParams(n=4, max_tokens=30, ignore_eos=True), "KV cache"),
        (SamplingParams(n=3, use_beam_search=True, temperature=0, max_tokens=40), "KV cache"),
        (SamplingParams(n=2, max_tokens=None), "KV cache"),  # up to max_model_len each
        (SamplingParams(n=65, max_tokens=2), "max_num_batched_tokens"),
    ]
    for params, match in impossible:
        with pytest.raises(ValueError, match=match):
            engine.add_request("bad", {"prompt_token_ids": list(range(3, 13))}, params)
        assert (
            "bad" not in engine.output_processor.states and "bad" not in engine.scheduler.requests
        )
        engine.scheduler.check_integrity()
    # What just fits is accepted: 2 x cdiv(10 + 22, 4) = 16 blocks.
    fits = SamplingParams(n=2, seed=1, temperature=1.0, max_tokens=22, ignore_eos=True)
    engine.add_request("fits", {"prompt_token_ids": list(range(3, 13))}, fits)
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    check_pools(llm)
    assert [[c.token_ids for c in done[i].outputs] for i in ids] == unconstrained
    assert [len(c.token_ids) for c in done["fits"].outputs] == [22, 22]


# -- the K/V the swap copies move -----------------------------------------------------------------
def test_swap_blocks_move_every_layer_k_and_v_and_nothing_else():
    config = ModelArchConfig("LlamaForCausalLM", 10, 16, 16, 3, 2, 2, 8)  # 3 layers, 2 x 8
    kv = KVCache(kv_cache_spec(config, 4, torch.float32), 3, 10, 6, torch.float32,
                 torch.device("cpu"), copy_blocks_torch)  # fmt: skip
    assert kv.swap_pool.shape == (3, 2, 6, 4, 2, 8)
    assert kv.swap_pool.data_ptr() != kv.pool.data_ptr()
    g = torch.Generator().manual_seed(0)
    kv.pool.copy_(torch.randn(kv.pool.shape, generator=g))
    original = kv.pool.clone()
    out = [(2, 0), (5, 3), (7, 1)]  # (device, cpu)
    kv.swap(out, [])
    for dev, cpu in out:
        assert torch.equal(kv.swap_pool[:, :, cpu], original[:, :, dev])
    assert torch.equal(kv.pool, original)  # swapping out only reads the device pool
    # The device blocks are reused meanwhile.
    kv.pool[:, :, [2, 5, 7]] = torch.randn((3, 2, 3, 4, 2, 8), generator=g)
    before = kv.pool.clone()
    in_ = [(0, 4), (3, 8), (1, 2)]  # (cpu, device): back to other blocks, one to its own
    kv.swap([], in_)
    moved = {dev_in: dev_out for (dev_out, cpu), (cpu_in, dev_in) in
             ((o, i) for o in out for i in in_ if i[0] == o[1])}  # fmt: skip
    assert moved == {4: 2, 8: 5, 2: 7}
    for dst, src in moved.items():
        for layer, (k, v) in enumerate(kv.layers):
            assert torch.equal(k[dst], original[layer, 0, src])
            assert torch.equal(v[dst], original[layer, 1, src])
    untouched = [b for b in range(10) if b not in moved]
    assert torch.equal(kv.pool[:, :, untouched], before[:, :, untouched])
    # Out and in in one step: a block swapped out may be the destination of a swap-in.
    saved = kv.pool[:, :, 6].clone()
    incoming = kv.swap_pool[:, :, 3].clone()
    kv.swap([(6, 5)], [(3, 6)])
    assert torch.equal(kv.swap_pool[:, :, 5], saved)
    assert torch.equal(kv.pool[:, :, 6], incoming)
    assert kv.num_swapped_out_blocks == 4 and kv.num_swapped_in_blocks == 4
    assert kv.layers[0][0].data_ptr() == kv.pool[0, 0].data_ptr()


# -- the real default model ---------------------------------------------------------------------
DEFAULT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Explain photosynthesis in one sentence.",
    "List three primary colors:",
    "Once upon a time, in a small village,",
    "The quick brown fox",
    "Translate 'good morning' into Spanish:",
    "What is 12 times 7?",
    "A recipe for pancakes starts with",
    "The three laws of thermodynamics are",
    "import numpy as np\n",
]


@pytest.mark.slow
def test_default_model_heavy_preemption_gives_the_unconstrained_outputs():
    kwargs = dict(max_model_len=64, block_size=8)
    params = [greedy(24 + (i % 3) * 4) for i in range(len(DEFAULT_PROMPTS))]
    big = LLM(dtype="float32", num_gpu_blocks_override=200, **kwargs)
    tokenizer = big.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in DEFAULT_PROMPTS]
    demand = sum(cdiv(len(p) + sp.max_tokens, 8) for p, sp in zip(prompts, params, strict=True))
    num_blocks = max(8, demand // 7)  # 8: one request of max_model_len 64
    assert 5 <= demand / num_blocks <= 10, (demand, num_blocks)
    expected = run_engine(big, prompts, params)
    assert big.llm_engine.scheduler.num_preemptions_total == 0
    del big
    for mode in ("swap", "recompute"):
        llm = LLM(dtype="float32", num_gpu_blocks_override=num_blocks, preemption_mode=mode,
                  swap_space=0.01, **kwargs)  # fmt: skip
        assert run_engine(llm, prompts, params) == expected, mode
        scheduler = llm.llm_engine.scheduler
        assert scheduler.num_preemptions_total > 0
        assert (scheduler.num_swap_preemptions_total > 0) == (mode == "swap")
