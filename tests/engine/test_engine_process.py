"""The engine in its own process (engine/core_client.py, engine/core_proc.py) on a tiny random
Llama: outputs equal the in-process engine's; a killed, crashed or hung engine process is
replaced and every open stream goes on where it was; a poison request is failed alone; past
the restart budget the engine is dead; a reader that stops reading is cut off."""

import asyncio
import os
import re
import signal
import threading
import time

import pytest

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.engine.faults import Faults
from pagedllm.engine.grammar_compile import GrammarCompiler
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.streams import StreamBacklogError
from pagedllm.lora_request import LoRARequest
from pagedllm.sampling_params import StructuredOutputsParams
from tests.conftest import save_tiny_llama

PROMPTS = [f"Request number {i} says" for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=48, ignore_eos=True, logprobs=2)


def tiny_args(tmp_path_factory, **kwargs) -> EngineArgs:
    """A tiny random Llama with the default model's tokenizer (text works), float32."""
    path = tmp_path_factory.mktemp("tiny-process")
    save_tiny_llama(path, vocab_size=49152, max_position_embeddings=512)
    return EngineArgs(model=str(path), tokenizer="SmolLM2-135M-Instruct", dtype="float32",
                      kv_cache_memory="16MiB", **kwargs)  # fmt: skip


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    return tiny_args(tmp_path_factory, block_size=4)


@pytest.fixture(scope="module")
def expected(args):
    """Each prompt's (text, tokens) from the in-process engine, greedy and seeded."""
    aengine = AsyncLLMEngine(LLMEngine(args))
    try:
        return {
            name: asyncio.run(run_all(aengine, params, "x"))
            for name, params in (("greedy", GREEDY), ("seeded", SEEDED))
        }
    finally:
        aengine.shutdown()


async def stream(engine, prompt, params, request_id, on_token=None):
    """The joined deltas: (text, token ids, logprobs' token ids)."""
    text, tokens, logprob_ids = "", [], []
    async for output in engine.generate(prompt, params, request_id, delta=True):
        (c,) = output.outputs
        text += c.text
        tokens += c.token_ids
        logprob_ids += [max(d, key=lambda t: d[t].logprob) for d in c.logprobs or []]
        if on_token is not None:
            on_token(len(tokens))
    return text, tokens, logprob_ids


async def run_all(engine, params, tag, on_token=None):
    return await asyncio.gather(
        *(stream(engine, p, params, f"{tag}-{i}", on_token) for i, p in enumerate(PROMPTS))
    )


def engine_processes() -> list[int]:
    """Live processes running the engine's target (this test's children's children too)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"multiprocessing.spawn" in cmdline and state != "Z" and int(pid) != os.getpid():
            pids.append(int(pid))
    return pids


def clean(client) -> dict:
    snapshot = asyncio.run(client.kv_snapshot(check=True))
    assert snapshot["integrity"]["ok"], snapshot["integrity"]
    assert snapshot["pool"]["counts"]["used"] == 0
    return snapshot


def test_outputs_equal_the_in_process_engine(args, expected):
    client = EngineCoreClient(args)
    try:
        assert asyncio.run(run_all(client, GREEDY, "g")) == expected["greedy"]
        assert asyncio.run(run_all(client, SEEDED, "s")) == expected["seeded"]

        async def whole():  # a caller asking for whole outputs gets them assembled
            outputs = [o async for o in client.generate(PROMPTS[0], GREEDY, "w")]
            return outputs[-1].outputs[0]

        final = asyncio.run(whole())
        assert (final.text, final.token_ids) == expected["greedy"][0][:2]
        clean(client)
        assert client.get_stats()["num_generation_tokens_total"] > 0
        # Calls cross typed: the arguments as core_channel.CALLS types them, checked on arrival
        # (a wrong one is the caller's error), and the values as plain data.
        assert client.call_blocking("leak_report")["idle"] is True
        report = client.call_blocking("memory_report", False, True)
        assert report["rss_bytes"] > 0 and isinstance(report["object_types"], dict)
        with pytest.raises(ValueError, match="^ValueError: LoRA adapters need"):
            client.call_blocking("check_lora", LoRARequest("a", 1, "/no/such/adapter"))
        with pytest.raises(ValueError, match="kv_snapshot: Expected `bool`, got `str`"):
            client.call_blocking("kv_snapshot", "yes")
        with pytest.raises(ValueError, match="the engine has no call 'unpickle'"):
            client.call_blocking("unpickle", b"...")
        clean(client)
    finally:
        client.shutdown()
    assert engine_processes() == []


@pytest.mark.parametrize("name", ["greedy", "seeded"])
def test_a_killed_engine_process_is_replaced_and_streams_go_on(args, expected, name):
    """SIGKILL at two points while six streams run: each stream's text, tokens and logprobs
    equal an undisturbed run's; /health's flag is up while restarting; no block is held after
    and one engine process is left."""
    client = EngineCoreClient(args)
    kills, seen_restarting = [12, 30], []
    params = GREEDY if name == "greedy" else SEEDED

    def on_token(n):
        if kills and n >= kills[0]:
            kills.pop(0)
            os.kill(client.pid, signal.SIGKILL)
            seen_restarting.append(client.is_restarting)  # not seen yet: the thread notices

    try:
        outputs = asyncio.run(run_all(client, params, "k", on_token))
        assert outputs == expected[name]
        assert client.num_restarts == 2 and client.is_running and not client.is_restarting
        assert client.get_stats()["num_engine_restarts_total"] == 2
        clean(client)
        assert len(engine_processes()) == 1
    finally:
        client.shutdown()


def test_a_hung_step_is_detected_and_the_engine_replaced(args, expected):
    client = EngineCoreClient(args, step_timeout=1.5, faults=Faults(hang_at_step=20))
    try:
        started = time.monotonic()
        assert asyncio.run(run_all(client, GREEDY, "h")) == expected["greedy"]
        assert client.num_restarts == 1
        assert time.monotonic() - started < 60
        clean(client)
    finally:
        client.shutdown()


def test_a_poison_request_is_found_and_failed_alone(args, expected):
    """A request whose prompt makes the engine process abort, sent with six others: after two
    crashes all seven are on probation and run one at a time; the poison one crashes the
    engine alone, is failed with a clear error and not retried; the others finish as
    undisturbed."""
    client = EngineCoreClient(args, faults=Faults(crash_on_token=666))

    async def main():
        async def poison():
            with pytest.raises(RequestFailedError, match="not retried"):
                async for _ in client.generate({"prompt_token_ids": [5, 666, 7]}, GREEDY, "p"):
                    pass

        results = await asyncio.gather(run_all(client, GREEDY, "ok"), poison())
        return results[0]

    try:
        outputs = asyncio.run(main())
        assert client.num_restarts == 3
        for got, want in zip(outputs, expected["greedy"], strict=True):
            assert got == want
        clean(client)
    finally:
        client.shutdown()


def test_past_the_restart_budget_the_engine_is_dead(args):
    client = EngineCoreClient(args, max_restarts=1)
    try:

        async def main():
            kills = [5, 20]

            def on_token(n):
                if kills and n >= kills[0]:
                    kills.pop(0)
                    os.kill(client.pid, signal.SIGKILL)

            with pytest.raises(EngineDeadError, match="restarts"):
                await stream(client, PROMPTS[0], GREEDY, "d", on_token)

        asyncio.run(main())
        assert not client.is_running and client.num_restarts == 1
        with pytest.raises(EngineDeadError):
            client.check_health()
    finally:
        client.shutdown()
    assert engine_processes() == []


def test_requests_of_several_sequences_start_over_only_before_their_first_output(args):
    """n=2: a request with nothing handed out starts over on the new engine (its outputs as an
    undisturbed run's); one whose stream had begun fails with a clear error. One request runs
    at a time (max_num_seqs=2), so the second waits in the engine's queue when the first one's
    stream kills the engine."""
    import dataclasses

    client = EngineCoreClient(dataclasses.replace(args, max_num_seqs=2))
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    try:

        async def final(request_id, kill_at=None):
            last = None
            async for last in client.generate(PROMPTS[1], params, request_id):
                if kill_at is not None and len(last.outputs[0].token_ids) >= kill_at:
                    kill_at = None
                    os.kill(client.pid, signal.SIGKILL)
            return [(c.text, c.token_ids) for c in last.outputs]

        undisturbed = asyncio.run(final("n-0"))

        async def main():
            first = asyncio.create_task(final("n-1", kill_at=5))
            await asyncio.sleep(0)  # n-1 is sent first
            second = asyncio.create_task(final("n-2"))
            with pytest.raises(RequestFailedError, match="cannot resume"):
                await first
            return await second

        assert asyncio.run(main()) == undisturbed
        assert client.num_restarts == 1
        clean(client)
    finally:
        client.shutdown()


@pytest.mark.parametrize("in_process", [True, False])
def test_a_reader_that_stops_reading_has_its_request_aborted(args, in_process):
    """A caller that reads one output and stalls: past max_stream_backlog unread outputs its
    request is aborted (its blocks freed while it still stalls) and the stream ends with a
    StreamBacklogError; a request read meanwhile is untouched."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    if in_process:
        engine = AsyncLLMEngine(LLMEngine(args), max_stream_backlog=16)
    else:
        engine = EngineCoreClient(args, max_stream_backlog=16)

    async def main():
        stalled = engine.generate(PROMPTS[0], params, "slow", delta=True)
        first = await anext(stalled)
        assert len(first.outputs[0].token_ids) == 1
        reader = await stream(engine, PROMPTS[1], GREEDY, "fast")
        # The reader finished while "slow" was stalled; "slow" was aborted long before its
        # 400 tokens: the engine holds nothing now.
        await asyncio.sleep(0.5)
        stats = engine.engine.get_stats()
        assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0
        received = []
        with pytest.raises(StreamBacklogError, match="unread"):
            async for output in stalled:
                received += output.outputs[0].token_ids
        assert 16 <= len(received) < 400
        return reader

    try:
        assert len(asyncio.run(main())[1]) == GREEDY.max_tokens
    finally:
        engine.shutdown()


def test_a_killed_tensor_parallel_worker_is_replaced_with_its_engine(args, expected):
    """--tensor-parallel-size 2: killing rank 1 (a child of the engine process) fails that
    engine process, which is replaced with a new group; streams go on; no process is left
    behind. The failure is not blamed on the requests in flight, though rank 0 may see the
    peer's death in a collective before the worker can be reaped."""
    import dataclasses

    tp_args = dataclasses.replace(args, tensor_parallel_size=2)
    client = EngineCoreClient(tp_args)
    killed, blames = [], []
    sort_out = client._sort_out_requests  # records whether the failure was blamed on requests
    client._sort_out_requests = lambda reason, blame: (
        blames.append(blame),
        sort_out(reason, blame),
    )

    def on_token(n):
        if not killed and n >= 10:
            (worker,) = [p for p in engine_processes() if p != client.pid]
            os.kill(worker, signal.SIGKILL)
            killed.append(worker)

    try:
        assert asyncio.run(run_all(client, GREEDY, "tp", on_token)) == expected["greedy"]
        assert client.num_restarts == 1
        assert blames == [False]  # a killed worker is not the requests' fault
        clean(client)
        assert len(engine_processes()) == 2  # the new engine process and its rank 1
    finally:
        client.shutdown()
    assert engine_processes() == []


def test_structured_outputs_compile_in_the_engine_process(args):
    """A constraint compiles on the engine process's grammar threads (engine/grammar_compile.py)
    and holds; one that cannot compile is bad input."""

    def constrained(pattern: str) -> SamplingParams:
        constraint = StructuredOutputsParams(regex=pattern)
        return SamplingParams(temperature=0, max_tokens=8, structured_outputs=constraint)

    regex, bad = constrained("[0-9]{3}"), constrained("(unclosed")

    async def final(client, params, request_id):
        return [o async for o in client.generate(PROMPTS[0], params, request_id)][-1]

    client = EngineCoreClient(args)
    try:
        assert re.fullmatch("[0-9]{3}", asyncio.run(final(client, regex, "r")).outputs[0].text)
        with pytest.raises(ValueError):
            asyncio.run(final(client, bad, "bad"))
        clean(client)
    finally:
        client.shutdown()


def test_a_compile_past_its_time_limit_is_bad_input():
    """The engine process's side of engine/grammar_compile.py (the async engine's is in
    test_grammar_off_loop.py): still compiling in time, then refused once past it."""
    release = threading.Event()
    compiler = GrammarCompiler(lambda _: release.wait() and "grammar", timeout=600)
    try:
        compiling = compiler.submit(None)
        assert compiler.outcome(compiling) is None  # compiling, within its time
        compiling.deadline = time.monotonic()  # the limit has passed
        late = compiler.outcome(compiling)
        assert isinstance(late, ValueError) and "did not compile within 600 s" in str(late)
        release.set()
        done = compiler.submit(None)
        done.future.result()
        assert compiler.outcome(done) == "grammar"
    finally:
        release.set()
        compiler.shutdown()
