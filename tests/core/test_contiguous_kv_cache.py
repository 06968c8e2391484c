"""Contiguous KV reservations (Max, Pow2, Oracle; buddy and first-fit) driven by the real
scheduler with a fake model: the accounting adds up to the pool, regions are the sizes the
policies promise, and nothing leaks."""

import random

import pytest

from benchmarks.kv_waste import CLASSES, KVSlotBreakdown, simulate
from pagedllm.bench.workload import sharegpt_like_workload
from pagedllm.core.contiguous_kv_cache_manager import (
    BuddyAllocator,
    ContiguousKVCacheManager,
    FirstFitAllocator,
    next_power_of_two,
)
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence


@pytest.mark.parametrize("allocator_class", [BuddyAllocator, FirstFitAllocator])
@pytest.mark.parametrize("num_blocks", [1, 12, 64, 100])
def test_allocators_tile_the_pool_and_merge_back(allocator_class, num_blocks):
    rng = random.Random(num_blocks)
    allocator = allocator_class(num_blocks)
    initial = allocator.extents()
    held = []
    for _ in range(400):
        if held and (rng.random() < 0.45 or len(held) > 20):
            allocator.free(*held.pop(rng.randrange(len(held))))
        else:
            want = rng.randint(1, max(1, num_blocks // 3))
            region = allocator.allocate(want)
            if region is None:
                # Refused only when no free extent is long enough.
                need = next_power_of_two(want) if allocator_class is BuddyAllocator else want
                assert max((n for _, n in allocator.extents()), default=0) < need
                continue
            start, length = region
            assert length >= want
            if allocator_class is BuddyAllocator:
                assert length == next_power_of_two(want) and start % length == 0
            held.append(region)
        allocator.check()
        spans = sorted(held + allocator.extents())
        position = 0
        for start, length in spans:  # regions and free extents tile the pool, no overlap
            assert start == position
            position += length
        assert position == num_blocks
    for region in held:
        allocator.free(*region)
    allocator.check()
    assert allocator.extents() == initial


def test_first_fit_suffers_external_fragmentation():
    allocator = FirstFitAllocator(12)
    a, b, c = (allocator.allocate(4) for _ in range(3))
    allocator.free(*a)
    allocator.free(*c)
    assert allocator.allocate(6) is None  # 8 blocks free, but in two holes of 4
    allocator.free(*b)
    assert allocator.allocate(12) == (0, 12)  # all three merged back


def _request(i, prompt_len, output_len):
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    return Sequence.of(str(i), list(range(1, prompt_len + 1)), params, [], arrival_time=float(i))


@pytest.mark.parametrize("allocator", ["buddy", "first-fit"])
@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
def test_scheduler_with_reservations_accounts_for_every_slot(policy, allocator):
    max_model_len, num_blocks = 256, 700
    kv = ContiguousKVCacheManager(num_blocks, 1, policy, max_model_len, allocator)
    scheduler = Scheduler(SchedulerConfig(16, 128, max_model_len), kv)
    rng = random.Random(1)
    lens = {}
    for i in range(40):
        prompt_len, output_len = rng.randint(1, 100), rng.randint(1, 150)
        scheduler.add_request(_request(i, prompt_len, output_len))
        lens[str(i)] = (prompt_len, output_len)
    breakdown = KVSlotBreakdown()
    finished = set()
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        sampled = {r.seq_id: [5] for r in out.scheduled_requests if out.needs_sample(r)}
        for group in scheduler.update_from_output(out, ModelRunnerOutput(sampled)):
            if group.is_finished():
                finished.add(group.request_id)
        scheduler.check_integrity()
        # Held + free = the pool, and each region is what the policy reserves.
        held = sum(n for _, n in kv.regions.values())
        assert held + kv.num_free_blocks == num_blocks
        for seq_id, (_, size) in kv.regions.items():
            prompt_len, output_len = lens[seq_id]
            want = {
                "max": max_model_len,
                "pow2": min(prompt_len + next_power_of_two(output_len), max_model_len),
                "oracle": prompt_len + output_len,
            }[policy]
            assert kv.reserved_tokens[seq_id] == want
            assert size == (next_power_of_two(want) if allocator == "buddy" else want)
        before = dict(breakdown.slot_steps)
        breakdown.observe(scheduler, {k: p + o for k, (p, o) in lens.items()})
        step = {k: breakdown.slot_steps[k] - before[k] for k in CLASSES}
        # Slots held by requests split exactly into tokens, reserved and internal waste.
        held_classes = step["token_states"] + step["reserved"] + step["internal_fragmentation"]
        assert held_classes == held
        assert step["external_fragmentation"] in (0, kv.num_free_blocks)
    assert finished == set(lens)
    assert kv.num_free_blocks == num_blocks and not kv.regions and not kv.req_to_blocks
    assert scheduler.num_preemptions_total == 0  # a reservation never needs to grow


def test_oracle_region_is_exactly_the_request_in_whole_blocks():
    kv = ContiguousKVCacheManager(100, 4, "oracle", 64, "first-fit")
    request = _request(0, 10, 7)  # 17 tokens -> 5 blocks of 4
    assert kv.allocate_group([(request, 10, [[]])])
    assert kv.regions["0"] == (0, 5) and kv.get_block_ids("0") == [0, 1, 2]  # 10 tokens placed
    request.num_computed_tokens = 10
    kv.allocate_slots(request, 3)
    assert kv.get_block_ids("0") == [0, 1, 2, 3]
    kv.free(request)
    kv.check_integrity()
    assert kv.num_free_blocks == 100


def test_paged_keeps_the_most_tokens_in_memory_and_batches_the_most():
    workload = sharegpt_like_workload(60, 1000, scale=0.25, seed=3, max_model_len=512)
    results = {
        policy: simulate(policy, workload, num_slots=2048, block_size=16 if policy == "paged"
                         else 1, max_model_len=512, max_num_batched_tokens=512)
        for policy in ("max", "pow2", "oracle", "paged")
    }  # fmt: skip
    share = {p: r["breakdown"]["shares"]["token_states"] for p, r in results.items()}
    batch = {p: r["mean_batched_requests"] for p, r in results.items()}
    assert share["max"] < share["pow2"] < share["oracle"] < share["paged"]
    assert share["paged"] > 0.9
    assert batch["max"] < batch["oracle"] < batch["paged"]
    for r in results.values():
        assert sum(r["breakdown"]["shares"].values()) == pytest.approx(1.0)
