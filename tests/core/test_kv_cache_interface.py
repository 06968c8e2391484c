"""Both KV cache managers offer the whole KV cache interface with its very signatures, and the
scheduler needs nothing else from them. No torch."""

import inspect
import typing

import pytest

from pagedllm.core.contiguous_kv_cache_manager import ContiguousKVCacheManager
from pagedllm.core.kv_cache_interface import Allocation, KVCacheInterface
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.sequence import Sequence, SequenceStatus
from tests.core.test_preemption import SwapRunner
from tests.core.test_sharing import MIXED, VOCAB, h, make_request, results

METHODS = {
    name: value
    for name, value in vars(KVCacheInterface).items()
    if inspect.isfunction(value) and not name.startswith("_")
}
PROPERTIES = {
    name: value for name, value in vars(KVCacheInterface).items() if isinstance(value, property)
}
INTERFACE = METHODS.keys() | PROPERTIES.keys()


def mismatches(manager) -> list[str]:
    """How `manager` departs from the interface: a missing member, a method whose signature
    (names, kinds, defaults, resolved annotations) differs, or a property of another type."""
    cls = type(manager)
    problems = []
    for name, method in METHODS.items():
        impl = getattr(cls, name, None)
        if not inspect.isfunction(impl):
            problems.append(f"{name}: not a method")
            continue
        want = inspect.signature(method, eval_str=True)
        got = inspect.signature(impl, eval_str=True)
        if got != want:
            problems.append(f"{name}{got} instead of {name}{want}")
    for name, prop in PROPERTIES.items():
        if not hasattr(manager, name):
            problems.append(f"{name}: missing")
            continue
        value = getattr(manager, name)
        kind = typing.get_type_hints(prop.fget)["return"]
        kind = typing.get_origin(kind) or kind
        if inspect.ismethod(value) or not isinstance(value, kind):
            problems.append(f"{name}: {value!r} is not a {kind.__name__}")
    return problems


def paged() -> KVCacheManager:
    return KVCacheManager(16, 4, num_cpu_blocks=8, sliding_windows=(None, 8))


def contiguous() -> ContiguousKVCacheManager:
    return ContiguousKVCacheManager(16, 4, "pow2", max_model_len=64)


@pytest.mark.parametrize("make", [paged, contiguous])
def test_both_managers_implement_the_whole_interface(make):
    manager = make()
    assert mismatches(manager) == []
    assert isinstance(manager, KVCacheInterface)


def test_the_check_catches_a_drifting_manager():
    class Drifted(ContiguousKVCacheManager):
        fork = None  # gone

        def free(self, request: Sequence, now: bool = True) -> None:  # a parameter more
            super().free(request)

        def swap_in(self, requests: list[Sequence]) -> None:  # another return type
            pass

        @property
        def usage(self) -> str:
            return "high"

    problems = mismatches(Drifted(16, 4, "max", max_model_len=64))
    assert [p.split("(")[0].split(":")[0] for p in problems] == ["fork", "free", "swap_in", "usage"]


def test_the_scheduler_is_typed_against_the_interface():
    init = inspect.signature(Scheduler.__init__, eval_str=True)
    assert init.parameters["kv_cache_manager"].annotation is KVCacheInterface


class InterfaceOnly:
    """A manager seen through the interface alone: reaching for anything else fails."""

    def __init__(self, manager) -> None:
        self._manager = manager

    def __getattr__(self, name: str):
        if name not in INTERFACE:
            raise AttributeError(f"{name!r} is not in the KV cache interface")
        return getattr(self._manager, name)


def run_through_the_interface(s: Scheduler, runner: SwapRunner, requests: list[Sequence]):
    s.kv_cache_manager = InterfaceOnly(s.kv_cache_manager)  # the runner was built before
    for i, r in enumerate(requests):
        r.request.arrival_time = float(i)
        s.add_request(r)
    for _ in range(3000):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        s.check_integrity()
        s.update_from_output(out, runner.execute(out))
        s.check_integrity()
        runner.check_contexts(s)
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks
    res = results(requests)
    return [res[r.request_id] for r in requests]


def mixed_requests() -> list[Sequence]:
    return [
        make_request(0, prompt=[1 + h("mixed", i, j) % (VOCAB - 1) for j in range(p)], **kw)
        for i, (p, kw) in enumerate(MIXED)
    ]


def scheduler(kv, mode="swap", budget=64) -> Scheduler:
    return Scheduler(SchedulerConfig(16, budget, 64, preemption_mode=mode), kv)


def test_the_scheduler_needs_only_the_interface_of_a_paged_manager():
    """Groups, copy-on-write, swap preemption and prefix hits, all through the interface."""
    big = scheduler(KVCacheManager(400, 4))
    expected = run_through_the_interface(big, SwapRunner(big), mixed_requests())
    s = scheduler(KVCacheManager(30, 4, num_cpu_blocks=30))
    assert run_through_the_interface(s, SwapRunner(s), mixed_requests()) == expected
    assert s.num_swap_preemptions_total > 0


def test_the_scheduler_needs_only_the_interface_of_a_contiguous_manager():
    kv = ContiguousKVCacheManager(30, 4, "max", max_model_len=64)
    s = scheduler(kv, mode="recompute", budget=32)
    runner = SwapRunner(s)
    requests = [make_request(p, max_tokens=m) for p, m in [(10, 5), (20, 9), (3, 14), (7, 2)]]
    got = run_through_the_interface(s, runner, requests)
    assert [len(r[0]) for r in got] == [5, 9, 14, 2]


def test_allocate_slots_returns_the_new_blocks_per_group_or_none():
    kv = KVCacheManager(6, 4, sliding_windows=(None, 4))
    r = make_request(9)
    allocation = kv.allocate_slots(r, 9)  # 3 blocks in each group
    assert isinstance(allocation, Allocation) and allocation.blocks_to_copy == []
    full, sliding = allocation.new_blocks
    assert [b.block_id for b in full] == kv.get_group_block_ids(r.seq_id)[0]
    assert [b.block_id for b in sliding] == kv.get_group_block_ids(r.seq_id)[1]
    assert kv.num_free_blocks == 0
    r.num_computed_tokens = 9
    before = kv.get_group_block_ids(r.seq_id)
    assert kv.allocate_slots(r, 8) is None  # 2 more blocks in the full group, none free
    assert kv.get_group_block_ids(r.seq_id) == before and kv.num_free_blocks == 0
    kv.check_integrity()
    assert kv.allocate_group([(make_request(3), 3, [[], []])]) is None


def test_allocate_group_returns_one_allocation_per_entry_in_order():
    kv = KVCacheManager(8, 4)
    a, b = make_request(5), make_request(9)
    allocations = kv.allocate_group([(a, 5, [[]]), (b, 9, [[]])])
    assert [len(x.new_blocks[0]) for x in allocations] == [2, 3]
    assert [x.block_id for x in allocations[1].new_blocks[0]] == kv.get_block_ids(b.seq_id)
    contiguous_kv = contiguous()
    (only,) = contiguous_kv.allocate_group([(a, 5, [[]])])
    assert [x.block_id for x in only.new_blocks[0]] == contiguous_kv.get_block_ids(a.seq_id)


def test_is_id_in_use_knows_requests_and_their_forks():
    s = scheduler(KVCacheManager(64, 4))
    r = make_request(6, n=3)
    s.add_request(r)
    rid = r.request_id
    assert s.is_id_in_use(rid) and not s.is_id_in_use(f"{rid}#1")
    runner = SwapRunner(s)
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))  # the first token forks the group
    forks = [q.seq_id for q in r.group.seqs if q is not r]
    assert len(forks) == 2 and all(s.is_id_in_use(f) for f in forks)
    assert not s.is_id_in_use(f"{rid}#9") and not s.is_id_in_use("another")
    s.finish_requests([rid], SequenceStatus.FINISHED_ABORTED)
    assert not any(s.is_id_in_use(x) for x in [rid, *forks])


def test_is_id_in_use_knows_the_forks_of_a_preempted_group():
    """They hold no blocks while waiting to be recomputed, yet they will again."""
    s = scheduler(KVCacheManager(4, 4), mode="recompute")
    first, r = make_request(8, max_tokens=8, arrival=0.0), make_request(3, n=3, arrival=1.0)
    s.add_request(first)
    s.add_request(r)
    runner = SwapRunner(s)
    for _ in range(2):  # r forks, then its copies-on-write do not fit: r is preempted
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
    assert out.preempted_request_ids == [r.request_id]
    forks = [q.seq_id for q in r.group.seqs if q is not r]
    assert len(forks) == 2 and not any(f in s.kv_cache_manager.req_to_blocks for f in forks)
    assert all(s.is_id_in_use(f) for f in forks)
