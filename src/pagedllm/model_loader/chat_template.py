"""Rendering Hugging Face chat templates (Jinja) in a sandbox, the way transformers does.

Chat templates ship inside model files from the internet: they are untrusted code. We render them
with jinja2's ImmutableSandboxedEnvironment and hand them only plain JSON-like data, so a template
can format text but cannot reach Python internals.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # HF's tojson: no HTML escaping (jinja's built-in escapes <, >, &, ') and json.dumps options.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, closing a route to CPython internals."""

    def __init__(*args, **kwargs):  # same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _Dict:
    """`dict(...)` for templates without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}` (marks text for training masks): no-op."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class ChatTemplateSecurityError(jinja2.exceptions.SecurityError, ValueError):
    """A chat template tried something the sandbox forbids (a ValueError too, so that callers
    that report bad input, the CLI and the server, show its message)."""


_MAX_RESULT = 1_000_000  # items: the longest string or list `*` may build


class _ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox, stricter in two ways: an unsafe attribute (`x.__class__`) raises
    at once instead of rendering as an empty string, and `*` / `**` cannot build huge values (a
    template could otherwise exhaust memory: `'a' * 10**10`)."""

    intercepted_binops = frozenset(["*", "**"])

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise ChatTemplateSecurityError(
            f"the chat template accessed {attribute!r} of a {type(obj).__name__} object, which "
            "is not allowed"
        )

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    if len(seq) * times > _MAX_RESULT:
                        raise ChatTemplateSecurityError(
                            f"the chat template tried to build a value of {len(seq) * times} "
                            f"items (at most {_MAX_RESULT})"
                        )
        elif operator == "**":
            if isinstance(right, (int, float)) and abs(right) > 1000:
                raise ChatTemplateSecurityError(f"the chat template raised a number to {right}")
        return super().call_binop(context, operator, left, right)


def _unsafe_names(tree: jinja2.nodes.Node):
    """(name, line) of every underscore attribute, item or keyword the template names literally:
    `x.__class__`, `x['__globals__']`, `x|attr('__init__')`, `namespace(__dict__=...)`."""
    for node in tree.find_all(jinja2.nodes.Node):
        name = None
        if isinstance(node, jinja2.nodes.Getattr | jinja2.nodes.NSRef):
            name = node.attr
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
            name = node.arg.value
        elif isinstance(node, jinja2.nodes.Filter) and node.name == "attr" and node.args:
            arg = node.args[0]
            name = arg.value if isinstance(arg, jinja2.nodes.Const) else None
        elif isinstance(node, jinja2.nodes.Keyword):
            name = node.key
        if isinstance(name, str) and name.startswith("_"):
            yield name, node.lineno


def check_chat_template(template: str) -> None:
    """Refuse, before any rendering, a template that names Python internals: chat templates
    format messages and never need them, while template-injection payloads (reaching `os`
    through `cycler.__init__.__globals__` and the like) always do. Raises
    ChatTemplateSecurityError; a syntax error is left for rendering to report."""
    env = _ChatTemplateEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    try:
        tree = env.parse(template)
    except jinja2.exceptions.TemplateSyntaxError:
        return
    for name, line in _unsafe_names(tree):
        raise ChatTemplateSecurityError(
            f"the chat template accesses {name!r} (line {line}), a Python internal that no chat "
            "template needs: this looks like a template-injection attack, so the template is "
            "refused (nothing was run)"
        )


@lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    check_chat_template(template)
    env = _ChatTemplateEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


@lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads (e.g. whether it renders `tools` itself)."""
    env = _ChatTemplateEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.exceptions.TemplateSyntaxError:
        return frozenset()


def plain_data(value: Any) -> Any:
    """Rebuild `value` from JSON-like types only: objects with methods never reach the template."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models (e.g. OpenAI SDK messages)
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def render_chat_template(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    **kwargs: Any,
) -> str:
    """Render one conversation; `kwargs` (special tokens, template switches) become variables."""
    chat = []
    for message in plain_data(list(messages)):
        if not isinstance(message, dict):
            raise TypeError(
                f"chat messages must be dicts with 'role' and 'content', got {message!r}"
            )
        # Like HF: drop None values (APIs send content=None); templates handle missing keys.
        chat.append({k: v for k, v in message.items() if v is not None})
    if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
        raise TypeError("tools must be a list of JSON-schema dicts")
    variables = {"documents": None, **plain_data(kwargs)}
    try:
        return compile_chat_template(template).render(
            messages=chat,
            tools=plain_data(tools),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except ChatTemplateSecurityError:
        raise
    except (jinja2.exceptions.SecurityError, OverflowError) as e:  # jinja's own checks
        # (unsafe calls, mutating the messages, range() beyond 100,000 items)
        raise ChatTemplateSecurityError(f"the chat template was stopped: {e}") from None
