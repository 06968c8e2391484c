"""A hybrid model's recurrent state in memory: for each recurrent layer, a pool of state slots
(layers/recurrent.py's RecurrentState), one slot per running sequence, assigned by the runner as
sequences arrive and freed as they finish or are preempted. max_num_seqs slots: the scheduler
never runs more sequences.

A sequence preempted by recompute recomputes its prompt from a fresh slot. One preempted by swap
(its blocks went to the swap space) leaves its state in a host-side stash and holds no slot
while swapped out; swapped back in, its state is restored into whatever slot is free. The stash
holds at most max_num_seqs sequences, its own bound beside the swap space's (the scheduler
counts it: SchedulerConfig.max_stashed_seqs, and preempts by recompute beyond it).

With prefix caching, `num_checkpoints` more slots of the same shapes hold prompts' states at a
block boundary (core/state_checkpoints.py, whose index chooses them): saved from a sequence's
slot after the step that reaches the boundary, restored into a new sequence's slot before the
step that continues from a prefix-cache hit there."""

from __future__ import annotations

import torch

from pagedllm.config import ModelArchConfig
from pagedllm.layers.recurrent import RecurrentState


class StatePool:
    def __init__(
        self,
        config: ModelArchConfig,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        num_checkpoints: int = 0,
    ) -> None:
        conv, ssm = config.recurrent_state_shapes

        def states(n: int) -> dict[int, RecurrentState]:
            return {
                i: RecurrentState(
                    torch.zeros((n, *conv), dtype=dtype, device=device),
                    torch.zeros((n, *ssm), dtype=torch.float32, device=device),
                )
                for i in range(config.num_hidden_layers)
                if config.is_recurrent_layer(i)
            }

        self.layers = states(num_slots)
        self.checkpoints = states(num_checkpoints)  # prefix caching's, by checkpoint slot
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[str, int] = {}
        # Swapped-out sequences' states in host memory, (conv, ssm) per recurrent layer, in
        # the order of `layers`; at most `num_slots` of them (the scheduler's bound).
        self._stash: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def slots(self, seq_ids: list[str], num_computed: list[int]) -> list[int]:
        """Each sequence's slot, a free one for a sequence new to the pool. A sequence with
        tokens computed before it had a slot has no state to resume (a forked sample gets its
        parent's copy, a prefix-cache hit its checkpoint's first): the engine never schedules
        one for a hybrid model (RuntimeError)."""
        out = []
        for seq_id, computed in zip(seq_ids, num_computed, strict=True):
            slot = self._slot_of.get(seq_id)
            if slot is None:
                if computed:
                    raise RuntimeError(
                        f"sequence {seq_id} resumes at {computed} tokens without state"
                    )
                if not self._free:
                    raise RuntimeError(f"no free state slot of {self.num_slots} for {seq_id}")
                slot = self._slot_of[seq_id] = self._free.pop()
            out.append(slot)
        return out

    def release(self, seq_ids) -> None:
        for seq_id in seq_ids:
            slot = self._slot_of.pop(seq_id, None)
            if slot is not None:
                self._free.append(slot)

    def release_requests(self, request_ids, stashed: bool = False) -> None:
        """Every sequence of these requests (a fork's id is its request's + "#n"): their slots,
        and with `stashed` their swapped-out states too (finished requests, aborted ones
        included: a swapped-out request can be aborted)."""
        ids = set(request_ids)
        if not ids:
            return
        self.release([s for s in self._slot_of if s in ids or s.rpartition("#")[0] in ids])
        if stashed:
            for s in [s for s in self._stash if s in ids or s.rpartition("#")[0] in ids]:
                del self._stash[s]

    def fork(self, parent: str, child: str) -> None:
        """The child's own slot, holding a copy of the parent's state (nothing when the parent
        holds none: a preempted group recomputes from fresh states)."""
        source = self._slot_of.get(parent)
        if source is None:
            return
        self.release([child])
        slot = self.slots([child], [0])[0]
        for state in self.layers.values():
            state.conv[slot].copy_(state.conv[source])
            state.ssm[slot].copy_(state.ssm[source])

    def load_checkpoints(self, loads: list[tuple[str, int]]) -> None:
        """Each (sequence, checkpoint slot): the checkpoint copied into a new slot of the
        sequence, which continues from it (a prefix-cache hit), before the step."""
        for seq_id, checkpoint in loads:
            self.release([seq_id])
            slot = self.slots([seq_id], [0])[0]
            for state, saved in zip(self.layers.values(), self.checkpoints.values(), strict=True):
                state.conv[slot].copy_(saved.conv[checkpoint])
                state.ssm[slot].copy_(saved.ssm[checkpoint])

    def save_checkpoints(self, saves: list[tuple[str, int]]) -> None:
        """Each (sequence, checkpoint slot): the sequence's state copied there, after the step
        that reached the block boundary (in order: a later save to a slot wins)."""
        for seq_id, checkpoint in saves:
            slot = self._slot_of.get(seq_id)
            if slot is None:  # cannot happen: a scheduled sequence holds a slot
                continue
            for state, saved in zip(self.layers.values(), self.checkpoints.values(), strict=True):
                saved.conv[checkpoint].copy_(state.conv[slot])
                saved.ssm[checkpoint].copy_(state.ssm[slot])

    def swap_out(self, seq_ids) -> None:
        """Each sequence's state to the host stash, its slot freed (its group's blocks went to
        the swap space). A sequence without a slot (nothing computed yet) has nothing to keep.
        The scheduler never swaps out more than the stash holds: past it, a RuntimeError."""
        held = [s for s in seq_ids if s in self._slot_of]
        if len(self._stash) + len(held) > self.num_slots:
            raise RuntimeError(f"the state stash holds {self.num_slots} sequences: it is full")
        for seq_id in held:
            slot = self._slot_of[seq_id]
            self._stash[seq_id] = [
                (state.conv[slot].to("cpu", copy=True), state.ssm[slot].to("cpu", copy=True))
                for state in self.layers.values()
            ]
        self.release(held)

    def swap_in(self, seq_ids) -> None:
        """Each stashed sequence's state back into a free slot (its old one may be another's
        by now), before the step that continues it."""
        for seq_id in seq_ids:
            saved = self._stash.pop(seq_id, None)
            if saved is None:
                continue
            slot = self.slots([seq_id], [0])[0]
            for state, (conv, ssm) in zip(self.layers.values(), saved, strict=True):
                state.conv[slot].copy_(conv)
                state.ssm[slot].copy_(ssm)

    @property
    def stashed(self) -> set[str]:
        """The swapped-out sequences whose state the stash holds."""
        return set(self._stash)

    def release_all(self) -> None:
        self.release(list(self._slot_of))
        self._stash.clear()

    @property
    def num_used(self) -> int:
        return len(self._slot_of)

    def check_integrity(self) -> None:
        """Every slot either free or one sequence's, never both, never twice; a stashed
        sequence holds no slot, and the stash keeps its bound."""
        used = list(self._slot_of.values())
        assert len(set(used)) == len(used), "a slot held by two sequences"
        assert not set(used) & set(self._free), "a held slot is also free"
        assert sorted(used + self._free) == list(range(self.num_slots)), "a slot lost"
        assert not self._stash.keys() & self._slot_of.keys(), "a stashed sequence holds a slot"
        assert len(self._stash) <= self.num_slots, "the stash is past its bound"
