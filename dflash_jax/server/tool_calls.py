"""Tool calls in a reply: the Qwen3-Coder XML that Qwen3.5/3.6 write, parsed into calls with typed arguments.

The form (shared/specs/tool_calls.md): `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...
</function>\\n</tool_call>`, several calls one after another, ordinary text before the first. A value is the text
between its tags less one leading and one trailing newline, converted by the tool's JSON schema type for that
parameter (vLLM's `qwen3_coder` rules). A reply whose first call does not parse, or calls a tool the request did not
offer, is returned whole as text: the client sees what the model wrote instead of a call that was never made. What
follows well-formed calls and is not one is kept as text after them (a stream has sent those calls already).
`CallReader` reads a call as its text arrives (server/reply.py streams replies with it), so both paths share it.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
from typing import Any, Mapping

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
_FUNCTION = re.compile(r"\s*<tool_call>\n?<function=([^>\n]+)>\n?")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_CLOSE = re.compile(r"\s*</function>\s*</tool_call>")
_STRINGS = {"string", "str", "text", "varchar", "char", "enum"}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call the model made: a tool's name and its arguments, converted by the tool's schema."""

    name: str
    arguments: dict[str, Any]


class Malformed(Exception):
    """Text that is not a well-formed call of an offered tool, however it goes on."""


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


def _head_open(text: str, at: int) -> bool:
    """Whether more text could make text[at:] the head of a call (`\\s*<tool_call>\\n?<function=NAME>`)."""
    rest = text[at:].lstrip()
    if CALL_OPEN.startswith(rest):
        return True
    if not rest.startswith(CALL_OPEN):
        return False
    rest = rest[len(CALL_OPEN) + rest.startswith("\n", len(CALL_OPEN)):]
    if FUNCTION_OPEN.startswith(rest):
        return True
    return rest.startswith(FUNCTION_OPEN) and not any(c in rest[len(FUNCTION_OPEN):] for c in ">\n")


def _body_open(text: str, at: int) -> bool:
    """Whether more text could make text[at:] a parameter or the call's close (`_PARAMETER`, `_CLOSE`)."""
    rest = text[at:].lstrip()
    if PARAMETER_OPEN.startswith(rest) or FUNCTION_CLOSE.startswith(rest):
        return True
    if rest.startswith(PARAMETER_OPEN):
        key = re.match(r"[^>\n]*", rest[len(PARAMETER_OPEN):]).group()
        after = rest[len(PARAMETER_OPEN) + len(key):]
        # the name still arriving, or the value (no </parameter> yet, else _PARAMETER had matched)
        return not after or (after[0] == ">" and bool(key) and PARAMETER_OPEN not in after)
    if rest.startswith(FUNCTION_CLOSE):
        return CALL_CLOSE.startswith(rest[len(FUNCTION_CLOSE):].lstrip())
    return False


class CallReader:
    """One call read from text[at:] (whitespace, then its `<tool_call>`) as the text arrives: the pieces that are
    complete are kept, so each read goes on from the last."""

    def __init__(self, tools: Mapping[str, Any], at: int = 0):
        self.tools, self.at = tools, at
        self.name: str | None = None
        self.properties: Mapping[str, Any] = {}
        self.arguments: dict[str, Any] = {}

    def read(self, text: str, complete: bool = True) -> tuple[ToolCall, int] | None:
        """The call and where it ends in text; None while more text could still make it one (never when the text
        is `complete`); Malformed when no text can."""
        if self.name is None:
            head = _FUNCTION.match(text, self.at)
            if head is None:
                if complete or not _head_open(text, self.at):
                    raise Malformed
                return None
            self.name = head.group(1).strip()
            if self.name not in self.tools:
                raise Malformed
            self.properties = (self.tools[self.name] or {}).get("properties") or {}
            self.at = head.end()
        # a value ends at the first </parameter>: the regex runs once that has arrived, so a long value is not
        # scanned again for every piece of it
        while text.find(PARAMETER_CLOSE, self.at) >= 0 and (parameter := _PARAMETER.match(text, self.at)):
            key = parameter.group(1).strip()
            if key in self.arguments or PARAMETER_OPEN in parameter.group(2):
                raise Malformed  # a repeated name, or a parameter left open before the next
            self.arguments[key] = convert(parameter.group(2), self.properties.get(key))
            self.at = parameter.end()
        close = _CLOSE.match(text, self.at)
        if close is not None:
            return ToolCall(self.name, self.arguments), close.end()
        if complete or not _body_open(text, self.at):
            raise Malformed
        return None


def parse(text: str, tools: Mapping[str, Any]) -> tuple[str, list[ToolCall], str]:
    """(content, calls, tail) of a reply, given the offered tools as {name: parameters schema}: content is the text
    before the first call, trailing whitespace removed (the template puts a blank line between them); then the
    well-formed calls of offered tools, one after another; the tail is what follows them when that is not
    whitespace alone (text after the calls, or a call that is malformed or of a tool not offered), kept as written.
    A reply whose first call is not a well-formed call of an offered tool is all content."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, [], ""
    calls, at = [], start
    while text[at:].strip():
        try:
            call, at = CallReader(tools, at).read(text)
        except Malformed:
            break
        calls.append(call)
    if not calls:
        return text, [], ""
    return text[:start].rstrip(), calls, text[at:] if text[at:].strip() else ""


def argument_pieces(call: ToolCall) -> list[str]:
    """A call's `function.arguments` JSON in pieces, as a stream sends it: `{` with the first parameter, each
    further parameter, then `}`; joined, they are `arguments_json`."""
    items = [f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
             for k, v in call.arguments.items()]
    if not items:
        return ["{", "}"]
    return ["{" + items[0]] + [", " + item for item in items[1:]] + ["}"]


def arguments_json(call: ToolCall) -> str:
    """A call's arguments as OpenAI's `function.arguments` string (non-ASCII text kept)."""
    return "".join(argument_pieces(call))
