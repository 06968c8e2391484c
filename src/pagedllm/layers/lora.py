"""LoRA beside a linear layer: y += x A^T B^T for each row, with the A and B of the adapter in
the row's slot, for all rows of a step at once (S-LoRA / Punica's batched form).

Each LoRA-wrapped layer holds `max_loras` slots of stacked weights in the activations' dtype
(also over quantized base weights): A [slots, parts x rank, in] and B [slots, out, parts x
rank] ([slots, parts x rank, out] on CPU), where a packed layer (qkv_proj, gate_up_proj) stacks
its parts' A along the rank and places each part's B on its own rows (block-diagonal), so one
product serves every part. The scaling (lora_alpha / r) is folded into B. Slots are sized for
--max-lora-rank; an adapter's own rank bounds the columns each product uses.

A step's rows carry their slot (-1: the base model alone) in a `LoRAMapping`, shared by every
wrapped layer through one `LoRAContext`. On CPU one C++ call covers all rows
(kernels/csrc/lora.cpp: each row in one order, so batch invariant), torch's products per slot
where it does not apply (no C++ kernels, float16); on a GPU one Triton launch pair
(layers/lora_triton.py).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from pagedllm import kernels


class LoRAMapping:
    """A step's rows -> adapter slots, as the layers use them."""

    def __init__(self, row_slots: np.ndarray, device: torch.device) -> None:
        self.row_slots_np, self.device = row_slots, device
        self.row_slots = torch.from_numpy(np.ascontiguousarray(row_slots)).to(device)

    @functools.cached_property
    def segments(self) -> list[tuple[int, torch.Tensor | None]]:
        """Per slot in the step, the rows it covers (None: every row); only the torch path
        needs them."""
        row_slots = self.row_slots_np
        slots = np.unique(row_slots[row_slots >= 0])
        if len(slots) == 1 and (row_slots == slots[0]).all():
            return [(int(slots[0]), None)]
        return [
            (int(s), torch.from_numpy(np.flatnonzero(row_slots == s)).to(self.device))
            for s in slots
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
    ) -> None:
        self.context = context
        r = num_parts * max_rank
        self.a = torch.zeros(num_slots, r, input_size, dtype=dtype, device=device)
        # B by rank on CPU ([slots, r, out]: the kernel's expand reads outputs in a row), by
        # output for the Triton kernel ([slots, out, r])
        by_output = device.type == "cuda"
        shape = (num_slots, output_size, r) if by_output else (num_slots, r, output_size)
        self.b = torch.zeros(shape, dtype=dtype, device=device)
        # parts x the adapter's rank: the columns in use (a tensor: the C++ kernels read it)
        self.columns = torch.zeros(num_slots, dtype=torch.long)

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
        if self.b.device.type == "cuda":
            self.b[slot, :, :c].copy_(b)
        else:
            self.b[slot, :c].copy_(b.t())
        self.columns[slot] = c

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y [T, out] += each row's adapter product, in place."""
        mapping = self.context.mapping
        if mapping is None:
            return
        if y.device.type == "cuda":
            from pagedllm.layers.lora_triton import add_lora_triton

            add_lora_triton(y, x, self.a, self.b, mapping.row_slots)
        elif kernels.fixed_order(x):  # the C++ kernel: each row alone, batch invariant
            kernels.cpu_ops().add_lora(
                y, x.contiguous(), self.a, self.b, mapping.row_slots, self.columns
            )
        else:
            for slot, rows in mapping.segments:
                c = int(self.columns[slot])
                if c:
                    xs = x if rows is None else x.index_select(0, rows)
                    d = (xs @ self.a[slot, :c].t()) @ self.b[slot, :c]
                    y.index_add_(0, rows, d) if rows is not None else y.add_(d)
