"""LoRARequest: which adapter a request runs with, as vLLM spells it (`lora_name`,
`lora_int_id`, `lora_path`). The id names the adapter's weights everywhere below the API: the
worker's caches and slots, and the prefix cache's hashes (two adapters never share K/V), so an
adapter loaded again from another path must get a new id."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")

    # vLLM's short names
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
