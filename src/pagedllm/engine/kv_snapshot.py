"""One picture of the KV cache: the pools block by block, every request's block tables, and the
engine's counters. The dashboard (and `GET /debug/kv`) draw it; docs/dashboard.md describes the
fields.

It walks every block and table entry in Python, so it is never taken on the step loop's own
initiative: only when asked, on the loop's thread between two steps (AsyncLLMEngine.kv_snapshot),
and the server asks at most a few times a second however many pages are open.
"""

from __future__ import annotations

import time

from pagedllm.sequence import SequenceGroup

# Waiting requests hold no blocks; past this many, only their number is given.
MAX_WAITING_LISTED = 32


def _group_status(group: SequenceGroup, queue: str) -> str:
    if queue == "waiting" and group.num_preemptions:
        return "preempted"  # back in the queue, to be recomputed
    return queue


def _block_counts(pool: dict, reserved: list[int]) -> dict[str, int]:
    """free + cached + used (+ reserved) == num_blocks; shared blocks are among the used ones."""
    ref_cnt = pool["ref_cnt"]
    num_cached_free = sum(1 for b in pool["cached"] if ref_cnt[b] == 0)
    num_used = sum(1 for c in ref_cnt if c > 0)
    return {
        "free": pool["num_blocks"] - num_used - num_cached_free - len(reserved),
        "cached": num_cached_free,
        "used": num_used,
        "shared": sum(1 for c in ref_cnt if c > 1),
        "reserved": len(reserved),
    }


def kv_snapshot(engine, check: bool = False) -> dict:
    """The snapshot of `engine` (an LLMEngine) now. `check`: also run the scheduler's integrity
    check (the KV cache manager's, and only live sequences hold blocks) and report its verdict
    (it walks the pool again)."""
    scheduler, config = engine.scheduler, engine.config
    kv = scheduler.kv_cache_manager
    pools = kv.snapshot()
    device, swap = pools["device"], pools["swap"]
    # Which request each block belongs to (the first one holding it, in the order listed).
    device["owner"] = [-1] * device["num_blocks"]
    if swap is not None:
        swap["owner"] = [-1] * swap["num_blocks"]
    queues = [
        ("running", scheduler.running),
        ("swapped", scheduler.swapped),
        ("waiting", list(scheduler.waiting)[:MAX_WAITING_LISTED]),
    ]
    requests = []
    for queue, groups in queues:
        for group in groups:
            index = len(requests)
            seqs = []
            for seq in group.seqs:
                tables, swapped = kv.block_tables(seq.seq_id)
                owner = (swap if swapped else device)["owner"]
                for table in tables:
                    for block_id in table:
                        if block_id >= 0 and owner[block_id] < 0:
                            owner[block_id] = index
                seqs.append(
                    {
                        "seq_id": seq.seq_id,
                        "index": seq.sample_index,
                        "status": seq.status.name.lower(),
                        "num_prompt_tokens": seq.num_prompt_tokens,
                        "num_tokens": seq.num_tokens,
                        "num_computed_tokens": seq.num_computed_tokens,
                        "swapped": swapped,
                        "block_tables": tables,
                    }
                )
            requests.append(
                {
                    "request_id": group.request_id,
                    "status": _group_status(group, queue),
                    "arrival_time": group.arrival_time,
                    "num_samples": group.num_samples,
                    "beam_search": group.is_beam_search,
                    "num_preemptions": group.num_preemptions,
                    "num_finished_seqs": len(group.finished_seqs),
                    "seqs": seqs,
                }
            )
    device["counts"] = _block_counts(device, pools["reserved"])
    device["reserved"] = pools["reserved"]
    if swap is not None:
        swap["counts"] = _block_counts(swap, [])
    snapshot = {
        "time": time.time(),
        "model": engine.model_name,
        "config": {
            "block_size": config.cache.block_size,
            "num_kv_cache_groups": kv.num_kv_cache_groups,
            "kv_allocation": config.cache.kv_allocation,
            "enable_prefix_caching": kv.enable_prefix_caching,
            "preemption_mode": config.scheduler.preemption_mode,
            "max_model_len": config.scheduler.max_model_len,
            "max_num_seqs": config.scheduler.max_num_seqs,
        },
        "pool": device,
        "swap": swap,
        "requests": requests,
        "num_waiting_not_listed": max(0, len(scheduler.waiting) - MAX_WAITING_LISTED),
        "stats": engine.get_stats(),
    }
    if check:
        try:
            scheduler.check_integrity()  # the pools, the tables, and who may hold blocks
            snapshot["integrity"] = {"ok": True, "error": None}
        except AssertionError as e:
            snapshot["integrity"] = {"ok": False, "error": str(e) or repr(e)}
    return snapshot
