"""Flags whose value is a JSON object (vLLM's --speculative-config, --kv-events-config): the
object's fields checked against a config dataclass's before it is built."""

from __future__ import annotations

import json
from dataclasses import fields


def json_object(value: str | dict | None, flag: str, config_class: type) -> dict | None:
    """The flag's JSON text (or a dict, from Python) as a dict whose keys are all fields of
    `config_class`; None when not given. ValueError naming the flag otherwise."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(value).__name__}")
    known = {f.name for f in fields(config_class)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{flag}: unknown field(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(known))}")  # fmt: skip
    return value
