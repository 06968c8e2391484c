"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) through the real
server and the real `openai` SDK, on a tiny random model: at temperature 0 a response equals
the chat endpoint's answer to the same conversation (text and token counts), streamed or not;
the stream's events come in OpenAI's order, numbered; text.format, forced function calls and
their follow-ups, previous_response_id and the bounded store, reasoning items, logprobs,
errors in OpenAI's shape, disconnects; and the OpenAI Agents SDK running a tool through it."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from benchmarks.soak_targets import serve_in_thread, wait_idle
from pagedllm.config import EngineArgs
from pagedllm.engine import output_processor
from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.llm_engine import LLMEngine
from tests.conftest import save_tiny_llama

STORE = 3  # max_stored_responses of the main server: small, to see the oldest go
LIGHT = {
    "type": "function",
    "name": "set_light",
    "description": "Turn a room's light on or off.",
    "parameters": {
        "type": "object",
        "properties": {"room": {"enum": ["kitchen", "hall"]}, "on": {"type": "boolean"}},
        "required": ["room", "on"],
        "additionalProperties": False,
    },
    "strict": True,
}
COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
    "required": ["color", "bright"],
    "additionalProperties": False,
}


@dataclass
class Served:
    client: openai.OpenAI
    url: str
    thinking: openai.OpenAI  # the same engine behind --reasoning-parser deepseek_r1
    engine: LLMEngine


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-49k-responses")
    save_tiny_llama(path, vocab_size=49152, max_position_embeddings=2048)
    args = EngineArgs(model=str(path), tokenizer="SmolLM2-135M-Instruct", dtype="float32",
                      max_model_len=2048, kv_cache_memory="16MiB")  # fmt: skip
    engine = AsyncLLMEngine(LLMEngine(args))
    options = dict(enable_auto_tool_choice=True, tool_call_parser="hermes")
    try:
        with (
            serve_in_thread(engine, "m", max_stored_responses=STORE, **options) as url,
            serve_in_thread(engine, "m", reasoning_parser="deepseek_r1") as thinking_url,
        ):
            yield Served(
                openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0),
                url,
                openai.OpenAI(base_url=f"{thinking_url}/v1", api_key="x", max_retries=0),
                engine.engine,
            )
    finally:
        engine.shutdown()


def chat(client, messages, max_tokens, **kwargs):
    return client.chat.completions.create(
        model="m", messages=messages, max_tokens=max_tokens, temperature=0, **kwargs
    )


def check_same_as_chat(response, completion):
    """The response says what chat said for the same conversation, in the same tokens."""
    choice = completion.choices[0]
    assert response.output_text == (choice.message.content or "")
    assert response.usage.input_tokens == completion.usage.prompt_tokens
    assert response.usage.output_tokens == completion.usage.completion_tokens
    assert response.usage.total_tokens == completion.usage.total_tokens
    cut = choice.finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed")
    if cut:
        assert response.incomplete_details.reason == "max_output_tokens"


CONVERSATIONS = {
    "string": ({"input": "Hello there"}, [{"role": "user", "content": "Hello there"}]),
    "instructions": (
        {"instructions": "Be terse.", "input": "What is a page table?"},
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "What is a page table?"},
        ],
    ),
    "items": (
        {
            "input": [
                {"role": "developer", "content": "Answer in French."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Hi"},
                        {"type": "input_text", "text": "!"},
                    ],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Bonjour", "annotations": []}],
                },
                {"role": "user", "content": "And goodbye?"},
            ]
        },
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hi\n!"},
            {"role": "assistant", "content": "Bonjour"},
            {"role": "user", "content": "And goodbye?"},
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_response_equals_chat(served, name):
    request, messages = CONVERSATIONS[name]
    response = served.client.responses.create(
        model="m", max_output_tokens=12, temperature=0, **request
    )
    check_same_as_chat(response, chat(served.client, messages, 12))
    assert re.fullmatch("resp_[0-9a-f]{32}", response.id) and response.object == "response"
    assert response.model == "m" and response.max_output_tokens == 12
    assert response.instructions == request.get("instructions")
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []


def test_max_output_tokens_makes_it_incomplete(served):
    response = served.client.responses.create(
        model="m", input="Tell me a long story.", max_output_tokens=3, temperature=0
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"


def collect(events) -> tuple[list, dict]:
    """The stream's events, checked for numbering, and the text each item's deltas make."""
    events = list(events)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas: dict[str, str] = {}
    for e in events:
        if e.type.endswith(".delta"):
            deltas[e.item_id] = deltas.get(e.item_id, "") + e.delta
    return events, deltas


def item_events(events) -> list[str]:
    """The event types between response.in_progress and the final one, deltas collapsed."""
    types = [e.type for e in events[2:-1]]
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and types[i - 1] == t)]


def test_stream_equals_whole(served):
    kwargs = dict(model="m", input="Write a poem.", max_output_tokens=10, temperature=0)
    whole = served.client.responses.create(**kwargs)
    events, deltas = collect(served.client.responses.create(stream=True, **kwargs))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert item_events(events) == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.status == "incomplete"
    [item_id] = deltas
    assert deltas[item_id] == whole.output_text == final.response.output_text
    assert final.response.usage == whole.usage
    assert final.response.output[0].id == item_id


def test_json_schema_output_validates(served):
    text = {"format": {"type": "json_schema", "name": "color", "schema": COLOR, "strict": True}}
    kwargs = dict(model="m", input="A color?", text=text, max_output_tokens=300, temperature=0)
    response = served.client.responses.create(**kwargs)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), COLOR)
    assert response.text.format.type == "json_schema"
    # The SDK's stream helper (it needs response.completed) rebuilds the same response.
    with served.client.responses.stream(**kwargs) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == response.output_text
    assert final.usage == response.usage and final.status == "completed"


def test_forced_call_then_its_output_in_the_next_turn(served):
    ask = [{"role": "user", "content": "Light the kitchen."}]
    forced = {"type": "function", "name": "set_light"}
    kwargs = dict(model="m", input=ask, tools=[LIGHT], tool_choice=forced, temperature=0,
                  max_output_tokens=300)  # fmt: skip
    response = served.client.responses.create(**kwargs)
    assert response.status == "completed"
    [call] = response.output
    assert call.type == "function_call" and call.name == "set_light" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), LIGHT["parameters"])
    assert response.tool_choice.name == "set_light" and response.tools[0].name == "set_light"

    # Streamed: the arguments come as deltas inside the function_call item.
    events, deltas = collect(served.client.responses.create(stream=True, **kwargs))
    assert item_events(events) == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    streamed = events[-1].response.output[0]
    assert deltas[streamed.id] == streamed.arguments == call.arguments
    assert events[-1].response.usage == response.usage

    # The call and its output go back as items: the prompt holds them as chat's would.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "it is on"}
    follow = [*ask, call.model_dump(exclude_none=True), result]
    again = served.client.responses.create(
        model="m", input=follow, tools=[LIGHT], max_output_tokens=6, temperature=0
    )
    tool_call = {"id": call.call_id, "type": "function",
                 "function": {"name": "set_light", "arguments": call.arguments}}  # fmt: skip
    messages = [*ask, {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "it is on"}]  # fmt: skip
    chat_tools = [{"type": "function", "function": {k: v for k, v in LIGHT.items() if k != "type"}}]
    check_same_as_chat(again, chat(served.client, messages, 6, tools=chat_tools))
    shorter = served.client.responses.create(
        model="m", input=[*follow[:2], {**follow[2], "output": ""}], tools=[LIGHT],
        max_output_tokens=1,
    )  # fmt: skip
    assert again.usage.input_tokens > shorter.usage.input_tokens  # the output was in the prompt


def test_previous_response_id_continues_and_get_returns_it(served):
    client = served.client
    first = client.responses.create(
        model="m", instructions="Be brief.", input="Name a color.", max_output_tokens=6,
        temperature=0,
    )  # fmt: skip
    second = client.responses.create(
        model="m", previous_response_id=first.id, input="Another one.", max_output_tokens=6,
        temperature=0,
    )  # fmt: skip
    assert second.previous_response_id == first.id
    # The earlier turn (its input and output, not its instructions) starts the new prompt.
    messages = [{"role": "user", "content": "Name a color."},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "Another one."}]  # fmt: skip
    check_same_as_chat(second, chat(client, messages, 6))
    assert second.usage.input_tokens > first.usage.output_tokens + 10

    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    # A streamed response is stored too, and continues in turn.
    events = client.responses.create(model="m", previous_response_id=second.id, input="More.",
                                     max_output_tokens=4, temperature=0, stream=True)  # fmt: skip
    third = list(events)[-1].response
    assert client.responses.retrieve(third.id).output_text == third.output_text
    messages += [{"role": "assistant", "content": second.output_text},
                 {"role": "user", "content": "More."}]  # fmt: skip
    check_same_as_chat(third, chat(client, messages, 4))

    unstored = client.responses.create(model="m", input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(unstored.id)
    assert e.value.body["message"] == f"Response with id '{unstored.id}' not found."
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", previous_response_id=unstored.id, input="Hi")
    assert e.value.body["param"] == "previous_response_id"


def test_store_keeps_the_most_recently_used(served):
    client = served.client
    ids = [client.responses.create(model="m", input="Hi", max_output_tokens=1).id
           for _ in range(STORE)]  # fmt: skip
    client.responses.retrieve(ids[0])  # used: now the newest
    client.responses.create(model="m", input="Hi", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])  # the least recently used went
    for kept in (ids[0], ids[2]):
        assert client.responses.retrieve(kept).id == kept


def test_reasoning_items(served):
    regex = "<think>[a-z]{3,8}</think>[A-Z]{2,5}"  # vLLM's structured_outputs, passed to chat
    kwargs = dict(model="m", input="Think, then answer.", max_output_tokens=40, temperature=0,
                  extra_body={"structured_outputs": {"regex": regex}})  # fmt: skip
    response = served.thinking.responses.create(**kwargs)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and message.type == "message"
    completion = served.thinking.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Think, then answer."}], max_tokens=40,
        temperature=0, extra_body=kwargs["extra_body"],
    )  # fmt: skip
    assert (
        reasoning.content[0].text == completion.choices[0].message.model_extra["reasoning_content"]
    )
    check_same_as_chat(response, completion)
    assert re.fullmatch("[a-z]{3,8}", reasoning.content[0].text)
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens

    events, deltas = collect(served.thinking.responses.create(stream=True, **kwargs))
    assert item_events(events) == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    final = events[-1].response
    assert [deltas[item.id] for item in final.output] == [reasoning.content[0].text,
                                                          message.content[0].text]  # fmt: skip
    assert final.usage == response.usage


def test_logprobs(served):
    kwargs = dict(model="m", input="Hello", max_output_tokens=5, temperature=0, top_logprobs=2,
                  include=["message.output_text.logprobs"])  # fmt: skip
    response = served.client.responses.create(**kwargs)
    logprobs = response.output[0].content[0].logprobs
    completion = chat(served.client, [{"role": "user", "content": "Hello"}], 5, logprobs=True,
                      top_logprobs=2)  # fmt: skip
    expected = completion.choices[0].logprobs.content
    assert [(lp.token, lp.logprob) for lp in logprobs] == [
        (lp.token, lp.logprob) for lp in expected
    ]
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)
    events = list(served.client.responses.create(stream=True, **kwargs))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.logprob for lp in streamed] == [lp.logprob for lp in logprobs]


BAD = {
    "tools": {"tools": [{"type": "web_search"}]},
    "tool_choice": {"tools": [LIGHT], "tool_choice": {"type": "function", "name": "nope"}},
    "background": {"background": True},
    "include": {"include": ["file_search_call.results"]},
    "truncation": {"truncation": "auto"},
    "input": {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
    "text.format": {"text": {"format": {"type": "yaml"}}},
    "conversation": {"conversation": "conv_1"},
}


@pytest.mark.parametrize("param", sorted(BAD))
def test_unsupported_or_bad_fields_are_400s_naming_them(served, param):
    request = {"model": "m", "input": "Hi", **BAD[param]}
    answer = httpx.post(f"{served.url}/v1/responses", json=request)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError", error


def test_unknown_model_and_response_are_404s(served):
    with pytest.raises(openai.NotFoundError) as e:
        served.client.responses.create(model="other", input="Hi")
    assert e.value.body["param"] == "model"
    answer = httpx.get(f"{served.url}/v1/responses/resp_unknown")
    assert answer.status_code == 404 and answer.json()["error"]["type"] == "NotFoundError"


def test_disconnect_aborts_and_frees_blocks(served):
    request = {"model": "m", "input": "Go on forever.", "max_output_tokens": 1900, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/responses", json=request, timeout=30) as answer:
        lines = answer.iter_lines()
        created = next(line for line in lines if line.startswith("data: "))
        for i, _ in enumerate(lines):
            if i >= 12:
                break
    response_id = json.loads(created.removeprefix("data: "))["response"]["id"]
    assert wait_idle(served.engine, timeout=30)
    assert served.engine.get_stats()["kv_cache_usage"] == 0
    with pytest.raises(openai.NotFoundError):  # an aborted response is not stored
        served.client.responses.retrieve(response_id)


def test_a_fault_mid_stream_is_an_error_event_then_failed(served, monkeypatch):
    """Processing the output fails on the third token: the stream has started, so an `error`
    event and response.failed end it; the request's blocks are freed."""

    class LateFault(IncrementalDetokenizer):
        def update(self, new_token_ids, stop_terminated=False):
            if self.num_tokens >= 3:
                raise ValueError("injected late fault")
            return super().update(new_token_ids, stop_terminated)

    monkeypatch.setattr(output_processor, "IncrementalDetokenizer", LateFault)
    events, _ = collect(
        served.client.responses.create(model="m", input="Hi", max_output_tokens=20, stream=True)
    )
    error, failed = events[-2:]
    assert error.type == "error" and "injected late fault" in error.message
    assert error.code == "500" and error.message.startswith("request resp-")
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.message == error.message
    assert wait_idle(served.engine, timeout=30)
    assert served.engine.get_stats()["kv_cache_usage"] == 0
    with pytest.raises(openai.NotFoundError):  # a failed response is not stored
        served.client.responses.retrieve(failed.response.id)


class Verdict(BaseModel):
    verdict: Literal["done", "failed"]


def test_openai_agents_sdk_runs_a_tool(served):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def set_light(room: Literal["kitchen", "hall"], on: bool) -> str:
        """Turn a room's light on or off."""
        calls.append({"room": room, "on": on})
        return f"the {room} light is {'on' if on else 'off'}"

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
        model = agents.OpenAIResponsesModel(model="m", openai_client=client)
        agent = agents.Agent(
            name="lights", instructions="You control the lights.", model=model,
            tools=[set_light], output_type=Verdict,
            model_settings=agents.ModelSettings(tool_choice="set_light", temperature=0,
                                                max_tokens=400),
        )  # fmt: skip
        return await agents.Runner.run(agent, "Light the kitchen.", max_turns=3)

    result = asyncio.run(run())
    assert len(calls) == 1  # the forced call ran; then tool_choice reset to "auto"
    jsonschema.validate(calls[0], LIGHT["parameters"])
    assert isinstance(result.final_output, Verdict)
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert outputs and outputs[0].output.startswith(f"the {calls[0]['room']} light")
