"""The Responses API's `instructions` and `input` items as the chat messages a template renders.

An assistant turn arrives as consecutive output items (a `reasoning` item, a `message`, `function_call`s: what a
response's `output` holds, sent back as input); they become one assistant message with `reasoning_content`, `content`
and `tool_calls`, as a chat client would send it. `function_call_output` items become `tool` messages."""

from __future__ import annotations

from dflash_jax.server.request import BadRequest, field, text_of
from dflash_jax.server.tool_use import call_arguments

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")


def _assistant(turn: dict | None, messages: list[dict], key: str) -> dict:
    """The assistant message that the next output item (of `key`) belongs to: the open one while it has nothing of
    that kind or after it (reasoning, then content, then calls), else a new one."""
    later = {"reasoning_content": ("reasoning_content", "content", "tool_calls"), "content": ("content", "tool_calls"),
             "tool_calls": ()}[key]
    if turn is None or any(turn.get(k) for k in later):
        turn = {"role": "assistant", "content": ""}
        messages.append(turn)
    return turn


def _message(item: dict, where: str) -> tuple[str, str]:
    """(chat role, text) of a message item."""
    role = item.get("role")
    if role not in ROLES:
        raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", "input")
    if item.get("content") is None:
        raise BadRequest(f"{where}.content is required", "input")
    return ROLES[role], text_of(item["content"], where, TEXT_PARTS)


def _call(item: dict, where: str) -> dict:
    """A function_call item as a chat tool call, its arguments an object for the template."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise BadRequest(f"{where}.{key} must be a string", "input")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": call_arguments(item["arguments"], where, "input")}}


def _reasoning(item: dict, where: str) -> str:
    """The text of a reasoning item: its `content` (reasoning_text parts), else its summary; empty when it has only
    encrypted content."""
    if item.get("content"):
        return text_of(item["content"], where, ("reasoning_text",))
    return text_of(item.get("summary") or [], where, ("summary_text",), "summary")


def input_messages(body: dict) -> list[dict]:
    """The chat messages of a Responses body: `instructions` and the system or developer messages before any other
    item as one system message (joined by blank lines), then the items in order."""
    items = field(body, "input", (str, list))
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not items:
        raise BadRequest("'input' must not be empty", "input")
    instructions = field(body, "instructions", str, "")
    system, messages, calls = [instructions] if instructions else [], [], set()
    turn = None  # the assistant message that consecutive output items fill
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role, text = _message(item, where)
            if role == "assistant":
                turn = _assistant(turn, messages, "content")
                turn["content"] = text
                continue
            if role == "system" and not messages:
                system.append(text)
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            turn = _assistant(turn, messages, "tool_calls")
            turn.setdefault("tool_calls", []).append(_call(item, where))
            calls.add(item["call_id"])
            continue
        elif kind == "reasoning":
            turn = _assistant(turn, messages, "reasoning_content")
            turn["reasoning_content"] = _reasoning(item, where)
            continue
        elif kind == "function_call_output":
            if item.get("call_id") not in calls:
                raise BadRequest(f"{where}.call_id {item.get('call_id')!r} answers no function_call item before it",
                                 "input")
            if item.get("output") is None:
                raise BadRequest(f"{where}.output is required", "input")
            output = text_of(item["output"], where, TEXT_PARTS, "output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "item_reference":  # an item the server would have stored
            raise BadRequest(f"{where}: item references are not supported: responses are not stored (send the item "
                             "itself)", "input")
        else:
            raise BadRequest(f"{where} is of type {kind!r}: only message, function_call, function_call_output and "
                             "reasoning items are supported", "input")
        turn = None
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + messages
