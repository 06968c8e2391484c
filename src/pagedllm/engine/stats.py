"""EngineStats: the engine's counters, one typed struct that says what each field is. Gauges
are the state now: a new engine process starts them over, and replicas' usage shares are
averaged (MEANS); every other field is a total since the engine started, carried over engine
process restarts (engine/core_client.py) and summed over replicas (engine/dp_client.py). It
crosses the process boundary as it is (engine/core_channel.py); callers read `as_dict()`, as
`get_stats()` gives it (the metrics endpoint, the dashboard, the benchmarks)."""

from __future__ import annotations

from typing import ClassVar

import msgspec

from pagedllm.engine.counters import add_counter


class EngineStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    GAUGES: ClassVar[frozenset[str]] = frozenset(
        {"num_running", "num_waiting", "num_swapped", "kv_cache_usage", "swap_space_usage"}
    )
    MEANS: ClassVar[frozenset[str]] = frozenset({"kv_cache_usage", "swap_space_usage"})

    # gauges
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0
    swap_space_usage: float = 0.0
    # totals
    num_preemptions_total: int = 0
    num_swap_preemptions_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_prompt_tokens_total: int = 0
    num_generation_tokens_total: int = 0
    num_first_tokens_total: int = 0
    time_to_first_token_seconds_total: float = 0.0
    num_copied_blocks: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    # Speculative decoding's (vLLM's names), when it is on.
    spec_decode_num_drafts: int | None = None
    spec_decode_num_draft_tokens: int | None = None
    spec_decode_num_accepted_tokens: int | None = None
    spec_decode_num_accepted_tokens_per_pos: list[int] | None = None

    def as_dict(self) -> dict:
        """The fields set (speculative decoding's only when it is on)."""
        return {f: v for f in self.__struct_fields__ if (v := getattr(self, f)) is not None}

    def totals(self) -> EngineStats:
        """These counters with the gauges at zero: what an engine process that is gone
        leaves behind."""
        return msgspec.structs.replace(self, **dict.fromkeys(self.GAUGES, 0))

    def plus(self, other: EngineStats) -> EngineStats:
        """Field by field: the totals summed, the gauges `other`'s (the engine now)."""
        fields = {}
        for name in self.__struct_fields__:
            mine, theirs = getattr(self, name), getattr(other, name)
            fields[name] = theirs if name in self.GAUGES else add_counter(mine, theirs)
        return EngineStats(**fields)
