"""Tool calling's request side without a model: tool_choice checks, the constraint a "required"
choice decodes under, the conversation a template sees, and streamed call deltas."""

import json

import jsonschema
import pytest

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_parsers import JsonToolParser
from pagedllm.entrypoints.openai.tools import ToolCallStream, plan_tools, template_messages
from pagedllm.model_loader.chat_template import render_chat_template

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A template that renders tools and calls itself, the way tool-aware HF templates do.
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} city={{ c.function.arguments.city }}]"
    "{% endfor %}\n{% endfor %}"
)


def tool(name, properties=None):
    parameters = {"type": "object", "properties": properties or {"city": {"type": "string"}}}
    parameters["required"] = list(parameters["properties"])
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [tool("get_weather"), tool("get_time", {"zone": {"type": "string"}})]


def request(**kwargs):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kwargs)


def plan(auto=True, parser="hermes", **kwargs):
    return plan_tools(request(**kwargs), auto, parser)


def test_tool_choice_defaults_and_checks():
    assert plan().mode == "none"
    assert plan(tools=TOOLS).mode == "auto"
    with pytest.raises(OpenAIError, match="--enable-auto-tool-choice"):
        plan(auto=False, tools=TOOLS)  # auto is the default with tools: it needs the flags
    assert plan(auto=False, tools=TOOLS, tool_choice="required").mode == "required"
    named = plan(auto=False, tools=TOOLS, tool_choice={"function": {"name": "get_time"}})
    assert (named.mode, named.named) == ("named", "get_time")
    for kwargs, message in [
        (dict(tools=TOOLS, tool_choice={"function": {"name": "nope"}}), "not among the tools"),
        (dict(tool_choice="auto"), "only allowed when tools"),
        (dict(tools=[tool("bad name")]), "letters, digits"),
        (dict(tools=[tool("f"), tool("f")]), "used twice"),
        (dict(tools=[{"function": {"name": "f", "parameters": {"type": "x"}}}]), "JSON schema"),
    ]:
        with pytest.raises(OpenAIError, match=message) as e:
            plan(**kwargs)
        assert e.value.status == 400


@pytest.mark.parametrize("parallel", [True, False])
def test_required_choice_constrains_to_a_list_of_known_calls(parallel):
    schema = plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
    schema = schema.structured_outputs().json
    one = {"name": "get_weather", "arguments": {"city": "Paris"}}
    two = {"name": "get_time", "arguments": {"zone": "UTC"}}
    jsonschema.validate([one], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{**one, "name": "nope"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    if parallel:
        jsonschema.validate([one, two], schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([one, two], schema)


def test_auto_with_hermes_constrains_calls_only_once_opened():
    from pagedllm.model_loader import load_tokenizer, resolve_model
    from pagedllm.structured_output import StructuredOutputManager

    tokenizer = load_tokenizer(resolve_model(None))
    manager = StructuredOutputManager(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id])
    constraint = plan(tools=TOOLS).structured_outputs()
    assert plan(tools=TOOLS, parser="json").structured_outputs() is None  # json: free text

    def accepts(text):
        grammar = manager.grammar(constraint)
        for token_id in tokenizer.encode(text, add_special_tokens=False):
            grammar.accept_token(token_id)
        return grammar.error is None and grammar.matcher.is_accepting()

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts("Sunny, 22 degrees < 30 {not json} [x] 😀")  # any text until a call opens
    assert accepts(f"Let me check.\n{call}\nAnd {call.replace(chr(10), '')} done.")
    assert not accepts(call.replace("get_weather", "nope"))
    assert not accepts(call.replace('"city"', '"town"'))
    assert not accepts("<tool_call> not json")


def test_named_choice_constrains_to_the_function_arguments():
    p = plan(tools=TOOLS, tool_choice={"function": {"name": "get_time"}})
    assert p.structured_outputs().json == TOOLS[1]["function"]["parameters"]
    assert plan(tools=TOOLS, parser="json").structured_outputs() is None  # auto, json: free


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees"},
]


def test_a_template_without_tools_gets_them_in_the_system_message():
    p = plan(tools=TOOLS)
    messages, tools = template_messages(HISTORY, p, CHATML)
    assert tools is None
    text = render_chat_template(CHATML, messages)
    system = messages[0]["content"]
    assert messages[0]["role"] == "system" and "get_weather" in system and "get_time" in system
    assert json.dumps(TOOLS[1]["function"]["parameters"]) in system
    # The earlier call in the parser's own format, and the result as a tool response.
    assert p.parser.extract(messages[2]["content"]).calls[0].name == "get_weather"
    assert "<tool_response>\n22 degrees\n</tool_response>" in text
    # An existing system message is extended, not replaced.
    with_system = [{"role": "system", "content": "Be brief."}, *HISTORY]
    messages, _ = template_messages(with_system, p, CHATML)
    assert (
        messages[0]["content"].startswith("Be brief.") and "get_weather" in messages[0]["content"]
    )
    assert sum(m["role"] == "system" for m in messages) == 1
    # tool_choice "none": no tools described, the history still rendered.
    messages, _ = template_messages(HISTORY, plan(tools=TOOLS, tool_choice="none"), CHATML)
    assert messages[0]["role"] == "user"


def test_the_json_parser_formats_the_history_its_way():
    p = plan(tools=TOOLS, parser="json")
    assert isinstance(p.parser, JsonToolParser)
    messages, _ = template_messages(HISTORY, p, CHATML)
    call = json.loads(messages[2]["content"])
    assert call["name"] == "get_weather" and call["arguments"] == {"city": "Paris"}


def test_a_template_with_tools_renders_them_itself():
    messages, tools = template_messages(HISTORY, plan(tools=TOOLS), TOOLS_TEMPLATE)
    text = render_chat_template(TOOLS_TEMPLATE, messages, tools=tools)
    assert text.startswith("TOOLS: get_weather get_time")
    assert "[get_weather city=Paris]" in text  # arguments handed over as an object
    assert "tool: 22 degrees" in text


def test_bad_history_messages_get_400():
    no_id = [*HISTORY[:2], {"role": "tool", "content": "22"}]
    calls_on_user = [{"role": "user", "content": "x", "tool_calls": []}]
    nameless = [{"role": "assistant", "tool_calls": [{"function": {}}]}]
    for messages, message in [
        (no_id, "tool_call_id"),
        (calls_on_user, "assistant message"),
        (nameless, "a function with a name"),
    ]:
        with pytest.raises(OpenAIError, match=message):
            template_messages(messages, plan(tools=TOOLS), CHATML)


def test_named_call_streams_its_arguments():
    stream = ToolCallStream(plan(tools=TOOLS, tool_choice={"function": {"name": "get_time"}}))
    deltas = [stream.feed(piece)[1] for piece in ['{"zone"', ': "UTC"', "}"]]
    first = deltas[0][0]
    assert first.id.startswith("call_") and first.function.name == "get_time"
    assert all(d[0].id is None and d[0].function.name is None for d in deltas[1:])
    assert "".join(d[0].function.arguments for d in deltas) == '{"zone": "UTC"}'
    assert stream.finish() == (None, []) and stream.num_calls == 1


def test_required_calls_stream_as_each_one_completes():
    stream = ToolCallStream(plan(tools=TOOLS, tool_choice="required"))
    text = json.dumps(
        [
            {"name": "get_weather", "arguments": {"city": "Paris ]}"}},
            {"name": "get_time", "arguments": {"zone": "UTC"}},
        ]
    )
    sent = []
    for i in range(len(text)):
        content, calls = stream.feed(text[i])
        assert content is None
        sent += calls
        if i < text.index("get_time"):
            assert len(sent) <= 1
    assert stream.finish() == (None, [])
    assert [d.index for d in sent] == [0, 1]
    assert [d.function.name for d in sent] == ["get_weather", "get_time"]
    assert json.loads(sent[0].function.arguments) == {"city": "Paris ]}"}


def test_a_function_without_parameters_takes_an_empty_object():
    tools = [{"type": "function", "function": {"name": "now"}}]
    schema = plan(tools=tools, tool_choice={"function": {"name": "now"}}).structured_outputs().json
    jsonschema.validate({}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"x": 1}, schema)
