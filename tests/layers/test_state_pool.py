"""The state pool's bookkeeping (worker/state_pool.py): slots assigned to new sequences, copied
to forks, and given back for finished requests (forks included) and preemption;
a swapped-out sequence's state in the host stash and back into another slot; prefix caching's
checkpoints saved from a slot and restored into a new sequence's."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import ModelArchConfig
from pagedllm.worker.state_pool import StatePool


def _pool(num_slots: int = 4, num_checkpoints: int = 0) -> StatePool:
    config = ModelArchConfig(
        architecture="GraniteMoeHybridForCausalLM", vocab_size=10, hidden_size=16,
        intermediate_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        head_dim=8, layer_types=["mamba", "full_attention", "mamba"], mamba_n_heads=2,
        mamba_d_head=16, mamba_d_state=4,
    )  # fmt: skip
    return StatePool(config, num_slots, torch.float32, torch.device("cpu"), num_checkpoints)


def test_slots_are_kept_per_sequence_and_come_back_with_their_request():
    pool = _pool()
    a, b = pool.slots(["r1", "r2"], [0, 0])
    assert a != b and pool.slots(["r1", "r2"], [5, 3]) == [a, b]  # kept across steps
    pool.fork("r1", "r1#1")
    pool.fork("r1", "r1#2")
    assert pool.num_used == 4
    pool.release_requests(["r1"])  # the request and its forks, not r2
    assert pool.num_used == 1 and pool.slots(["r2"], [4]) == [b]
    pool.check_integrity()


def test_a_fork_holds_a_copy_of_its_parents_state():
    pool = _pool()
    (parent,) = pool.slots(["r"], [0])
    for state in pool.layers.values():
        state.conv[parent].normal_()
        state.ssm[parent].normal_()
    pool.fork("r", "r#1")
    (child,) = pool.slots(["r#1"], [7])
    assert child != parent
    for state in pool.layers.values():
        assert torch.equal(state.conv[child], state.conv[parent])
        assert torch.equal(state.ssm[child], state.ssm[parent])
        state.ssm[child].zero_()  # a copy: the parent's is its own
        assert state.ssm[parent].abs().sum() > 0
    pool.fork("gone", "gone#1")  # a preempted parent holds nothing: no slot for the child
    assert pool.num_used == 2


def test_a_sequence_resuming_without_state_or_past_the_slots_is_an_error():
    pool = _pool(num_slots=1)
    with pytest.raises(RuntimeError, match="resumes at 12 tokens without state"):
        pool.slots(["x"], [12])
    pool.slots(["y"], [0])
    with pytest.raises(RuntimeError, match="no free state slot of 1"):
        pool.slots(["z"], [0])


def _fill(pool: StatePool, slot: int) -> list[torch.Tensor]:
    """Random state in `slot`, and a copy of it."""
    saved = []
    for state in pool.layers.values():
        saved += [state.conv[slot].normal_().clone(), state.ssm[slot].normal_().clone()]
    return saved


def _state(pool: StatePool, slot: int) -> list[torch.Tensor]:
    return [t[slot] for state in pool.layers.values() for t in (state.conv, state.ssm)]


def test_a_swapped_out_state_waits_in_the_stash_and_comes_back_in_another_slot():
    pool = _pool(num_slots=2)
    a, b = pool.slots(["r", "r#1"], [0, 0])
    want = {"r": _fill(pool, a), "r#1": _fill(pool, b)}
    pool.swap_out(["r", "r#1", "never-ran"])  # a sequence without a slot has nothing to keep
    assert pool.num_used == 0 and pool.stashed == {"r", "r#1"}  # no slot while swapped out
    pool.check_integrity()
    (other,) = pool.slots(["other"], [0])  # another sequence takes a slot meanwhile
    _fill(pool, other)
    pool.swap_in(["r#1"])
    (slot,) = pool.slots(["r#1"], [9])  # resumes with its state: no "without state" error
    assert slot != b and pool.stashed == {"r"}
    assert all(torch.equal(x, y) for x, y in zip(_state(pool, slot), want["r#1"], strict=True))
    pool.release_requests(["r"])  # preempted: the slots of r's forks, the stash keeps r's
    assert pool.stashed == {"r"} and pool.num_used == 1
    pool.release_requests(["r"], stashed=True)  # finished (aborted while swapped out)
    assert not pool.stashed and pool.num_used == 1
    pool.check_integrity()


def test_a_full_stash_refuses_a_swap_out_and_keeps_the_state_in_its_slot():
    """The scheduler counts the stash (SchedulerConfig.max_stashed_seqs = the slots) and
    preempts by recompute past it; a swap-out past it anyway is an error, not a lost state."""
    pool = _pool(num_slots=2)
    pool.slots(["a", "b"], [0, 0])
    pool.swap_out(["a", "b"])
    (c,) = pool.slots(["c"], [0])
    want = _fill(pool, c)
    with pytest.raises(RuntimeError, match="state stash holds 2 sequences"):
        pool.swap_out(["c"])
    assert pool.slots(["c"], [5]) == [c] and pool.stashed == {"a", "b"}
    assert all(torch.equal(x, y) for x, y in zip(_state(pool, c), want, strict=True))
    pool.check_integrity()


def test_a_checkpoint_is_saved_from_a_slot_and_restored_into_a_new_sequences_slot():
    pool = _pool(num_slots=2, num_checkpoints=2)
    (a,) = pool.slots(["a"], [0])
    want = _fill(pool, a)
    pool.save_checkpoints([("a", 1), ("gone", 0)])  # a sequence without a slot saves nothing
    _fill(pool, a)  # a goes on past its checkpoint
    pool.release(["a"])
    (other,) = pool.slots(["other"], [0])
    _fill(pool, other)
    pool.load_checkpoints([("b", 1)])  # a prefix hit: b continues from a's checkpoint
    (slot,) = pool.slots(["b"], [8])  # restored: no "resumes without state" error
    assert slot != other and pool.num_used == 2
    assert all(torch.equal(x, y) for x, y in zip(_state(pool, slot), want, strict=True))
    with pytest.raises(RuntimeError, match="resumes at 8 tokens without state"):
        pool.slots(["c"], [8])  # a hit never restored
    pool.check_integrity()
