"""--reasoning-parser: `<think> ... </think>` into reasoning_content. The parsers alone (every
split of a text into deltas gives the whole text's split, tags cut anywhere), then through the
real server and the openai client, on a tiny model whose output a grammar makes open with a
think block."""

from __future__ import annotations

import re

import openai
import pytest

from benchmarks.soak_targets import serve_in_thread
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.reasoning import ReasoningStream, split_reasoning
from tests.conftest import save_tiny_llama

CASES = {
    ("deepseek_r1", "<think>abc de</think>The answer"): ("abc de", "The answer"),
    ("deepseek_r1", "abc de</think>The answer"): ("abc de", "The answer"),  # <think> in prompt
    ("deepseek_r1", "still thinking <thi"): ("still thinking <thi", None),  # cut off
    ("qwen3", "<think>abc</think>\n\nok"): ("abc", "\n\nok"),
    ("qwen3", "no thinking here"): (None, "no thinking here"),
    ("qwen3", "<thi"): (None, "<thi"),
    ("qwen3", "  <think>x</think>y"): ("x", "y"),
}


@pytest.mark.parametrize("parser, text", list(CASES))
def test_whole_and_streamed_agree(parser, text):
    assert split_reasoning(parser, text) == CASES[parser, text]
    for size in range(1, len(text) + 1):
        stream = ReasoningStream(parser)
        starts = range(0, len(text), size)
        parts = [stream.feed(text[i : i + size], last=i + size >= len(text)) for i in starts]
        joined = ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None)
        assert joined == CASES[parser, text], size


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-49k-reasoning")
    save_tiny_llama(path, vocab_size=49152, max_position_embeddings=512)
    args = EngineArgs(model=str(path), tokenizer="SmolLM2-135M-Instruct", dtype="float32",
                      max_model_len=256, kv_cache_memory="16MiB")  # fmt: skip
    engine = AsyncLLMEngine(LLMEngine(args))
    try:
        with serve_in_thread(engine, "m", reasoning_parser="deepseek_r1") as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    finally:
        engine.shutdown()


def test_chat_splits_reasoning_whole_and_streamed(client):
    kwargs = dict(
        model="m", messages=[{"role": "user", "content": "Think, then answer."}], max_tokens=40,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "<think>[a-z]{3,8}</think>[A-Z]{2,5}"}},
    )  # fmt: skip
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert re.fullmatch("[a-z]{3,8}", reasoning) and re.fullmatch("[A-Z]{2,5}", message.content)
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        streamed["content"] += delta.content or ""
        streamed["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
    assert streamed == {"reasoning_content": reasoning, "content": message.content}
