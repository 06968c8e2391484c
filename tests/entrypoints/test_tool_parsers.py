"""Tool call parsing without a model: hermes and json formats, tool_choice "required" arrays,
prompts and rendered calls, and streaming split at every position against the whole-text parse."""

import json

import pytest

from pagedllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    HermesToolParser,
    JsonToolParser,
    ParsedToolCall,
    ToolCallStreamer,
    get_tool_parser,
    parse_required_calls,
)

NAMES = ["get_weather", "search"]
PARIS = ParsedToolCall("get_weather", '{"city": "Paris"}')


def block(name, args, key="arguments"):
    return f"<tool_call>\n{json.dumps({'name': name, key: args})}\n</tool_call>"


# --- hermes ---------------------------------------------------------------------------------


def test_hermes_one_call():
    got = HermesToolParser(NAMES).extract(block("get_weather", {"city": "Paris"}))
    assert got == ExtractedToolCalls(None, [PARIS])


def test_hermes_two_calls_with_content_before_between_after():
    text = (
        "Let me look.\n"
        + block("get_weather", {"city": "Paris"})
        + "\nand then\n"
        + block("search", {"q": "x", "n": [1, 2]})
        + "\nDone."
    )
    got = HermesToolParser(NAMES).extract(text)
    assert got.calls == [PARIS, ParsedToolCall("search", '{"q": "x", "n": [1, 2]}')]
    assert got.content == "Let me look.\n\nand then\n\nDone."


def test_hermes_blocks_back_to_back_without_whitespace():
    text = (
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "search"}</tool_call>'
    )
    got = HermesToolParser().extract(text)
    assert got == ExtractedToolCalls(None, [ParsedToolCall("search", "{}")] * 2)


def test_hermes_arguments_as_json_string_are_normalised():
    text = block("get_weather", '{"city":  "Zürich"}')
    assert HermesToolParser(NAMES).extract(text).calls == [
        ParsedToolCall("get_weather", '{"city": "Zürich"}')
    ]


def test_hermes_parameters_alias_and_missing_arguments():
    parser = HermesToolParser(NAMES)
    text = block("get_weather", {"city": "Paris"}, key="parameters")
    assert parser.extract(text).calls == [PARIS]
    text = '<tool_call>{"name": "search"}</tool_call>'
    assert parser.extract(text).calls == [ParsedToolCall("search", "{}")]


@pytest.mark.parametrize(
    "bad",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>',
        '<tool_call>["get_weather"]</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "search", "arguments": "not json"}</tool_call>',
        '<tool_call>{"name": "search", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "search"} extra</tool_call>',
    ],
)
def test_hermes_invalid_block_stays_content(bad):
    text = f"Before {bad} middle {block('search', {'q': 'a'})} after"
    got = HermesToolParser(NAMES).extract(text)
    assert got.calls == [ParsedToolCall("search", '{"q": "a"}')]
    assert got.content == f"Before {bad} middle  after"


def test_hermes_unknown_tool_stays_content_but_any_name_without_names():
    text = block("delete_everything", {})
    got = HermesToolParser(NAMES).extract(text)
    assert got == ExtractedToolCalls(text, [])
    assert HermesToolParser().extract(text).calls == [ParsedToolCall("delete_everything", "{}")]


def test_hermes_unterminated_last_block():
    parser = HermesToolParser(NAMES)
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    assert parser.extract(text) == ExtractedToolCalls("Sure.", [PARIS])
    # Cut inside the JSON: not a call, the text stays.
    cut = text[:-5]
    assert parser.extract(cut) == ExtractedToolCalls(cut.strip(), [])
    # Unterminated and followed by another block: only a last block may be unterminated.
    first = '<tool_call>{"name": "search"}'
    got = parser.extract(first + block("search", {}))
    assert got == ExtractedToolCalls(first, [ParsedToolCall("search", "{}")])


def test_hermes_closing_tag_inside_a_json_string():
    text = block("search", {"q": "</tool_call> and <tool_call>"}) + " ok"
    got = HermesToolParser(NAMES).extract(text)
    assert got == ExtractedToolCalls(
        "ok", [ParsedToolCall("search", '{"q": "</tool_call> and <tool_call>"}')]
    )


@pytest.mark.parametrize(
    ("text", "end"),
    [
        ("", 0),
        ("Hello", 5),
        ("Hello <tool", 6),
        ("Hello <", 6),
        ("Hello <tool_call", 6),
        ("Hello <tool_call>", 6),
        ('Hello <tool_call>{"na', 6),
        ("a <b", 4),
        ("<tool_calls> x", 14),
        ("x <tool_call>{} </tool_call> y <tool", 2),
    ],
)
def test_hermes_content_end(text, end):
    assert HermesToolParser().content_end(text) == end


def test_hermes_complete_calls_need_the_closing_tag():
    parser = HermesToolParser(NAMES)
    one = block("get_weather", {"city": "Paris"})
    assert parser.complete_calls(one[:-1]) == []
    # Complete JSON without the closing tag may still gain text that makes the block invalid.
    assert parser.complete_calls(one + '<tool_call>{"name": "search"}') == [PARIS]
    assert parser.complete_calls(one) == [PARIS]
    assert parser.complete_calls(one + "\n" + block("search", {})[:-3]) == [PARIS]


# --- json -----------------------------------------------------------------------------------

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
SEARCH = {"name": "search", "parameters": {"q": "a"}}


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        (json.dumps(CALL), [PARIS]),
        ("  \n" + json.dumps(CALL) + "\n", [PARIS]),
        (json.dumps([CALL, SEARCH]), [PARIS, ParsedToolCall("search", '{"q": "a"}')]),
        (json.dumps({"tool_calls": [CALL]}), [PARIS]),
        ("```json\n" + json.dumps(CALL) + "\n```", [PARIS]),
        ("```\n" + json.dumps([CALL]) + "\n```", [PARIS]),
        (
            json.dumps({"name": "search", "arguments": '{"q":"a"}'}),
            [ParsedToolCall("search", '{"q": "a"}')],
        ),
    ],
)
def test_json_calls(text, calls):
    assert JsonToolParser(NAMES).extract(text) == ExtractedToolCalls(None, calls)


@pytest.mark.parametrize(
    "text",
    [
        "It is sunny in Paris.",
        '  It is sunny. {"name": "get_weather"}  ',
        "{not json",
        json.dumps({"name": "unknown", "arguments": {}}),
        json.dumps([CALL, {"name": "unknown", "arguments": {}}]),
        json.dumps([CALL, "x"]),
        json.dumps({"answer": 42}),
        json.dumps(CALL) + " trailing",
        "[]",
        "",
    ],
)
def test_json_not_calls_is_content(text):
    assert JsonToolParser(NAMES).extract(text) == ExtractedToolCalls(text.strip() or None, [])


@pytest.mark.parametrize(
    ("text", "end"),
    [("", 0), ("  \n", 0), ("{", 0), (' [{"na', 0), ("`", 0), ("Hi", 2), ("  Hi {", 6)],
)
def test_json_content_end(text, end):
    assert JsonToolParser().content_end(text) == end


def test_json_complete_calls_only_once_it_all_parses():
    parser = JsonToolParser(NAMES)
    text = json.dumps([CALL, SEARCH])
    for i in range(len(text)):
        assert parser.complete_calls(text[:i]) == []
    assert parser.complete_calls(text) == [PARIS, ParsedToolCall("search", '{"q": "a"}')]
    assert parser.complete_calls("Hi }") == []


# --- tool_choice "required" -----------------------------------------------------------------


def test_required_complete_array():
    text = (
        ' [\n {"name": "get_weather", "arguments": {"city": "Paris"}},\n'
        ' {"name": "search", "arguments": {}}\n]'
    )
    assert parse_required_calls(text, NAMES) == [PARIS, ParsedToolCall("search", "{}")]


def test_required_partial_element_after_a_complete_one():
    text = '[{"name": "search", "arguments": {"q": "a]}", "o": {"p": ["}", "]"]}}}, {"name": "get_w'
    assert parse_required_calls(text, NAMES) == [
        ParsedToolCall("search", '{"q": "a]}", "o": {"p": ["}", "]"]}}')
    ]


def test_required_every_prefix_is_a_prefix_of_the_final_calls():
    args = {"q": 'x "quoted" ]}', "nested": {"a": [1, {"b": "}]"}]}}
    text = json.dumps([CALL, {"name": "search", "arguments": args}, CALL])
    final = parse_required_calls(text, NAMES)
    assert final == [PARIS, ParsedToolCall("search", json.dumps(args)), PARIS]
    seen = []
    for i in range(len(text) + 1):
        got = parse_required_calls(text[:i], NAMES)
        assert got == final[: len(got)]
        assert len(got) >= len(seen)
        seen = got
    # An element counts as soon as its object closes, before the next comma.
    first_end = text.index("}}") + 2
    assert parse_required_calls(text[:first_end], NAMES) == [PARIS]
    assert parse_required_calls(text[: first_end - 1], NAMES) == []


def test_required_not_an_array_and_unknown_names():
    assert parse_required_calls("", NAMES) == []
    assert parse_required_calls(json.dumps(CALL), NAMES) == []
    text = json.dumps([{"name": "nope", "arguments": {}}, CALL])
    assert parse_required_calls(text, NAMES) == [PARIS]
    assert len(parse_required_calls(text, None)) == 2


# --- prompts, rendered calls, registry ------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "Ville, e.g. Zürich"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
]


@pytest.mark.parametrize("cls", [HermesToolParser, JsonToolParser])
def test_system_prompt_describes_every_tool(cls):
    prompt = cls().system_prompt(TOOLS)
    for tool in TOOLS:
        function = tool["function"]
        assert function["name"] in prompt
        assert json.dumps(function["parameters"], ensure_ascii=False) in prompt
    assert "Current weather of a city." in prompt


@pytest.mark.parametrize("cls", [HermesToolParser, JsonToolParser])
@pytest.mark.parametrize("arguments", ['{"city": "Zürich", "n": [1, {"a": null}]}', "{}", ""])
def test_format_call_round_trips(cls, arguments):
    parser = cls(NAMES)
    text = parser.format_call("get_weather", arguments)
    expected = json.dumps(json.loads(arguments or "{}"), ensure_ascii=False)
    want = ExtractedToolCalls(None, [ParsedToolCall("get_weather", expected)])
    assert parser.extract(text) == want


@pytest.mark.parametrize("cls", [HermesToolParser, JsonToolParser])
def test_format_calls_round_trips(cls):
    calls = [PARIS, ParsedToolCall("search", '{"q": "a"}')]
    parser = cls(NAMES)
    assert parser.extract(parser.format_calls(calls)) == ExtractedToolCalls(None, calls)


def test_registry():
    assert get_tool_parser("hermes") is HermesToolParser
    assert get_tool_parser("json") is JsonToolParser
    assert {name: cls.name for name, cls in TOOL_PARSERS.items()} == {
        "hermes": "hermes",
        "json": "json",
    }
    with pytest.raises(ValueError, match="hermes.*json"):
        get_tool_parser("mistral")


# --- streaming ------------------------------------------------------------------------------

HERMES_TEXTS = [
    "Just an answer, no tools.",
    "a < b, and <tool is not a tag, nor <tool_calls>",
    "Ends with a tag prefix <tool_ca",
    "Let me check.\n" + block("get_weather", {"city": "Paris"}),
    "  Leading space " + block("search", {"q": "}]"}) + "\n" + block("get_weather", {}) + " bye\n",
    block("get_weather", {"city": "Paris"}) + "between" + block("search", {}) + "after",
    "Bad: <tool_call>{oops}</tool_call> then " + block("search", {"q": "a"}) + " end",
    "Unknown " + block("delete_everything", {}) + " and " + block("search", {}),
    'Tail <tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}\n',
    'Cut <tool_call>{"name": "search", "argum',
    block("search", {}) + '<tool_call>{"name": "search"} oops</tool_call> ' + block("search", {}),
    '<tool_call>{"name": "search"}' + block("search", {"q": 1}),
]
JSON_TEXTS = [
    "Plain answer.",
    "  Plain answer with {braces}.",
    json.dumps(CALL),
    "\n" + json.dumps([CALL, SEARCH]) + "\n",
    json.dumps({"tool_calls": [SEARCH]}),
    "```json\n" + json.dumps(CALL) + "\n```",
    '{"name": "get_weather", "arguments": {"city": "Par',
    json.dumps({"name": "unknown", "arguments": {}}),
    "`inline code` is not a call",
]


def stream(parser, pieces):
    streamer = ToolCallStreamer(parser)
    content, calls = "", []
    for piece in pieces:
        text, new = streamer.feed(piece)
        content += text
        calls += new
    fed_content = content
    text, new = streamer.finish()
    assert streamer.calls == calls + new
    return fed_content, content + text, calls + new


def splits(text):
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]


def check_stream(parser, text):
    expected = parser.extract(text)
    for pieces in splits(text):
        fed, content, calls = stream(parser, pieces)
        assert content.strip() == (expected.content or "")
        assert calls == expected.calls
        assert text.startswith(fed)
        if expected.calls:
            # Nothing of a call, nor of a tag that may open one, goes out before finish.
            first = text.find("<tool_call>")
            assert len(fed) <= (first if first >= 0 else 0)


@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_stream_hermes_matches_extract(text):
    check_stream(HermesToolParser(NAMES), text)


@pytest.mark.parametrize("text", JSON_TEXTS)
def test_stream_json_matches_extract(text):
    check_stream(JsonToolParser(NAMES), text)


def test_stream_holds_back_a_tag_prefix_and_sends_calls_as_they_close():
    streamer = ToolCallStreamer(HermesToolParser(NAMES))
    assert streamer.feed("Hello <tool") == ("Hello ", [])
    assert streamer.feed("_call>\n") == ("", [])
    assert streamer.feed(json.dumps(CALL) + "\n</tool_call") == ("", [])
    assert streamer.feed(">") == ("", [PARIS])
    assert streamer.feed(" Bye") == ("", [])
    assert streamer.finish() == (" Bye", [])
    assert streamer.calls == [PARIS]


def test_stream_releases_a_prefix_that_did_not_become_a_tag():
    streamer = ToolCallStreamer(HermesToolParser())
    assert streamer.feed("x <tool") == ("x ", [])
    assert streamer.feed("box") == ("<toolbox", [])
    assert streamer.finish() == ("", [])
