"""Tool calls in a reply: the Qwen3-Coder XML that Qwen3.5/3.6 write, parsed into calls with typed arguments.

The form (shared/specs/tool_calls.md): `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...
</function>\\n</tool_call>`, several calls one after another, ordinary text before the first. A value is the text
between its tags less one leading and one trailing newline, converted by the tool's JSON schema type for that
parameter (vLLM's `qwen3_coder` rules). A reply that does not parse, or that calls a tool the request did not offer,
is returned whole as text: the client sees what the model wrote instead of a call that was never made.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
from typing import Any, Mapping

CALL_OPEN = "<tool_call>"
_FUNCTION = re.compile(r"\s*<tool_call>\n?<function=([^>\n]+)>\n?")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_CLOSE = re.compile(r"\s*</function>\s*</tool_call>")
_STRINGS = {"string", "str", "text", "varchar", "char", "enum"}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call the model made: a tool's name and its arguments, converted by the tool's schema."""

    name: str
    arguments: dict[str, Any]


class _Malformed(Exception):
    """Text after the first `<tool_call>` that is not a run of well-formed calls of offered tools."""


def _types(schema: Any) -> list[str]:
    """The JSON schema type names of a parameter, lower case, in the schema's order (none when it gives none)."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    kinds = kind if isinstance(kind, list) else [kind]
    return [k.lower() for k in kinds if isinstance(k, str)]


def _number(text: str, integer: bool) -> int | float:
    """An integer or a finite number (an integral one as an int); ValueError otherwise."""
    if integer:
        return int(text)
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return int(value) if value.is_integer() else value


def _structure(text: str, kind: str) -> Any:
    """An object or array written as JSON, else as a Python literal; ValueError when it is neither or the wrong kind."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        try:
            value = ast.literal_eval(text)
            json.dumps(value)  # a set, bytes or a complex number is no JSON value
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise ValueError(text) from None
    if not isinstance(value, dict if kind == "object" else (list, tuple)):
        raise ValueError(text)
    return list(value) if isinstance(value, tuple) else value


def _as(text: str, kind: str) -> Any:
    """The text as a value of one JSON schema type; ValueError when it is not one."""
    stripped = text.strip()
    if kind in ("integer", "int"):
        return _number(stripped, True)
    if kind in ("number", "float", "double"):
        return _number(stripped, False)
    if kind in ("boolean", "bool"):
        if stripped.lower() not in ("true", "false"):
            raise ValueError(text)
        return stripped.lower() == "true"
    if kind in ("object", "array"):
        return _structure(stripped, kind)
    if kind == "null" and stripped.lower() == "null":
        return None
    raise ValueError(text)


def convert(text: str, schema: Any) -> Any:
    """A parameter's text as its schema types it: strings (and untyped or unknown parameters) as they are; integers,
    numbers, booleans, objects, arrays and null parsed, in the schema's order of types, the text kept when none fits."""
    kinds = _types(schema)
    if not kinds or any(k in _STRINGS for k in kinds):
        return text
    for kind in kinds:
        try:
            return _as(text, kind)
        except ValueError:
            continue
    return text


def _call(text: str, at: int, tools: Mapping[str, Any]) -> tuple[ToolCall, int]:
    """The call that starts at text[at] (leading whitespace allowed) and where it ends."""
    head = _FUNCTION.match(text, at)
    if head is None:
        raise _Malformed
    name = head.group(1).strip()
    if name not in tools:
        raise _Malformed
    properties = (tools[name] or {}).get("properties") or {}
    arguments, at = {}, head.end()
    while (parameter := _PARAMETER.match(text, at)) is not None:
        key = parameter.group(1).strip()
        if key in arguments or "<parameter=" in parameter.group(2):
            raise _Malformed  # a repeated name, or a parameter left open before the next
        arguments[key] = convert(parameter.group(2), properties.get(key))
        at = parameter.end()
    close = _CLOSE.match(text, at)
    if close is None:
        raise _Malformed
    return ToolCall(name, arguments), close.end()


def parse(text: str, tools: Mapping[str, Any]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply, given the offered tools as {name: parameters schema}: content is the text before
    the first call, trailing whitespace removed (the template puts a blank line between them); a reply that is not
    text followed by well-formed calls of offered tools (and nothing but whitespace after them) is all content."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, []
    calls, at = [], start
    try:
        while at < len(text) and text[at:].strip():
            call, at = _call(text, at, tools)
            calls.append(call)
    except _Malformed:
        return text, []
    return text[:start].rstrip(), calls


def arguments_json(call: ToolCall) -> str:
    """A call's arguments as OpenAI's `function.arguments` string (non-ASCII text kept)."""
    return json.dumps(call.arguments, ensure_ascii=False)
