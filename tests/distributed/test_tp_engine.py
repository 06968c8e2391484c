"""The engine with --tensor-parallel-size 2 (this process and one worker it spawns, over gloo)
against one rank: the same greedy tokens with sharing, prefix caching and swap preemption, the
same log-probabilities to float32 tolerance; the KV pool split by heads with the same block
ids; clear errors; a dead worker stops the engine; shutdown leaves no process."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.distributed import tp_group
from pagedllm.distributed.process_group import RankExited
from pagedllm.executor import multiproc
from tests.conftest import save_tiny_llama

ROOT = Path(__file__).resolve().parents[2]

PROMPTS = [[5, 9, 3], [17, 4, 88, 23, 6, 70, 11, 42, 9, 1, 66], [100], list(range(10, 40))]
ENGINE = dict(dtype="float32", kv_cache_memory="8MiB")


@pytest.fixture(scope="module", params=[2, 1], ids=["kv_heads2", "kv_heads1"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(path, seed=5, num_key_value_heads=request.param)
    return str(path)


def generate(llm):
    sampling = [
        SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.8, n=3, seed=7, max_tokens=12, ignore_eos=True),  # forks
    ]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + [[5, 9, 3, 7, 7]]]
    outs = llm.generate(prompts, [sampling[0]] * 4 + [sampling[1]], use_tqdm=False)
    llm.llm_engine.scheduler.check_integrity()
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


def assert_same(tp2, tp1):
    for a, b in zip(tp2, tp1, strict=True):
        for (tokens_a, lps_a), (tokens_b, lps_b) in zip(a, b, strict=True):
            assert tokens_a == tokens_b
            for step_a, step_b in zip(lps_a or [], lps_b or [], strict=True):
                assert step_a.keys() == step_b.keys()
                for t in step_a:
                    assert step_a[t].logprob == pytest.approx(step_b[t].logprob, abs=1e-4)


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}


@pytest.mark.parametrize(
    "engine",
    [
        {},
        dict(preemption_mode="swap", num_gpu_blocks_override=16, block_size=4, max_model_len=64),
        dict(speculative_config=SPEC),  # drafts from rank 0, verified by both
    ],
    ids=["default", "swap_preemption", "speculative"],
)
def test_two_ranks_give_one_ranks_outputs(checkpoint, engine):
    single = LLM(model=checkpoint, **{**ENGINE, **engine})
    threads = torch.get_num_threads()
    expected = generate(single)
    llm = LLM(model=checkpoint, tensor_parallel_size=2, **{**ENGINE, **engine})
    try:
        heads = llm.llm_engine.kv_cache_spec.num_kv_heads
        single_heads = single.llm_engine.kv_cache_spec.num_kv_heads
        assert tp_group().size == 2
        assert heads == max(1, single_heads // 2)
        # Half the KV heads on each rank (unless one is replicated): twice the blocks in the
        # same memory; the override fixes the count.
        ratio = single_heads // heads
        ratio = 1 if "num_gpu_blocks_override" in engine else ratio
        assert llm.llm_engine.num_blocks == single.llm_engine.num_blocks * ratio
        got = generate(llm)
        assert_same(got, expected)
        assert_same(generate(llm), expected)  # again, now from the prefix cache
        if "speculative_config" in engine:
            assert llm.llm_engine.scheduler.spec_decode_stats.num_accepted_tokens > 0
        elif engine:
            assert llm.llm_engine.scheduler.num_preemptions_total > 0
            assert llm.llm_engine.get_stats()["num_swapped_out_blocks"] > 0
        procs = llm.llm_engine.executor.procs
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in procs)
    assert tp_group().size == 1
    assert torch.get_num_threads() == threads  # rank 0's share of the cores, given back


def test_a_dead_worker_stops_the_engine(checkpoint):
    llm = LLM(model=checkpoint, tensor_parallel_size=2, **ENGINE)
    procs = llm.llm_engine.executor.procs
    try:
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(10)
        with pytest.raises(RuntimeError, match="worker rank 1 exited"):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], use_tqdm=False)
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in procs)


def test_head_split_is_checked_before_starting(checkpoint):
    with pytest.raises(ValueError, match="cannot split 4 attention heads"):
        LLM(model=checkpoint, tensor_parallel_size=3, **ENGINE)
    assert tp_group().size == 1


@pytest.mark.parametrize(
    ("checkpoint", "quantization"), [(1, "int8"), (2, "int4")],
    ids=["kv_heads1-int8", "kv_heads2-int4"], indirect=["checkpoint"],
)  # fmt: skip
def test_quantized_weights_on_two_ranks(checkpoint, quantization):
    """Each rank quantizes its slices of the weights (its input columns of o_proj and down_proj
    whole groups of 32): one rank's tokens, its log-probabilities to float32 tolerance. One
    head split per format, replicated KV heads with int8 and split ones with int4; the model-level
    tests (test_tp_model.py) run both formats, made here and taken from a GGUF's codes."""
    expected = generate(LLM(model=checkpoint, quantization=quantization, **ENGINE))
    llm = LLM(model=checkpoint, tensor_parallel_size=2, quantization=quantization, **ENGINE)
    try:
        assert_same(generate(llm), expected)
    finally:
        llm.shutdown()


def test_a_group_that_cannot_connect_names_what_to_check(checkpoint, monkeypatch):
    with socket.socket() as taken:  # MASTER_PORT already in use
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        with pytest.raises(RuntimeError, match="could not connect rank 0 of 2.*MASTER_PORT"):
            LLM(model=checkpoint, tensor_parallel_size=2, **ENGINE)
    assert tp_group().size == 1


def test_a_rank_that_dies_before_joining_fails_the_start_at_once(checkpoint, monkeypatch):
    """Rank 0 watches the ranks it started while it waits for them to connect: one that exits
    first fails the start with its exit status (not after the connection timeout, 120 s)."""
    started = []

    def spawn_dying(config, ranks, address):
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=os._exit, args=(3,), daemon=True) for _ in ranks]
        for p in procs:
            p.start()
        started.extend(procs)
        return procs

    monkeypatch.setattr(multiproc, "spawn_ranks", spawn_dying)
    with pytest.raises(RankExited, match=r"rank 1 exited \(code 3\) before joining the group"):
        LLM(model=checkpoint, tensor_parallel_size=2, **ENGINE)
    assert started and not any(p.is_alive() for p in started)
    assert tp_group().size == 1


SCRIPT = """
from pagedllm import LLM, SamplingParams
llm = LLM(model={checkpoint!r}, tensor_parallel_size=2, dtype="float32", kv_cache_memory="8MiB")
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
out = llm.generate([{{"prompt_token_ids": [5, 9, 3]}}], params, use_tqdm=False)
print("tokens", list(out[0].outputs[0].token_ids))
llm.shutdown()
"""


def test_a_script_read_from_standard_input_starts_its_ranks(checkpoint):
    """`python - <<EOF`: the spawned rank has no main script to run again (multiprocessing's
    spawn re-runs it from its file), and needs none."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    single = LLM(model=checkpoint, **ENGINE)
    want = list(single.generate([{"prompt_token_ids": [5, 9, 3]}], params, use_tqdm=False)[0]
                .outputs[0].token_ids)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    script = SCRIPT.format(checkpoint=checkpoint)
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"tokens {want}" in done.stdout
