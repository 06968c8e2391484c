"""LoRA beside a linear layer: y += x A^T B^T for each row, with the A and B of the adapter in
the row's slot, for all rows of a step at once (S-LoRA / Punica's batched form).

Each LoRA-wrapped layer holds `max_loras` slots of stacked weights in the activations' dtype
(also over quantized base weights): A [slots, parts x rank, in] and B [slots, out, parts x
rank], where a packed layer (qkv_proj, gate_up_proj) stacks its parts' A along the rank and
places each part's B on its own rows (block-diagonal), so one product serves every part. The
scaling (lora_alpha / r) is folded into B. Slots are sized for --max-lora-rank; an adapter's
own rank bounds the columns each product uses.

A step's rows carry their slot (-1: the base model alone) in a `LoRAMapping`, shared by every
wrapped layer through one `LoRAContext`. On CPU each slot in the step is one gathered product
(rows indexed by slot; a step of one adapter multiplies every row without gathering); on a GPU
one Triton launch pair covers all slots (layers/lora_triton.py).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm import kernels


class LoRAMapping:
    """A step's rows -> adapter slots, as the layers use them: per slot in the step, the rows
    it covers (None: every row)."""

    def __init__(self, row_slots: np.ndarray, device: torch.device) -> None:
        slots = np.unique(row_slots[row_slots >= 0])
        self.row_slots = torch.from_numpy(np.ascontiguousarray(row_slots)).to(device)
        if len(slots) == 1 and (row_slots == slots[0]).all():
            self.segments = [(int(slots[0]), None)]
        else:
            self.segments = [
                (int(s), torch.from_numpy(np.flatnonzero(row_slots == s)).to(device)) for s in slots
            ]


class LoRAContext:
    """The current step's mapping, read by every wrapped layer (None: no LoRA rows)."""

    def __init__(self) -> None:
        self.mapping: LoRAMapping | None = None


class LoRASlots:
    """A linear layer's adapter slots (attached as `layer.lora`; layers/linear.py calls
    `apply` after the base product, before a row-parallel layer's all-reduce)."""

    def __init__(
        self,
        context: LoRAContext,
        num_slots: int,
        num_parts: int,
        max_rank: int,
        input_size: int,
        output_size: int,
        dtype: torch.dtype,
        device: torch.device,
        fixed_order: bool = False,
    ) -> None:
        """fixed_order (--deterministic): the products in the kernels' fixed order, so a row's
        result does not depend on the other rows of the step (docs/determinism.md)."""
        self.context = context
        self.fixed_order = fixed_order
        self.num_parts, self.max_rank = num_parts, max_rank
        columns = num_parts * max_rank
        self.a = torch.zeros(num_slots, columns, input_size, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, output_size, columns, dtype=dtype, device=device)
        self.columns = [0] * num_slots  # parts x the adapter's rank: the columns in use
        # fixed_order's kernel takes a contiguous weight: each slot's B columns in use, copied
        self.b_used: list[torch.Tensor | None] = [None] * num_slots

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Fill a slot with one adapter's packed A [c, in] and B [out, c] (None: this
        adapter leaves the layer alone)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if a is None:
            self.columns[slot] = 0
            return
        c = a.shape[0]
        self.a[slot, :c].copy_(a)
        self.b[slot, :, :c].copy_(b)
        self.columns[slot] = c
        if self.fixed_order:
            self.b_used[slot] = self.b[slot, :, :c].contiguous()

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y [T, out] += each row's adapter product, in place."""
        mapping = self.context.mapping
        if mapping is None:
            return
        if y.device.type == "cuda":
            from pagedllm.layers.lora_triton import add_lora_triton

            add_lora_triton(y, x, self.a, self.b, mapping.row_slots)
            return
        fixed = self.fixed_order and kernels.fixed_order(x)
        for slot, rows in mapping.segments:
            c = self.columns[slot]
            if not c:
                continue
            a, b = self.a[slot, :c], self.b[slot, :, :c]
            if rows is None and not fixed:
                y.addmm_(x @ a.t(), b.t())
                continue
            xs = x if rows is None else x.index_select(0, rows)
            if fixed:
                d = _fixed_order(_fixed_order(xs, a), self.b_used[slot])
            else:
                d = (xs @ a.t()) @ b.t()
            if rows is None:
                y += d
            else:
                y.index_add_(0, rows, d)


def _fixed_order(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    dense = kernels.cpu_ops().dense_linear
    return kernels.in_float32(lambda x32: dense(x32.contiguous(), weight, None), x)
