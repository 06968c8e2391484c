"""The KV snapshot the dashboard draws (engine/kv_snapshot.py) against the pool's own integrity
check, step by step under a workload that shares (n > 1, a common prefix), swaps and recomputes;
also the contiguous reservations and sliding-window tables. Tiny random models (fast)."""

import json

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from tests.conftest import save_tiny_llama

BLOCK = 4
PREFIX = [5, 9, 14, 20, 27, 33, 41, 48, 50, 61]  # shared by every prompt: 2 full blocks


def assert_consistent(snap: dict) -> None:
    """What a snapshot must satisfy on its own: its counts add up to the pool (free + cached +
    used + reserved == total), every reference count equals the number of table entries (of
    the listed sequences) pointing at the block, owners hold what they own, and the shared
    count is the number of blocks with a reference count above 1."""
    json.dumps(snap)  # what the server sends
    assert snap["integrity"] == {"ok": True, "error": None}, snap["integrity"]
    for key in ("pool", "swap"):
        pool = snap[key]
        if pool is None:
            continue
        n, ref_cnt, counts = pool["num_blocks"], pool["ref_cnt"], pool["counts"]
        assert len(ref_cnt) == len(pool["owner"]) == n
        assert counts["free"] + counts["cached"] + counts["used"] + counts["reserved"] == n
        assert counts["used"] == sum(1 for c in ref_cnt if c > 0)
        assert counts["shared"] == sum(1 for c in ref_cnt if c > 1)
        assert counts["cached"] == sum(1 for b in pool["cached"] if ref_cnt[b] == 0)
        assert len(set(pool["cached"])) == len(pool["cached"])
        references = [0] * n
        held_by = [set() for _ in range(n)]
        for index, request in enumerate(snap["requests"]):
            for seq in request["seqs"]:
                if seq["swapped"] != (key == "swap"):
                    continue
                for table in seq["block_tables"]:
                    for b in table:
                        if b >= 0:
                            references[b] += 1
                            held_by[b].add(index)
        reserved = set(pool.get("reserved", ()))
        # Reserved blocks (contiguous regions) hold no token: no table points at them.
        expected = [0 if b in reserved else c for b, c in enumerate(ref_cnt)]
        assert references == expected, f"{key}: reference counts disagree with the tables"
        for b, owner in enumerate(pool["owner"]):
            assert (owner >= 0) == (references[b] > 0)
            if owner >= 0:
                assert owner == min(held_by[b])


def _snapshots(engine: LLMEngine):
    """Run the engine dry, yielding a checked snapshot before the first step and after each."""
    while True:
        snap = engine.kv_snapshot(check=True)
        assert_consistent(snap)
        yield snap
        if not engine.has_unfinished_requests():
            return
        engine.step()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-snapshot")
    save_tiny_llama(path)
    return str(path)


def _engine(path, **kwargs) -> LLMEngine:
    kwargs = {"block_size": BLOCK, "max_model_len": 64, "num_gpu_blocks_override": 32, **kwargs}
    return LLMEngine(EngineArgs(model=path, dtype="float32", device="cpu", **kwargs))


def _add_workload(engine: LLMEngine) -> None:
    for i in range(6):
        prompt = PREFIX + [(7 * i + j) % 100 + 3 for j in range(3 + i)]
        n = (3, 2, 1)[i % 3]
        params = SamplingParams(n=n, temperature=1.0, seed=i, max_tokens=16, ignore_eos=True)
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_snapshot_matches_the_pool_under_sharing_and_preemption(tiny, mode):
    engine = _engine(tiny, preemption_mode=mode, swap_space=0.001)
    assert engine.num_cpu_blocks > 0 if mode == "swap" else engine.num_cpu_blocks == 0
    _add_workload(engine)
    seen = {"shared": 0, "statuses": set(), "swap_used": 0, "cached": 0}
    for snap in _snapshots(engine):
        scheduler = engine.scheduler
        listed = {r["request_id"]: r["status"] for r in snap["requests"]}
        assert {g.request_id for g in scheduler.running} == {
            r for r, s in listed.items() if s == "running"
        }
        assert {g.request_id for g in scheduler.swapped} == {
            r for r, s in listed.items() if s == "swapped"
        }
        for request in snap["requests"]:
            group = scheduler.requests[request["request_id"]]
            assert [s["seq_id"] for s in request["seqs"]] == [s.seq_id for s in group.seqs]
            for seq, live in zip(request["seqs"], group.seqs, strict=True):
                assert seq["num_computed_tokens"] == live.num_computed_tokens
                assert seq["num_tokens"] == live.num_tokens
        stats = engine.get_stats()
        assert snap["stats"]["num_running"] == stats["num_running"]
        assert snap["pool"]["counts"]["used"] == round(stats["kv_cache_usage"] * engine.num_blocks)
        seen["shared"] = max(seen["shared"], snap["pool"]["counts"]["shared"])
        seen["cached"] = max(seen["cached"], snap["pool"]["counts"]["cached"])
        seen["statuses"] |= set(listed.values())
        if snap["swap"] is not None:
            seen["swap_used"] = max(seen["swap_used"], snap["swap"]["counts"]["used"])
    assert seen["shared"] > 0, "the workload never shared a block"
    assert seen["cached"] > 0, "no freed block stayed in the prefix cache"
    assert "running" in seen["statuses"] and "waiting" in seen["statuses"]
    if mode == "swap":
        assert "swapped" in seen["statuses"] and seen["swap_used"] > 0
    else:
        assert "preempted" in seen["statuses"]
    final = engine.kv_snapshot(check=True)
    assert final["requests"] == [] and final["pool"]["counts"]["used"] == 0
    assert final["stats"]["num_first_tokens_total"] == 6
    assert final["stats"]["time_to_first_token_seconds_total"] > 0


def test_a_broken_pool_is_reported_not_raised(tiny):
    engine = _engine(tiny)
    _add_workload(engine)
    engine.step()
    engine.scheduler.kv_cache_manager.block_pool.blocks[0].ref_cnt += 5  # corrupt it
    snap = engine.kv_snapshot(check=True)
    assert snap["integrity"]["ok"] is False
    assert "reference counts" in snap["integrity"]["error"]
    assert "integrity" not in engine.kv_snapshot()  # only checked when asked


def test_contiguous_reservations_show_reserved_blocks(tiny):
    engine = _engine(tiny, kv_allocation="max", num_gpu_blocks_override=48)
    for i in range(2):
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        engine.add_request(f"r{i}", {"prompt_token_ids": PREFIX}, params)
    engine.step()
    snap = engine.kv_snapshot(check=True)
    assert_consistent(snap)
    counts = snap["pool"]["counts"]
    # Each request reserved max_model_len (16 blocks) and wrote 3 of them.
    assert counts["used"] == 2 * 3 and counts["reserved"] == 2 * (16 - 3)
    assert counts["shared"] == 0 and snap["config"]["kv_allocation"] == "max"
    for _ in _snapshots(engine):
        pass


def test_sliding_window_tables_mark_released_entries(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        use_sliding_window=True, sliding_window=8, max_window_layers=1,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    engine = _engine(str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine.add_request("long", {"prompt_token_ids": list(range(3, 30))}, params)
    released = 0
    for snap in _snapshots(engine):
        if snap["requests"]:
            (seq,) = snap["requests"][0]["seqs"]
            full, sliding = seq["block_tables"]
            assert -1 not in full
            released = max(released, sliding.count(-1))
            assert snap["config"]["num_kv_cache_groups"] == 2
    assert released > 0, "the sliding group released no block"
