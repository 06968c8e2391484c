"""Which waiting requests a step may admit when LoRA adapters are in play. Torch-free.

A step runs at most `max_loras` adapters (the worker's slots). A new request whose adapter would
be one too many waits while later requests that fit are admitted (FCFS within what fits, as
vLLM does), but once it has been passed over for LORA_MAX_SKIPPED_STEPS steps nothing is
admitted past it until its adapter fits, so requests for busy adapters cannot starve it.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.sequence import SequenceGroup

LORA_MAX_SKIPPED_STEPS = 32


class LoRAAdmission:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras  # 0: no LoRA, everything fits
        self.loras: set[int] = set()  # the step's adapters so far
        self._num_steps = 0
        self._blocked_since: dict[str, int] = {}  # request id -> first step passed over

    def start_step(self, running: Iterable[SequenceGroup]) -> None:
        self._num_steps += 1
        self.loras = {g.lora_int_id for g in running if g.lora_int_id is not None}

    def fits(self, group: SequenceGroup) -> bool:
        lora = group.lora_int_id
        return (
            not self.max_loras
            or lora is None
            or lora in self.loras
            or len(self.loras) < self.max_loras
        )

    def admitted(self, group: SequenceGroup) -> None:
        if group.lora_int_id is not None:
            self.loras.add(group.lora_int_id)
        self._blocked_since.pop(group.request_id, None)

    def first_fitting(self, waiting: Iterable[SequenceGroup]) -> SequenceGroup | None:
        """The earliest waiting group that fits, unless one before it has waited too long."""
        for group in waiting:
            if self.fits(group):
                return group
            since = self._blocked_since.setdefault(group.request_id, self._num_steps)
            if self._num_steps - since >= LORA_MAX_SKIPPED_STEPS:
                return None  # waited long enough: nothing passes it now
        return None

    def forget(self, request_id: str) -> None:
        self._blocked_since.pop(request_id, None)
