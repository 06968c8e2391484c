"""AsyncLLMEngine on a tiny random Llama: concurrent streams, abort on cancel, a dead loop."""

import asyncio

import pytest

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.engine.llm_engine import LLMEngine
from tests.conftest import save_tiny_llama
from tests.waiting import wait_until

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 3, 17, 4], list(range(40, 60)), [100, 7, 33]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-async")
    save_tiny_llama(path)
    return str(path)


def make_engine(path, **kwargs):
    return LLMEngine(EngineArgs(model=path, block_size=4, kv_cache_memory="4MiB", **kwargs))


def offline(path):
    engine = make_engine(path)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))]


async def collect(aengine, prompt, request_id, params=GREEDY, delta=False):
    outputs = [o async for o in aengine.generate(prompt, params, request_id, delta=delta)]
    return outputs


def idle_and_clean(engine):
    kv = engine.scheduler.kv_cache_manager
    engine.scheduler.check_integrity()
    return not engine.has_unfinished_requests() and kv.num_free_blocks == engine.num_blocks


def test_concurrent_streams_equal_offline_and_deltas_add_up(tiny):
    want = offline(tiny)
    aengine = AsyncLLMEngine(make_engine(tiny))
    try:

        async def main():
            full = await asyncio.gather(
                *(collect(aengine, p, f"r{i}") for i, p in enumerate(PROMPTS))
            )
            deltas = await collect(aengine, PROMPTS[1], "d", delta=True)
            return full, deltas

        full, deltas = asyncio.run(main())
        assert [outs[-1].outputs[0].token_ids for outs in full] == want
        assert all(outs[-1].finished and not any(o.finished for o in outs[:-1]) for outs in full)
        assert [t for o in deltas for t in o.outputs[0].token_ids] == want[1]
        assert idle_and_clean(aengine.engine)
    finally:
        aengine.shutdown()


def test_leaving_a_stream_aborts_the_request_and_frees_its_blocks(tiny):
    aengine = AsyncLLMEngine(make_engine(tiny))
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    try:

        async def main():
            got = 0
            async for _ in aengine.generate(PROMPTS[1], long, "gone"):
                got += 1
                if got == 3:
                    break  # the client disconnects
            # The abort is applied before the next step; wait for the loop to get there.
            for _ in range(200):
                if idle_and_clean(aengine.engine):
                    break
                await asyncio.sleep(0.01)
            other = await collect(aengine, PROMPTS[0], "next")
            return got, other

        got, other = asyncio.run(main())
        assert got == 3
        assert idle_and_clean(aengine.engine)
        assert other[-1].finished and len(other[-1].outputs[0].token_ids) == 12
    finally:
        aengine.shutdown()


def test_bad_input_raises_in_the_caller_and_the_engine_goes_on(tiny):
    aengine = AsyncLLMEngine(make_engine(tiny, max_model_len=32))
    try:

        async def main():
            with pytest.raises(ValueError, match="max_model_len"):
                await collect(aengine, list(range(3, 40)), "too-long")
            return await collect(aengine, PROMPTS[0], "fine")

        assert asyncio.run(main())[-1].finished
        assert idle_and_clean(aengine.engine)
    finally:
        aengine.shutdown()


def test_a_client_whose_event_loop_closed_does_not_stop_the_engine(tiny):
    """A stream whose event loop is gone (a client that vanished with its loop, as a test
    client's per-request loop does) cannot take outputs: its request is aborted and the engine
    goes on serving. Before, the RuntimeError from the closed loop stopped the engine loop."""
    import time

    from pagedllm.engine import core_channel as channel
    from pagedllm.engine.streams import RequestStream
    from pagedllm.request import EngineCoreRequest

    aengine = AsyncLLMEngine(make_engine(tiny, max_model_len=32))
    try:
        closed = asyncio.new_event_loop()
        closed.close()
        for request_id, prompt in (("bad", list(range(3, 40))), ("good", PROMPTS[0])):
            aengine._streams[request_id] = RequestStream(request_id, aengine.abort, loop=closed)
            core = EngineCoreRequest.of(
                aengine.engine.tokenizer, request_id, prompt, GREEDY, time.time()
            )
            aengine._deltas[request_id] = False
            aengine._inbox.put(channel.Add(core))
        outputs = asyncio.run(collect(aengine, PROMPTS[1], "after"))
        assert outputs[-1].finished and aengine.dead_error is None
        # "good" was aborted, its blocks freed
        wait_until(lambda: idle_and_clean(aengine.engine), "an idle engine, every block free")
        assert "good" not in aengine._streams
    finally:
        aengine.shutdown()


def test_a_dead_loop_fails_open_streams_and_later_calls(tiny):
    engine = make_engine(tiny)
    aengine = AsyncLLMEngine(engine)

    def broken_step():
        raise RuntimeError("injected")

    engine.step_core = broken_step

    async def main():
        with pytest.raises(EngineDeadError, match="injected"):
            await collect(aengine, PROMPTS[0], "a")
        with pytest.raises(EngineDeadError):
            await collect(aengine, PROMPTS[0], "b")

    asyncio.run(main())
    assert not aengine.is_running
    with pytest.raises(EngineDeadError):
        aengine.check_health()


def test_shutdown_aborts_what_is_in_flight(tiny):
    aengine = AsyncLLMEngine(make_engine(tiny))
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        async def client():
            async for o in aengine.generate(PROMPTS[1], long, "x"):
                if len(o.outputs[0].token_ids) == 2:
                    aengine.shutdown(timeout=None)

        with pytest.raises(EngineDeadError, match="shutting down"):
            await client()

    asyncio.run(main())
    assert not aengine._thread.is_alive()
    assert idle_and_clean(aengine.engine)


def test_a_request_made_by_the_caller_is_taken_whole_and_a_bad_prompt_leaks_no_stream(tiny):
    """The serving layer makes the EngineCoreRequest (request.py) and generate takes
    it as it is; a prompt that cannot be made into one is a ValueError before any stream is
    opened, so its id stays free."""
    import time

    from pagedllm.request import EngineCoreRequest

    aengine = AsyncLLMEngine(make_engine(tiny))
    try:
        want = asyncio.run(collect(aengine, PROMPTS[0], "plain"))[-1].outputs[0].token_ids
        made = EngineCoreRequest.of(None, "made", PROMPTS[0], GREEDY, time.time())
        output = asyncio.run(collect(aengine, made, "made"))[-1]
        assert output.outputs[0].token_ids == want and output.prompt_token_ids == PROMPTS[0]
        with pytest.raises(ValueError, match="its own id"):
            asyncio.run(collect(aengine, made, "another id"))
        with pytest.raises(ValueError, match="a prompt is a string"):
            asyncio.run(collect(aengine, {"text": "no such key"}, "bad"))
        assert "bad" not in aengine._streams
        assert asyncio.run(collect(aengine, PROMPTS[0], "bad"))[-1].finished
    finally:
        aengine.shutdown()


def test_the_loop_answers_every_typed_call_and_only_those(tiny):
    """EngineCore.calls and core_channel.CALLS (the calls' argument types) name the same
    calls; a call's arguments are converted to those types in the server's process too."""
    from pagedllm.engine import core_channel as channel

    aengine = AsyncLLMEngine(make_engine(tiny))
    try:
        assert set(aengine.core.calls) == set(channel.CALLS)
        assert aengine.call_blocking("kv_snapshot", True)["integrity"]["ok"]
        assert aengine.call_blocking("reset_prefix_cache") is True
        with pytest.raises(ValueError, match="memory_report: Expected `bool`, got `int`"):
            aengine.call_blocking("memory_report", 1, 0)
    finally:
        aengine.shutdown()
