"""A hybrid model's recurrent state in memory: for each Mamba layer, a pool of state slots
(layers/mamba2.py's RecurrentState), one slot per running sequence, assigned by the runner as
sequences arrive and freed as they finish or are preempted (a preempted sequence recomputes
its prompt from a fresh slot). max_num_seqs slots: the scheduler never runs more sequences."""

from __future__ import annotations

import torch

from pagedllm.config import ModelArchConfig
from pagedllm.layers.mamba2 import RecurrentState


class StatePool:
    def __init__(
        self, config: ModelArchConfig, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        conv, ssm = config.recurrent_state_shapes
        self.layers = {
            i: RecurrentState(
                torch.zeros((num_slots, *conv), dtype=dtype, device=device),
                torch.zeros((num_slots, *ssm), dtype=torch.float32, device=device),
            )
            for i in range(config.num_hidden_layers)
            if config.is_recurrent_layer(i)
        }
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[str, int] = {}

    def slots(self, seq_ids: list[str], num_computed: list[int]) -> list[int]:
        """Each sequence's slot, a free one for a sequence new to the pool. A sequence with
        tokens computed before it had a slot (a prefix-cache hit, a forked sample) has no state
        to resume: the engine never schedules one for a hybrid model (RuntimeError)."""
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

    def release_requests(self, request_ids) -> None:
        """Every sequence of these requests (a fork's id is its request's + "#n")."""
        ids = set(request_ids)
        if ids:
            self.release([s for s in self._slot_of if s in ids or s.rpartition("#")[0] in ids])

    def release_unscheduled(self, seq_ids: list[str]) -> None:
        """A step schedules every live sequence of its requests together (their samples or
        beams in lockstep): a sequence of one of them that is not scheduled has left (a pruned
        beam) and its slot goes."""
        live = set(seq_ids)
        requests = {s.rpartition("#")[0] or s for s in live} | live
        self.release([
            s for s in self._slot_of
            if s not in live and (s in requests or s.rpartition("#")[0] in requests)
        ])  # fmt: skip

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

    def release_all(self) -> None:
        self.release(list(self._slot_of))

    @property
    def num_used(self) -> int:
        return len(self._slot_of)

    def check_integrity(self) -> None:
        """Every slot either free or one sequence's, never both, never twice."""
        used = list(self._slot_of.values())
        assert len(set(used)) == len(used), "a slot held by two sequences"
        assert not set(used) & set(self._free), "a held slot is also free"
        assert sorted(used + self._free) == list(range(self.num_slots)), "a slot lost"
