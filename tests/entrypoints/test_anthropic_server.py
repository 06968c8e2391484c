"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the real server
and the real `anthropic` SDK, on a tiny random model: answers equal chat's for the same
conversation, stop sequences and max_tokens, streams equal the whole answers, forced tool calls
validate against their schemas (streamed too), tool results reach the prompt, token counts equal
the usage, errors come in Anthropic's shape with the SDK's exception classes."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from benchmarks.soak_targets import serve_in_thread
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.protocol import ChatCompletionChunk
from pagedllm.entrypoints.openai.server_config import ServerConfig, ServerLimits
from pagedllm.entrypoints.openai.serving_messages import AnthropicServingMessages, message_events
from tests.conftest import save_tiny_llama
from tests.waiting import wait_until

KEY = "sk-test-key"
BODY_LIMIT = 32 << 10
ASK = [{"role": "user", "content": "What is a block table?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                       "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}  # fmt: skip
FORCED = {"type": "tool", "name": "get_weather"}
# The SDK has no sampling arguments (the API still takes them): greedy, to compare answers.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-49k-messages")
    save_tiny_llama(path, vocab_size=49152, max_position_embeddings=512)
    args = EngineArgs(model=str(path), tokenizer="SmolLM2-135M-Instruct", dtype="float32",
                      max_model_len=512, kv_cache_memory="16MiB")  # fmt: skip
    engine = AsyncLLMEngine(LLMEngine(args))
    limits = ServerLimits(max_request_body_bytes=BODY_LIMIT)
    try:
        with serve_in_thread(engine, "m", api_key=KEY, limits=limits) as url:
            yield url, engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served[0], api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=KEY, max_retries=0)


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def _blocks(message) -> list[tuple]:
    """The content blocks, without the streamed message's extras or the calls' fresh ids."""
    return [(b.type, getattr(b, "text", None), getattr(b, "input", None)) for b in message.content]


def _streamed(client, **kwargs):
    """(event types, joined text, joined input_json_delta per block, final message)."""
    types, text, partial = [], "", {}
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text += event.delta.text
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial[event.index] = partial.get(event.index, "") + event.delta.partial_json
        final = stream.get_final_message()
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types.count("content_block_start") == types.count("content_block_stop")
    return types, text, partial, final


def test_message_equals_chat_and_streams_alike(client, oai):
    for system in ("You are terse.", [{"type": "text", "text": "You are terse."}]):
        message = client.messages.create(model="m", system=system, messages=ASK, max_tokens=24,
                                          extra_body=GREEDY)  # fmt: skip
        reference = oai.chat.completions.create(
            model="m", messages=[{"role": "system", "content": "You are terse."}, *ASK],
            max_tokens=24, temperature=0,
        )  # fmt: skip
        assert message.id.startswith("msg_") and message.model == "m"
        assert message.type == "message" and message.role == "assistant"
        assert _text(message) == reference.choices[0].message.content
        assert message.usage.input_tokens == reference.usage.prompt_tokens
        assert message.usage.output_tokens == reference.usage.completion_tokens
        expected = {"length": "max_tokens", "stop": "end_turn"}[reference.choices[0].finish_reason]
        assert message.stop_reason == expected and message.stop_sequence is None
    # A longer system prompt, a longer prompt.
    longer = client.messages.create(model="m", system=f"{system[0]['text']} Answer in one word.",
                                    messages=ASK, max_tokens=1, extra_body=GREEDY)  # fmt: skip
    assert longer.usage.input_tokens > message.usage.input_tokens
    _, text, _, final = _streamed(client, model="m", system=system, messages=ASK, max_tokens=24,
                                  extra_body=GREEDY)  # fmt: skip
    assert text == _text(message)
    assert _blocks(final) == _blocks(message) and final.stop_reason == message.stop_reason
    assert final.usage.input_tokens == message.usage.input_tokens
    assert final.usage.output_tokens == message.usage.output_tokens


def test_stop_sequence_and_max_tokens(client):
    whole = client.messages.create(model="m", messages=ASK, max_tokens=40, extra_body=GREEDY)
    text = _text(whole)
    assert whole.usage.output_tokens > 3 and len(text.strip()) > 8, text
    start = len(text) // 2
    stop = text[start : start + 3]
    kwargs = dict(model="m", messages=ASK, max_tokens=40, extra_body=GREEDY, stop_sequences=[stop])
    stopped = client.messages.create(**kwargs)
    assert _text(stopped) == text[: text.index(stop)]
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    _, streamed_text, _, final = _streamed(client, **kwargs)
    assert streamed_text == _text(stopped)
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    cut = client.messages.create(model="m", messages=ASK, max_tokens=3, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    assert text.startswith(_text(cut))


def test_forced_tool_whole_and_streamed(client):
    kwargs = dict(model="m", messages=ASK, max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
                  tool_choice=FORCED)  # fmt: skip
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use", message
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert (
        message.usage.input_tokens
        == client.messages.count_tokens(
            model="m", messages=ASK, tools=[WEATHER], tool_choice=FORCED
        ).input_tokens
    )
    types, _, partial, final = _streamed(client, **kwargs)
    (index,) = partial
    assert json.loads(partial[index]) == call.input
    assert final.content[index].type == "tool_use" and final.content[index].input == call.input
    assert final.stop_reason == "tool_use"
    # Structured outputs the Messages way: output_config.format.
    answer = client.messages.create(
        model="m", messages=ASK, max_tokens=60, extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": WEATHER["input_schema"]}},
    )  # fmt: skip
    assert answer.stop_reason == "end_turn", answer
    jsonschema.validate(json.loads(_text(answer)), WEATHER["input_schema"])


def test_tool_results_reach_the_prompt(client, served):
    url = served[0]
    call_input = {"city": "Oslo", "unit": "celsius"}
    result = "Light snow, minus 4 degrees."

    def conversation(content, thinking=()):
        return [
            *ASK,
            {"role": "assistant", "content": [
                *thinking,
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": call_input},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": content},
                {"type": "text", "text": "And in short?"},
            ]},
        ]  # fmt: skip

    kwargs = dict(model="m", system="Be brief.", tools=[WEATHER])
    with_result = client.messages.count_tokens(messages=conversation(result), **kwargs)
    as_blocks = client.messages.count_tokens(
        messages=conversation([{"type": "text", "text": result}]), **kwargs
    )
    empty = client.messages.count_tokens(messages=conversation(""), **kwargs)
    assert with_result.input_tokens == as_blocks.input_tokens > empty.input_tokens
    # A thinking block given back (as clients do with the server's own) is dropped.
    thought = [{"type": "thinking", "thinking": "Weather: ask the tool.", "signature": ""}]
    with_thinking = client.messages.count_tokens(messages=conversation(result, thought), **kwargs)
    assert with_thinking.input_tokens == with_result.input_tokens
    # The same conversation in chat's terms renders to the same tokens, the result among them.
    chat_messages = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(call_input)}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": result},
        {"role": "user", "content": "And in short?"},
    ]  # fmt: skip
    function = {"name": WEATHER["name"], "description": WEATHER["description"],
                "parameters": WEATHER["input_schema"]}  # fmt: skip
    tools = [{"type": "function", "function": function}]
    headers = {"Authorization": f"Bearer {KEY}"}
    rendered = {"messages": chat_messages, "tools": tools}
    tokens = httpx.post(f"{url}/tokenize", headers=headers, json=rendered).json()["tokens"]
    assert len(tokens) == with_result.input_tokens
    prompt = httpx.post(f"{url}/detokenize", headers=headers, json={"tokens": tokens}).json()
    assert result in prompt["prompt"] and "Oslo" in prompt["prompt"]
    # And it generates (tool_choice "none": the tools stay out of the prompt).
    reply = client.messages.create(messages=conversation(result), max_tokens=4,
                                   tool_choice={"type": "none"}, **kwargs)  # fmt: skip
    assert reply.usage.input_tokens < with_result.input_tokens
    assert (
        reply.usage.input_tokens
        == client.messages.count_tokens(
            messages=conversation(result), tool_choice={"type": "none"}, **kwargs
        ).input_tokens
    )


def _error(raised, kind: str, fragment: str) -> None:
    body = raised.value.body
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert fragment in body["error"]["message"], body


def test_errors_in_anthropics_shape(client, served):
    url = served[0]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", cast_to=object, body={"model": "m", "messages": ASK})
    _error(e, "invalid_request_error", "max_tokens")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=4,
                               messages=[{"role": "system", "content": "hi"}])  # fmt: skip
    _error(e, "invalid_request_error", "role")
    image = {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, image]}])  # fmt: skip
    _error(e, "invalid_request_error", "messages.0")
    assert "'image'" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:  # "auto" needs the server's flags
        client.messages.create(model="m", max_tokens=4, messages=ASK, tools=[WEATHER])
    _error(e, "invalid_request_error", '{"type": "any"}')
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="other", max_tokens=4, messages=ASK)
    _error(e, "not_found_error", "other")
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.count_tokens(model="other", messages=ASK)
    _error(e, "not_found_error", "other")
    with pytest.raises(anthropic.APIStatusError) as e:
        huge = [{"role": "user", "content": "x" * BODY_LIMIT}]
        client.messages.create(model="m", max_tokens=4, messages=huge)
    assert e.value.status_code == 413
    _error(e, "request_too_large", str(BODY_LIMIT))
    stranger = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        stranger.messages.create(model="m", max_tokens=4, messages=ASK)
    _error(e, "authentication_error", "API key")
    # Anthropic's clients send the key as x-api-key.
    body = {"model": "m", "max_tokens": 2, "messages": ASK}
    response = httpx.post(f"{url}/v1/messages", headers={"x-api-key": KEY}, json=body)
    assert response.status_code == 200 and response.json()["type"] == "message"
    wrong = httpx.post(f"{url}/v1/messages", headers={"x-api-key": "wrong"}, json=body)
    assert wrong.status_code == 401


def test_disconnect_mid_stream_frees_the_request(client, served):
    engine = served[1].engine
    with client.messages.stream(
        model="m", messages=ASK, max_tokens=200, extra_body=GREEDY
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                break
        assert engine.has_unfinished_requests()  # still generating

    # Leaving the block closed the connection: the request is aborted, its blocks freed.
    def idle() -> bool:
        return not (engine.has_unfinished_requests() or engine.get_stats()["kv_cache_usage"])

    wait_until(idle, engine.get_stats)


async def _chunks(deltas: list[dict], finish_reason: str, usage: dict):
    for i, delta in enumerate(deltas):
        last = i == len(deltas) - 1
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason if last else None}
        yield ChatCompletionChunk(id="msg-1", model="m", choices=[choice])
    yield ChatCompletionChunk(id="msg-1", model="m", choices=[], usage=usage)


def test_reasoning_streams_as_a_thinking_block():
    """--reasoning-parser's deltas (chat's chunks) as Anthropic's thinking block, then text."""
    deltas = [{"role": "assistant", "content": ""}, {"reasoning_content": "Hm, "},
              {"reasoning_content": "snow."}, {"content": "Cold."}]  # fmt: skip
    usage = {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}

    async def collect():
        return [e async for e in message_events(_chunks(deltas, "stop", usage), "msg-1", "m", 9)]

    events = asyncio.run(collect())
    kinds = [(e["type"], e.get("index")) for e in events]
    assert kinds == [("message_start", None), ("content_block_start", 0),
                     ("content_block_delta", 0), ("content_block_delta", 0),
                     ("content_block_stop", 0), ("content_block_start", 1),
                     ("content_block_delta", 1), ("content_block_stop", 1),
                     ("message_delta", None), ("message_stop", None)]  # fmt: skip
    assert events[1]["content_block"]["type"] == "thinking"
    assert "".join(e["delta"].get("thinking", "") for e in events[2:4]) == "Hm, snow."
    assert events[6]["delta"] == {"type": "text_delta", "text": "Cold."}
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2]["usage"] == {"output_tokens": 4}


def test_a_failure_mid_stream_is_an_error_event(served):
    """Once the status is sent, a failure ends the stream with Anthropic's `error` event."""
    messages = AnthropicServingMessages(served[1], ServerConfig("m"))

    async def failing():
        yield {"type": "message_start", "message": {}}
        raise RuntimeError("the detokenizer broke")

    async def collect():
        return [e async for e in messages.frame(failing(), "msg-7")]

    start, error = asyncio.run(collect())
    assert start.startswith("event: message_start\n")
    name, data = error.strip().split("\n")
    assert name == "event: error"
    body = json.loads(data.removeprefix("data: "))
    assert body["type"] == "error" and body["error"]["type"] == "api_error"
    assert (
        "msg-7" in body["error"]["message"] and "the detokenizer broke" in body["error"]["message"]
    )
