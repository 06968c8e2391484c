"""Tool calling as text: turn a model's output into OpenAI tool calls, describe tools in a prompt
for chat templates without tool support, and split a stream into safe content and finished calls.

Two formats: `hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks amid
ordinary text) and `json` (the whole reply is a call object, a list of them, or
`{"tool_calls": [...]}`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"```(?i:json)?[ \t]*\n?(.*?)\n?```", re.DOTALL)


@dataclass(frozen=True)
class ParsedToolCall:
    """A call read from the model's text; protocol.ToolCall is the API's form of it (with an id)."""

    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI sends it


@dataclass
class ExtractedToolCalls:
    content: str | None  # text outside the calls, stripped; None when empty
    calls: list[ParsedToolCall]


def _skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def _arguments_json(args: object) -> str | None:
    """The arguments as normalised JSON object text, or None when they are not an object."""
    if args is None or (isinstance(args, str) and not args.strip()):
        return "{}"
    if isinstance(args, str):  # some models send the object already encoded as a string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def _to_call(obj: object, tool_names: Collection[str] | None) -> ParsedToolCall | None:
    """A call from a decoded `{"name", "arguments"|"parameters"}` object, None if it is not one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    if tool_names is not None and name not in tool_names:
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    arguments = _arguments_json(args)
    return None if arguments is None else ParsedToolCall(name, arguments)


def _arguments_value(arguments: str) -> object:
    """The arguments text as a value to embed in a rendered call (kept as text if not JSON)."""
    if not arguments.strip():
        return {}
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _call_json(name: str, arguments: str) -> str:
    return json.dumps({"name": name, "arguments": _arguments_value(arguments)}, ensure_ascii=False)


def _describe_tools(tools: list[dict]) -> str:
    lines = []
    for tool in tools:
        function = tool.get("function", tool)
        lines.append(json.dumps(function, ensure_ascii=False))
    return "\n".join(lines)


class ToolParser:
    """One output format for tool calls; subclasses implement it."""

    name: str

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        # A call naming a function the request did not offer is not a call: it stays as text.
        self.tool_names = None if tool_names is None else frozenset(tool_names)

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls and the remaining content of a whole generated text."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How many leading chars of a partial text are certainly content, safe to send now."""
        raise NotImplementedError

    def complete_calls(self, text: str) -> list[ParsedToolCall]:
        """The calls already complete in a partial text: always a prefix of the final calls."""
        raise NotImplementedError

    def format_call(self, name: str, arguments: str) -> str:
        """An earlier assistant call as text in this format, for templates without tools."""
        raise NotImplementedError

    def format_calls(self, calls: Sequence[ParsedToolCall]) -> str:
        """Several earlier calls of one assistant message as text in this format."""
        return "\n".join(self.format_call(c.name, c.arguments) for c in calls)

    def system_prompt(self, tools: list[dict]) -> str:
        """Text describing the tools and how to call them in this format."""
        raise NotImplementedError

    def _call(self, obj: object) -> ParsedToolCall | None:
        return _to_call(obj, self.tool_names)


class HermesToolParser(ToolParser):
    """Calls are `<tool_call>{json}</tool_call>` blocks anywhere in the text."""

    name = "hermes"

    def _blocks(self, text: str, final: bool) -> list[tuple[int, int, ParsedToolCall]]:
        """(start, end, call) of each valid block. A block is the opening tag, one JSON value and
        the closing tag (whitespace around the JSON allowed); when `final`, the last block may end
        with the text instead, since models often stop right after the JSON. Anything else is
        text, and the search goes on after its opening tag."""
        blocks = []
        pos = 0
        while (start := text.find(_OPEN, pos)) != -1:
            pos = start + len(_OPEN)
            i = _skip_ws(text, pos)
            try:
                obj, i = _DECODER.raw_decode(text, i)
            except json.JSONDecodeError:
                continue
            i = _skip_ws(text, i)
            if text.startswith(_CLOSE, i):
                end = i + len(_CLOSE)
            elif final and i == len(text):
                end = i
            else:
                continue
            if (call := self._call(obj)) is not None:
                blocks.append((start, end, call))
                pos = end
        return blocks

    def extract(self, text: str) -> ExtractedToolCalls:
        blocks = self._blocks(text, final=True)
        pieces, pos = [], 0
        for start, end, _ in blocks:
            pieces.append(text[pos:start])
            pos = end
        pieces.append(text[pos:])
        content = "".join(pieces).strip()
        return ExtractedToolCalls(content or None, [call for _, _, call in blocks])

    def content_end(self, text: str) -> int:
        start = text.find(_OPEN)
        if start != -1:
            return start
        # Hold back a tail that may still grow into the opening tag ("<", "<tool", ...).
        for n in range(min(len(_OPEN) - 1, len(text)), 0, -1):
            if text.endswith(_OPEN[:n]):
                return len(text) - n
        return len(text)

    def complete_calls(self, text: str) -> list[ParsedToolCall]:
        if _CLOSE not in text:
            return []
        return [call for _, _, call in self._blocks(text, final=False)]

    def format_call(self, name: str, arguments: str) -> str:
        return f"{_OPEN}\n{_call_json(name, arguments)}\n{_CLOSE}"

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "You can call functions to help with the answer. These are the functions, one JSON "
            "description per line:\n"
            f"<tools>\n{_describe_tools(tools)}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and its arguments between "
            f"{_OPEN} and {_CLOSE} tags, like this:\n"
            f'{_OPEN}\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n'
            f"{_CLOSE}\n"
            "Write one block per call; you may make several calls. Use only the functions above, "
            "with arguments that match their parameters. When no function is needed, just answer."
        )


class JsonToolParser(ToolParser):
    """The whole reply is JSON: a call, a list of calls, or `{"tool_calls": [...]}`."""

    name = "json"

    def _parse(self, text: str) -> list[ParsedToolCall] | None:
        body = text.strip()
        if fence := _FENCE.fullmatch(body):
            body = fence.group(1)
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if isinstance(value, dict) and "name" not in value and "tool_calls" in value:
            value = value["tool_calls"]
        items = value if isinstance(value, list) else [value]
        calls = [self._call(item) for item in items]
        if not calls or any(call is None for call in calls):
            return None
        return calls

    def extract(self, text: str) -> ExtractedToolCalls:
        calls = self._parse(text)
        if calls is None:
            return ExtractedToolCalls(text.strip() or None, [])
        return ExtractedToolCalls(None, calls)

    def content_end(self, text: str) -> int:
        head = text.lstrip()
        # Until the first real char shows whether this is JSON, nothing is certainly content.
        if not head or head[0] in "{[`":
            return 0
        return len(text)

    def complete_calls(self, text: str) -> list[ParsedToolCall]:
        tail = text.rstrip()
        # JSON can only be complete once it ends in a closer: skip the parse on every token.
        if not tail or tail[-1] not in "}]`":
            return []
        return self._parse(text) or []

    def format_call(self, name: str, arguments: str) -> str:
        return _call_json(name, arguments)

    def format_calls(self, calls: Sequence[ParsedToolCall]) -> str:
        if len(calls) == 1:
            return self.format_call(calls[0].name, calls[0].arguments)
        # Several calls must stay one JSON value to parse as this format.
        return json.dumps(
            [{"name": c.name, "arguments": _arguments_value(c.arguments)} for c in calls],
            ensure_ascii=False,
        )

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "You can call functions to help with the answer. These are the functions, one JSON "
            f"description per line:\n{_describe_tools(tools)}\n\n"
            "To call a function, reply with JSON only and no other text: an object with its name "
            'and its arguments, like {"name": "function_name", "arguments": {"argument": '
            '"value"}}, or a JSON list of such objects to make several calls. Use only the '
            "functions above, with arguments that match their parameters. When no function is "
            "needed, answer in plain text."
        )


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "json": JsonToolParser}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; known parsers: {known}") from None


def parse_required_calls(text: str, tool_names: Collection[str] | None) -> list[ParsedToolCall]:
    """The calls of the complete elements so far of a (possibly partial) JSON array of
    `{"name", "arguments"}` objects, the output of tool_choice "required"."""
    names = None if tool_names is None else frozenset(tool_names)
    i = _skip_ws(text, 0)
    if not text.startswith("[", i):
        return []
    i += 1
    calls = []
    while True:
        i = _skip_ws(text, i)
        if i >= len(text) or text[i] == "]":
            break
        try:
            obj, i = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the element is still being generated
        if (call := _to_call(obj, names)) is not None:
            calls.append(call)
        i = _skip_ws(text, i)
        if not text.startswith(",", i):
            break
        i += 1
    return calls


class ToolCallStreamer:
    """Splits one streamed choice into content that is safe to send and finished calls."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._sent = 0  # chars of `text` already sent as content: always a prefix
        self._calls: list[ParsedToolCall] = []

    @property
    def calls(self) -> list[ParsedToolCall]:
        return list(self._calls)

    def feed(self, delta_text: str) -> tuple[str, list[ParsedToolCall]]:
        self.text += delta_text
        content = ""
        end = self.parser.content_end(self.text)
        if end > self._sent:
            content = self.text[self._sent : end]
            self._sent = end
        new_calls = self.parser.complete_calls(self.text)[len(self._calls) :]
        self._calls.extend(new_calls)
        return content, new_calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        result = self.parser.extract(self.text)
        new_calls = result.calls[len(self._calls) :]
        self._calls.extend(new_calls)
        if not result.calls:
            content = self.text[self._sent :]
        else:
            content = _unsent(self.text[: self._sent], result.content or "")
        self._sent = len(self.text)
        return content, new_calls


def _unsent(sent: str, content: str) -> str:
    """The part of the final (stripped) content not yet covered by the sent prefix. What was sent
    comes before the first call, so up to whitespace it is a prefix of the content."""
    head = sent.lstrip()
    if content.startswith(head):
        return content[len(head) :]
    return ""  # the sent text already covers the content, up to trailing whitespace
