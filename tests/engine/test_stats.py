"""EngineStats (engine/stats.py): what a restarted engine process's counters add up to, and what
crosses the channel."""

from pagedllm.engine import core_channel as channel
from pagedllm.engine.stats import EngineStats


def test_totals_carry_over_a_restart_and_gauges_start_over():
    first = EngineStats(
        num_running=3,
        kv_cache_usage=0.5,
        num_prompt_tokens_total=100,
        spec_decode_num_drafts=4,
        spec_decode_num_accepted_tokens_per_pos=[3, 1],
    )
    second = EngineStats(
        num_running=1,
        kv_cache_usage=0.25,
        num_prompt_tokens_total=7,
        spec_decode_num_drafts=2,
        spec_decode_num_accepted_tokens_per_pos=[2],
    )
    carried = EngineStats().plus(first.totals())
    assert carried.num_running == 0 and carried.kv_cache_usage == 0
    now = carried.plus(second).as_dict()
    assert now["num_running"] == 1 and now["kv_cache_usage"] == 0.25  # the engine now
    assert now["num_prompt_tokens_total"] == 107 and now["spec_decode_num_drafts"] == 6
    assert now["spec_decode_num_accepted_tokens_per_pos"] == [5, 1]


def test_speculative_decodings_counters_only_when_it_is_on():
    stats = EngineStats(num_waiting=2).as_dict()
    assert "spec_decode_num_drafts" not in stats and stats["num_waiting"] == 2
    assert set(EngineStats.GAUGES) <= set(stats) and EngineStats.MEANS <= EngineStats.GAUGES


def test_the_counters_cross_the_channel_typed():
    stats = EngineStats(num_running=2, time_to_first_token_seconds_total=1.5,
                        spec_decode_num_accepted_tokens_per_pos=[1, 0])  # fmt: skip
    frame = channel.encode(channel.Outputs([], stats, {"running": ["a"]}, 3))
    message = channel.decode_from_engine(frame)
    assert isinstance(message.stats, EngineStats) and message.stats == stats
    assert message.lora_stats == {"running": ["a"]} and message.num_steps == 3
