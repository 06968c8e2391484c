"""Structured-output constraints compile off the engine loop (AsyncLLMEngine), within a time
limit: the compile runs on a grammar thread; a slow one stalls no other request; one past the
limit is refused as bad input and leaves nothing behind. Tiny random Llama with the default
model's tokenizer (constraints need one)."""

import asyncio
import re
import threading
import time

import pytest

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import StructuredOutputsParams
from tests.conftest import save_tiny_llama

SLOW = "[a-z]{2,6}"  # the regex whose compile is made slow below
PLAIN = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-49k-grammar")
    save_tiny_llama(path, vocab_size=49152, max_position_embeddings=256)
    return str(path)


@pytest.fixture
def compiles(monkeypatch):
    """Each compile's thread name; the SLOW regex takes 2 s longer."""
    names = []
    original = InputProcessor.compile_grammar

    def compile_grammar(self, structured_outputs):
        names.append(threading.current_thread().name)
        if structured_outputs.regex == SLOW:
            time.sleep(2.0)
        return original(self, structured_outputs)

    monkeypatch.setattr(InputProcessor, "compile_grammar", compile_grammar)
    return names


def _engine(path, **kwargs) -> AsyncLLMEngine:
    args = EngineArgs(model=path, tokenizer="SmolLM2-135M-Instruct", dtype="float32",
                      max_model_len=128, kv_cache_memory="8MiB")  # fmt: skip
    return AsyncLLMEngine(LLMEngine(args), **kwargs)


def _regex(pattern: str) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8,
                          structured_outputs=StructuredOutputsParams(regex=pattern))  # fmt: skip


async def _final(engine, prompt, params, request_id):
    return [o async for o in engine.generate(prompt, params, request_id)][-1]


def test_a_slow_compile_stalls_no_other_request(tiny, compiles):
    engine = _engine(tiny)

    async def main():
        slow = asyncio.create_task(_final(engine, [5, 6, 7], _regex(SLOW), "slow"))
        await asyncio.sleep(0.1)  # its compile has started
        others = [await _final(engine, [9 + i, 3], PLAIN, f"plain-{i}") for i in range(3)]
        done_before = slow.done()
        return others, done_before, await slow

    try:
        others, done_before, slow = asyncio.run(main())
    finally:
        engine.shutdown()
    assert all(len(o.outputs[0].token_ids) == 4 for o in others)
    assert not done_before  # the three ran to the end while it compiled
    assert re.fullmatch(SLOW, slow.outputs[0].text)
    assert compiles and all(name.startswith("pagedllm-grammar") for name in compiles)


def test_past_the_time_limit_is_bad_input(tiny, compiles):
    engine = _engine(tiny, grammar_compile_timeout=0.5)

    async def main():
        with pytest.raises(ValueError, match="did not compile within 0.5 s"):
            await _final(engine, [5, 6, 7], _regex(SLOW), "slow")
        return await _final(engine, [5, 6, 7], _regex("[0-9]{3}"), "quick")

    try:
        quick = asyncio.run(main())
        assert re.fullmatch("[0-9]{3}", quick.outputs[0].text)
        stats = engine.engine.get_stats()
        assert not engine.engine.has_unfinished_requests() and stats["kv_cache_usage"] == 0
        assert engine.is_running
    finally:
        engine.shutdown()


def test_a_constraint_that_does_not_compile_is_still_bad_input(tiny):
    engine = _engine(tiny)

    async def main():
        with pytest.raises(ValueError, match="invalid grammar"):
            await _final(engine, [5], SamplingParams(
                structured_outputs=StructuredOutputsParams(grammar="start: nothing_defined")),
                "bad")  # fmt: skip

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
