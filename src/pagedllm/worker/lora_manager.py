"""A rank's LoRA adapters: `max_loras` slots in every wrapped layer (layers/lora.py), an LRU of
up to `max_cpu_loras` adapters read and cut to this rank's shards in host memory, and the step's
rows -> slots.

Rank 0 decides which slot each adapter of a step takes (`plan`: adapters already resident keep
theirs, others take a free slot or the least recently used one not in the step; the scheduler
admits no more adapters than slots). Every rank then fills the slots it is told (`load`) and runs
the step's mapping, so the ranks of a tensor-parallel group agree slot for slot.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagedllm.config import LoRAConfig, ModelArchConfig
from pagedllm.layers.linear import LinearBase, RowParallelLinear
from pagedllm.layers.lora import LoRAContext, LoRAMapping, LoRASlots
from pagedllm.lora_request import LoRARequest
from pagedllm.model_loader.lora_adapter import LoRAAdapter, load_lora_adapter

# One rank's packed (A, B) per wrapped layer, None where the adapter leaves it alone.
Packed = list[tuple[torch.Tensor, torch.Tensor] | None]


class LoRALoadError(ValueError):
    """An adapter rank 0 could not read when a step needed it (its files changed or went away
    after it was checked): raised before the step reaches any rank, so the engine fails that
    adapter's requests alone."""

    def __init__(self, lora_int_id: int, reason: str) -> None:
        super().__init__(reason)
        self.lora_int_id = lora_int_id


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        config: LoRAConfig,
        arch: ModelArchConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config, self.arch, self.dtype, self.device = config, arch, dtype, device
        self.context = LoRAContext()
        # Every projection of the decoder layers, with the HF names of its parts (q/k/v of a
        # qkv_proj) or itself (an adapter may target a fused layer whole). Not the experts of a
        # mixture: each multiplies a subset of the step's rows, in expert order, which the
        # per-row adapter mapping does not follow (an adapter for them is refused as unknown).
        packed = getattr(model, "packed_modules_mapping", {})
        self.layers: list[tuple[str, LinearBase, list[str]]] = []
        for name, module in model.named_modules():
            if not isinstance(module, LinearBase) or ".layers." not in name or ".experts." in name:
                continue
            prefix, _, leaf = name.rpartition(".")
            parts = [f"{prefix}.{p}" for p in packed.get(leaf, [leaf])]
            module.lora = LoRASlots(
                self.context, config.max_loras, len(parts), config.max_lora_rank,
                module.input_size_per_partition, module.output_size_per_partition, dtype, device,
            )  # fmt: skip
            self.layers.append((name, module, parts))
        self.slot_ids: list[int | None] = [None] * config.max_loras  # adapter id per slot
        self.slot_lru: OrderedDict[int, None] = OrderedDict()  # resident ids, least recent first
        self.cpu_cache: OrderedDict[int, Packed] = OrderedDict()

    @property
    def row_slots(self) -> torch.Tensor | None:
        """Each row's adapter slot this step (None: no adapter rows), for the fused decoder."""
        mapping = self.context.mapping
        return None if mapping is None else mapping.row_slots

    @property
    def slot_bytes(self) -> int:
        return sum(m.lora.a.nbytes + m.lora.b.nbytes for _, m, _ in self.layers)

    # -- rank 0 -------------------------------------------------------------------------------
    def plan(self, adapters: list[LoRARequest]) -> tuple[dict[int, int], list]:
        """Slots for the step's adapters (distinct ids, at most max_loras): {id: slot} and the
        (slot, request) loads every rank must make first. Adapters that are not resident are
        read first (LoRALoadError if one cannot be), before any slot changes."""
        assert len(adapters) <= len(self.slot_ids), "the scheduler admits max_loras adapters"
        for r in adapters:
            if r.lora_int_id not in self.slot_lru:
                self._cached(r, LoRALoadError)
        wanted = {r.lora_int_id for r in adapters}
        slots, loads = {}, []
        for r in adapters:
            if r.lora_int_id in self.slot_lru:
                slots[r.lora_int_id] = self.slot_ids.index(r.lora_int_id)
        for r in adapters:
            if r.lora_int_id in slots:
                continue
            if None in self.slot_ids:
                slot = self.slot_ids.index(None)
            else:
                victim = next(i for i in self.slot_lru if i not in wanted)
                slot = self.slot_ids.index(victim)
            slots[r.lora_int_id] = slot
            loads.append((slot, r))
            self._assign(slot, r.lora_int_id)
        for i in wanted:
            self.slot_lru.move_to_end(i)
        return slots, loads

    def _unassign(self, slot: int) -> None:
        old = self.slot_ids[slot]
        if old is not None:
            del self.slot_lru[old]
            self.slot_ids[slot] = None

    def _assign(self, slot: int, lora_id: int) -> None:
        old = self.slot_ids[slot]
        if old is not None:
            del self.slot_lru[old]
        self.slot_ids[slot] = lora_id
        self.slot_lru[lora_id] = None

    # -- every rank -----------------------------------------------------------------------------
    def load(self, slot: int, request: LoRARequest) -> None:
        """Fill `slot` with the adapter (read from disk unless in the host LRU)."""
        try:
            packed = self._cached(request)
        except Exception:
            self._unassign(slot)  # not resident: the next step that needs it loads again
            raise
        for (_, module, _), ab in zip(self.layers, packed, strict=True):
            module.lora.set_slot(slot, *(ab if ab is not None else (None, None)))
        if self.slot_ids[slot] != request.lora_int_id:  # ranks other than 0 follow rank 0
            self._assign(slot, request.lora_int_id)

    def _cached(self, request: LoRARequest, error: type | None = None) -> Packed:
        """The adapter cut to this rank's shards, from the host LRU or read now (a failure
        raised as `error`, if given)."""
        packed = self.cpu_cache.get(request.lora_int_id)
        if packed is None:
            try:
                adapter = load_lora_adapter(request.lora_path, self.arch, self.config.max_lora_rank)
            except Exception as e:
                if error is None:
                    raise
                raise error(request.lora_int_id, f"LoRA adapter {request.lora_name!r}: {e}") from e
            packed = self._pack(adapter)
            self.cpu_cache[request.lora_int_id] = packed
            while len(self.cpu_cache) > self.config.max_cpu_loras:
                self.cpu_cache.popitem(last=False)
        self.cpu_cache.move_to_end(request.lora_int_id)
        return packed

    def set_mapping(self, row_slots: np.ndarray | None) -> None:
        """The step's rows -> slots (-1: none); None or all -1: no LoRA this step."""
        if row_slots is None or not len(row_slots) or (row_slots < 0).all():
            self.context.mapping = None
        else:
            self.context.mapping = LoRAMapping(row_slots, self.device)

    def _pack(self, adapter: LoRAAdapter) -> Packed:
        """This rank's shard of each layer's parts, stacked as LoRASlots holds them: part i's
        A in rows i*r.., its B in columns i*r.. of the part's own output rows."""
        r, packed = adapter.rank, []
        for name, module, parts in self.layers:
            found = [adapter.modules.get(p) for p in parts]
            whole = adapter.modules.get(name) if len(parts) > 1 else None
            if whole is not None:  # a fused projection adapted whole: its B covers every part
                found = _split_whole(whole, module)
            if not any(found):
                packed.append(None)
                continue
            a = torch.zeros(len(parts) * r, module.input_size_per_partition)
            b = torch.zeros(module.output_size_per_partition, len(parts) * r)
            row = 0
            for i, (pair, shard) in enumerate(zip(found, module.output_shards, strict=True)):
                if pair is not None:
                    pa, pb = pair
                    k = pa.shape[0]
                    if isinstance(module, RowParallelLinear):
                        start, n = module.input_start, module.input_size_per_partition
                        pa = pa[:, start : start + n]
                    a[i * r : i * r + k] = pa
                    b[row : row + shard.rows, i * r : i * r + k] = pb[
                        shard.start : shard.start + shard.rows
                    ]
                row += shard.rows
            packed.append((a.to(self.dtype), b.to(self.dtype)))
        return packed


def _split_whole(pair, module: LinearBase) -> list:
    """A fused projection's (A, B) as one pair per part: the same A, B's rows cut into the
    parts (the checkpoint's full rows, before this rank's shard is taken)."""
    a, b = pair
    out, start = [], 0
    for shard in module.output_shards:
        out.append((a, b[start : start + shard.full_rows]))
        start += shard.full_rows
    return out
