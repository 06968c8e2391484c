"""The scheduler's invariants, asserted (tests call it after every scenario; /debug/kv?check=true
on a live server). Torch-free."""

from __future__ import annotations

from pagedllm.sequence import SequenceStatus


def check_scheduler(scheduler) -> None:
    """The pools agree with the block tables, and only live sequences hold blocks: running
    ones device blocks, swapped ones swap-space blocks, none while waiting or preempted.
    Every unfinished group is in exactly one queue; running and swapped keep the policy's
    order. `scheduler`: a core.scheduler.Scheduler."""
    s = scheduler
    kv = s.kv_cache_manager
    kv.check_integrity()
    live = {q.seq_id for g in s.running for q in g.seqs}
    assert set(kv.req_to_blocks) <= live, "a finished, waiting or preempted sequence holds blocks"
    swapped = {q.seq_id for g in s.swapped for q in g.seqs}
    assert set(kv.swapped_blocks) == swapped, "swap-space tables and swapped groups disagree"
    for group in s.swapped:
        assert group.seqs and all(q.status == SequenceStatus.SWAPPED for q in group.seqs)
    queues = [*s.waiting, *s.running, *s.swapped]
    assert len({id(g) for g in queues}) == len(queues) == len(s.requests), (
        "a group is in no queue or in two"
    )
    for ordered in (s.running, s.swapped):
        keys = [s.order(g) for g in ordered]
        assert keys == sorted(keys), "running or swapped groups are out of order"
    assert s.num_running_seqs == len(live), "running sequence count is off"
    for group in s.running:
        assert group.seqs and all(q.status == SequenceStatus.RUNNING for q in group.seqs)
    for group in s.waiting:
        waiting = (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
        assert all(q.status in waiting for q in group.seqs)
