"""Tool calling on the chat endpoint: what a request lets the model call, the conversation as
the chat template sees it, and the calls read back from the output (whole or streamed).

tool_choice "auto" lets the model answer freely; the configured parser (--tool-call-parser)
finds calls in its text (with hermes, a lazy grammar holds each call to the tools' schemas once
the model opens it). "required" and a named function go through structured outputs from the
first token, so the call always parses: a JSON array of {"name", "arguments"} objects (at least
one; one only without parallel_tool_calls) for "required", the function's arguments object for
a named one.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagedllm.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    ParsedToolCall,
    ToolCallStreamer,
    ToolParser,
    get_tool_parser,
    parse_required_calls,
)
from pagedllm.model_loader.chat_template import template_variables
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output import json_schema_error, lark_json

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    """How one request may call tools. mode: "none", "auto", "required" or "named"."""

    mode: str = "none"
    tools: list[dict] = field(default_factory=list)  # OpenAI tool dicts
    named: str | None = None  # the function of a named tool_choice
    parallel: bool = True
    # Finds the calls in "auto" output, and writes the tools and earlier calls into the prompt
    # of a template that does not render tools itself (hermes when no parser is configured).
    parser: ToolParser = field(default_factory=HermesToolParser)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def parameters(self, name: str) -> dict:
        tool = next(t for t in self.tools if t["function"]["name"] == name)
        return tool["function"].get("parameters") or _NO_ARGUMENTS

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint that makes the calls parse: "required" and named always; "auto" with
        the hermes parser from the moment the model opens a call."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self.parameters(self.named))
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": self.parameters(name)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name in self.names
        ]
        if self.mode == "auto" and isinstance(self.parser, HermesToolParser):
            return StructuredOutputsParams(grammar=_lazy_hermes_grammar(calls))
        if self.mode != "required":
            return None
        schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)


def _lazy_hermes_grammar(calls: list[dict]) -> str:
    """Free text, in which each `<tool_call>` must go on into one of `calls` and its closing
    tag (llguidance's lazy lexeme: TEXT ends at the first `<tool_call>`). Like llama.cpp's lazy
    grammars: nothing is constrained until the model opens a call."""
    alternatives = " | ".join(f"call_{i}" for i in range(len(calls)))
    return "\n".join(
        [
            "start: tool_call* TEXT",
            "TEXT: /(.|\\n)*/",
            'call_head[lazy]: TEXT "<tool_call>"',
            f'tool_call: call_head "\\n"? ({alternatives}) "\\n"? "</tool_call>"',
            *(f"call_{i}: {lark_json(call)}" for i, call in enumerate(calls)),
        ]
    )


def offered_tools(tools: list | None, tool_call_parser: str | None) -> ToolPlan:
    """The checked tools (OpenAIError for bad ones), shown to the model as with "auto"."""
    tools = [t.model_dump(exclude_none=True) for t in tools or []]
    seen = set()
    for i, tool in enumerate(tools):
        function = tool["function"]
        name = function["name"]
        if not _NAME.fullmatch(name):
            raise OpenAIError(
                f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-', "
                f"got {name!r}",
                param="tools",
            )
        if name in seen:
            raise OpenAIError(f"tools: the function name {name!r} is used twice", param="tools")
        seen.add(name)
        error = json_schema_error(function.get("parameters") or _NO_ARGUMENTS)
        if error is not None:
            raise OpenAIError(
                f"tools[{i}].function.parameters ({name}) is not a usable JSON schema: {error}",
                param="tools",
            )
    parser = get_tool_parser(tool_call_parser or "hermes")(seen)
    return ToolPlan(mode="auto" if tools else "none", tools=tools, parser=parser)


def plan_tools(
    body: ChatCompletionRequest, enable_auto_tool_choice: bool, tool_call_parser: str | None
) -> ToolPlan:
    """Check the request's tools and tool_choice (OpenAIError for bad ones)."""
    plan = offered_tools(body.tools, tool_call_parser)
    plan.parallel = body.parallel_tool_calls
    choice = body.tool_choice
    if choice is None:
        choice = plan.mode  # OpenAI's default: "auto" with tools, "none" without
    if choice != "none" and not plan.tools:
        raise OpenAIError("tool_choice is only allowed when tools are given", param="tool_choice")
    if isinstance(choice, str):
        plan.mode = choice
    else:
        plan.mode, plan.named = "named", choice.function.name
        if plan.named not in plan.names:
            raise OpenAIError(
                f"tool_choice names the function {plan.named!r}, which is not among the tools "
                f"({', '.join(sorted(plan.names))})",
                param="tool_choice",
            )
    if plan.mode == "auto" and not (enable_auto_tool_choice and tool_call_parser):
        raise OpenAIError(
            '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
            '--tool-call-parser (or give tool_choice "none", "required" or a function)',
            param="tool_choice",
        )
    return plan


def template_messages(
    messages: list[dict], plan: ToolPlan, template: str
) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template. A template that renders `tools` gets them as
    they are, with earlier calls' arguments as objects (as HF templates expect). Any other
    template gets the tools described in the system message, and earlier calls and their
    results written as text in the parser's format."""
    messages = [_checked_message(i, m) for i, m in enumerate(messages)]
    tools = plan.tools if plan.mode != "none" else None
    if "tools" in template_variables(template):
        return messages, tools
    converted = []
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = [
                ParsedToolCall(c["function"]["name"], _arguments_text(c["function"]["arguments"]))
                for c in message["tool_calls"]
            ]
            text = plan.parser.format_calls(calls)
            content = message.get("content")
            message = {"role": "assistant", "content": f"{content}\n{text}" if content else text}
        elif message["role"] == "tool":
            content = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            message = {"role": "user", "content": content}
        converted.append(message)
    if tools:
        prompt = plan.parser.system_prompt(tools)
        if converted[0]["role"] == "system":
            system = converted[0].get("content") or ""
            converted[0] = {**converted[0], "content": f"{system}\n\n{prompt}".strip()}
        else:
            converted.insert(0, {"role": "system", "content": prompt})
    return converted, None


def _checked_message(i: int, message: dict) -> dict:
    role = message["role"]
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise OpenAIError(
            f"messages[{i}]: a message with role 'tool' needs a tool_call_id", param="messages"
        )
    calls = message.get("tool_calls")
    if calls is None:
        return message
    if role != "assistant" or not isinstance(calls, list):
        raise OpenAIError(
            f"messages[{i}]: tool_calls must be a list, on an assistant message", param="messages"
        )
    normalized = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise OpenAIError(
                f"messages[{i}].tool_calls: each call needs a function with a name",
                param="messages",
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):  # templates read the arguments as an object
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        normalized.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": normalized}


def _arguments_text(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def calls_in_output(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, calls) of one finished choice."""
    if plan.mode == "named":
        return None, [ParsedToolCall(plan.named, text)]
    if plan.mode == "required":
        return None, parse_required_calls(text, plan.names)
    extracted = plan.parser.extract(text)
    calls = extracted.calls if plan.parallel else extracted.calls[:1]
    return extracted.content, calls


def response_tool_calls(calls: list[ParsedToolCall]) -> list[ToolCall]:
    return [
        ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]


class ToolCallStream:
    """One streamed choice: its text deltas in, content and tool-call deltas out."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.num_calls = 0
        self._streamer = ToolCallStreamer(plan.parser) if plan.mode == "auto" else None

    def feed(self, delta: str) -> tuple[str | None, list[DeltaToolCall]]:
        self.text += delta
        if self.plan.mode == "named":  # the arguments stream as they are generated
            if self.num_calls == 0:
                self.num_calls = 1
                return None, [self._whole(0, ParsedToolCall(self.plan.named, delta))]
            if not delta:
                return None, []
            return None, [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))]
        if self.plan.mode == "required":
            return None, self._new(parse_required_calls(self.text, self.plan.names))
        content, calls = self._streamer.feed(delta)
        return content or None, self._new(self._streamer.calls)

    def finish(self) -> tuple[str | None, list[DeltaToolCall]]:
        if self.plan.mode == "named":
            return self.feed("") if self.num_calls == 0 else (None, [])
        if self.plan.mode == "required":
            return None, []
        content, _ = self._streamer.finish()
        return content or None, self._new(self._streamer.calls)

    def _new(self, calls: list[ParsedToolCall]) -> list[DeltaToolCall]:
        """Calls not sent yet, each whole (id, name and all its arguments) in one delta."""
        if not self.plan.parallel:
            calls = calls[:1]
        new = [self._whole(i, c) for i, c in enumerate(calls) if i >= self.num_calls]
        self.num_calls = max(self.num_calls, len(calls))
        return new

    @staticmethod
    def _whole(index: int, call: ParsedToolCall) -> DeltaToolCall:
        return DeltaToolCall(
            index=index,
            id=tool_call_id(),
            type="function",
            function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
        )
