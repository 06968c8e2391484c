"""Prefix caching for hybrid models: the index of recurrent-state checkpoints. Torch-free.

A cached prefix of K/V blocks is of no use to a hybrid model (Mamba-2, Gated DeltaNet layers)
without the recurrent state at the prefix's end, which it cannot recompute from the blocks. As
vLLM's hybrid allocator does in its "align" mode, a prompt's state is kept at one block boundary:
its checkpoint, a copy of every recurrent layer's (conv, ssm) state, named by the hash of the
block that ends there (block_hash.py: the hash names the whole prefix, LoRA adapter and cache
salt included). The runner holds the checkpoints' tensors beside its state pool
(worker/state_pool.py); this index, beside the block pool, decides which prefix hits a hybrid
model may take, and where each checkpoint goes.

- When: one checkpoint per prompt, at its last full block before its last token,
  (num_prompt_tokens - 1) // block_size * block_size tokens (if > 0): the deepest hit a later
  identical prompt may take (a hit always leaves the last token to compute), and the common
  part of a prompt that a later one extends (a chat's next turn) but for at most one block.
  A sequence group of one sequence has its prompt chunk end there when it would cross it
  (`cap`; a group of several keeps its chunks in lockstep instead: a prompt that would have
  run whole in one step takes two), and after that step the runner copies the sequence's
  state into the checkpoint slot chosen here.
- Cost: each checkpoint takes recurrent_state_bytes of device memory, as a state slot does;
  the engine keeps up to max_num_seqs of them in a quarter of the KV cache's memory
  (config/engine_config.py _hybrid_states), counted in its budget with the state slots
  (worker/worker.py).
- Hits: a hybrid model's hit ends at the deepest matched block that has a checkpoint
  (`longest_hit`); the runner copies that checkpoint into the sequence's fresh state slot
  before the step, and the sequence continues from it (it is not fresh: tokens are computed).
- Lifetime: least recently used first out when a new checkpoint needs a slot, and dropped
  with its block when the prefix cache evicts it (`drop`, the block pool's eviction hook).

A checkpoint decided in a step is written after that step's forward pass; hits are decided
before the saves of the same step are (`plan_saves` runs last), so none reads one unwritten.
A load and a save of the same slot in one step are in order too: loads before the forward
pass, saves after it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from pagedllm.core.block_hash import update_block_hashes
from pagedllm.core.block_pool import BlockHash
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.sequence import Sequence

SlotMove = tuple[str, int]  # (seq id, checkpoint slot)


class StateCheckpoints:
    """Block hash -> checkpoint slot, at most `num_slots`, least recently used first out;
    `cached`: the prefix cache's hashes (a checkpoint is only kept for a cached block)."""

    def __init__(self, num_slots: int, block_size: int, cached: Container[BlockHash]) -> None:
        if num_slots < 1:
            raise ValueError(f"state checkpoints need at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.block_size = block_size
        self._cached = cached
        self._slot_of: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        # Since the last step, for the runner: checkpoints to restore into sequences' fresh
        # state slots before the forward pass, and sequences' states to save after it.
        self.loads: list[SlotMove] = []
        self.saves: list[SlotMove] = []

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slot_of

    def boundary(self, seq: Sequence) -> int:
        """Where the sequence's prompt is checkpointed (0: too short for one)."""
        return (seq.num_prompt_tokens - 1) // self.block_size * self.block_size

    def cap(self, seq: Sequence, num_computed: int, num_new: int) -> int:
        """`num_new` tokens from `num_computed`, stopped at the checkpoint if they would cross
        it, so that a step ends there."""
        end = self.boundary(seq)
        return end - num_computed if num_computed < end < num_computed + num_new else num_new

    def longest_hit(self, hashes: list[BlockHash], num_blocks: int) -> int:
        """The most of the first `num_blocks` blocks a hit may take: up to the deepest one
        with a checkpoint (0: none)."""
        while num_blocks and hashes[num_blocks - 1] not in self._slot_of:
            num_blocks -= 1
        return num_blocks

    def restore(self, seq: Sequence, num_blocks: int) -> None:
        """The sequence was admitted with a hit of `num_blocks` blocks (`longest_hit`): the
        runner restores that block's checkpoint into its state slot."""
        block_hash = seq.block_hashes[num_blocks - 1]
        self._slot_of.move_to_end(block_hash)
        self.loads.append((seq.seq_id, self._slot_of[block_hash]))

    def plan_saves(self, out: SchedulerOutput) -> None:
        """The step's scheduled sequences whose chunk ends at their checkpoint: each one's state
        to a slot after the step (none if that prefix has one already)."""
        for seq in out.scheduled_requests:
            end = self.boundary(seq)
            if end <= 0 or seq.num_computed_tokens + out.num_scheduled_tokens[seq.seq_id] != end:
                continue
            block_hash = update_block_hashes(seq, self.block_size)[end // self.block_size - 1]
            if block_hash in self._slot_of:
                self._slot_of.move_to_end(block_hash)
            elif block_hash in self._cached:
                if self._free:
                    slot = self._free.pop()
                else:
                    _, slot = self._slot_of.popitem(last=False)
                self._slot_of[block_hash] = slot
                self.saves.append((seq.seq_id, slot))

    def drop(self, block_hash: BlockHash) -> None:
        """The prefix cache evicted this block: its checkpoint, if any, goes too."""
        slot = self._slot_of.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._slot_of.clear()

    def check_integrity(self) -> None:
        """Every slot free or one checkpoint's, and every checkpoint's block cached."""
        used = list(self._slot_of.values())
        assert sorted(used + self._free) == list(range(self.num_slots)), "a checkpoint slot lost"
        assert all(h in self._cached for h in self._slot_of), "a checkpoint outlived its block"


def hand_over_state_moves(kv, out: SchedulerOutput) -> None:
    """What the runner does to a hybrid model's recurrent states for this step, collected by
    the KV cache manager `kv` since the last one: slots freed, forks, checkpoints restored and
    saved (the last planned here, once the step is). Other models' runners ignore them. An
    empty step never reaches the runner: they wait for the next."""
    if out.is_empty:
        return
    if hasattr(kv, "take_freed"):
        out.freed_seqs = kv.take_freed()
    forks = getattr(kv, "forks", None)
    if forks:
        out.forked_seqs, kv.forks = forks, []
    checkpoints = getattr(kv, "state_checkpoints", None)
    if checkpoints is not None:
        checkpoints.plan_saves(out)
        out.state_checkpoint_loads, checkpoints.loads = checkpoints.loads, []
        out.state_checkpoint_saves, checkpoints.saves = checkpoints.saves, []
