"""The Anthropic Messages API: /v1/messages (and count_tokens) requests, responses and stream events.

Tools (`tools` with an `input_schema`, `tool_choice`, past `tool_use` and `tool_result` blocks) go to the chat template
in its OpenAI-like form (server/tool_use.py); the reply's calls come back as `tool_use` blocks and its think block as
`thinking` blocks (server/reply.py)."""

from __future__ import annotations

from typing import Any, AsyncIterator, Sequence

from dflash_jax.server import reply
from dflash_jax.server.request import (BadRequest, GenRequest, Settings, field, max_tokens, refuse, sampling,
                                       stop_strings, text_of, think_budget)
from dflash_jax.server.tool_calls import ToolCall, argument_pieces
from dflash_jax.server.tool_use import ChatPrompt, ToolUse, check_template, check_tool, choose, reply_prompt
from dflash_jax.server.wire import new_id, sse
from dflash_jax.server.worker import Job

UNSUPPORTED = {"mcp_servers": "MCP servers are not implemented", "container": "code execution is not implemented"}
STOP_REASON = {"stop_token": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens"}
TOOL_CHOICE = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}
MAX_TEMPERATURE = 1.0  # Anthropic's range of temperature
SIGNATURE = ""  # of every thinking block: there is no encrypted copy of the reasoning to check it against


def _tools(body: dict) -> list[dict]:
    """The request's custom tools, checked, in the form the chat template renders (OpenAI's function form)."""
    tools, names = [], set()
    for i, tool in enumerate(field(body, "tools", list, [])):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise BadRequest(f"{where} must be an object", "tools")
        if tool.get("type") not in (None, "custom"):
            raise BadRequest(f"{where} is of type {tool.get('type')!r}: server tools are not implemented (send custom "
                             "tools: name, description, input_schema)", "tools")
        check_tool(where, tool.get("name"), tool.get("description", ""), tool.get("input_schema"), names,
                   "input_schema")
        described = {"description": tool["description"]} if "description" in tool else {}
        tools.append({"type": "function", "function": {"name": tool["name"], **described,
                                                       "parameters": tool["input_schema"]}})
    return tools


def _tool_use(body: dict, tools: list[dict]) -> ToolUse:
    """What tool_choice (auto, any, tool with a name, none; disable_parallel_tool_use) asks of the reply."""
    choice = field(body, "tool_choice", dict, {"type": "auto"})
    kind = choice.get("type")
    if kind not in TOOL_CHOICE:
        raise BadRequest(f"tool_choice.type must be one of {', '.join(TOOL_CHOICE)}, got {kind!r}", "tool_choice")
    if kind == "tool" and not isinstance(choice.get("name"), str):
        raise BadRequest("tool_choice of type 'tool' needs the tool's name", "tool_choice")
    single = choice.get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):
        raise BadRequest("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    return choose(schemas, TOOL_CHOICE[kind], choice.get("name"), single, "tool_choice")


def _thinking(body: dict) -> tuple[bool | None, int | None]:
    """(thinking, budget): `thinking` enabled with its budget_tokens, disabled, or left out (None: the server's)."""
    thinking = field(body, "thinking", dict, None)
    if thinking is None:
        return None, None
    if thinking.get("type") == "disabled":
        return False, None
    if thinking.get("type") != "enabled":
        raise BadRequest(f"thinking.type must be 'enabled' or 'disabled', got {thinking.get('type')!r}", "thinking")
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise BadRequest(f"thinking.budget_tokens must be an integer of at least 1 with thinking enabled, got "
                         f"{budget!r}", "thinking")
    return True, budget


def _blocks(content: Any, where: str) -> list[dict]:
    """A message's content as blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise BadRequest(f"{where}.content must be a string or an array of content blocks", "messages")
    return content


def _user(content: Any, where: str) -> list[dict]:
    """A user turn as the template's messages: each tool_result a `tool` message, the text blocks between them a
    user message."""
    out: list[dict] = []
    for j, block in enumerate(_blocks(content, where)):
        at = f"{where}.content[{j}]"
        if block.get("type") == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise BadRequest(f"{at}.tool_use_id must be a string (the id of the tool_use this answers)",
                                 "messages")
            result = block.get("content", "")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": text_of(result, at) if result is not None else ""})
        elif block.get("type") == "text":
            text = text_of([block], where)
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text})
        else:
            raise BadRequest(f"{at} is of type {block.get('type')!r}: only text content and tool_result blocks are "
                             "supported in a user turn", "messages")
    return out


def _assistant(content: Any, where: str) -> dict:
    """An assistant turn as the template reads it: its text, its thinking as reasoning_content, its tool_use blocks
    as tool_calls."""
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(_blocks(content, where)):
        at, kind = f"{where}.content[{j}]", block.get("type")
        if kind == "text":
            texts.append(text_of([block], where))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise BadRequest(f"{at}.thinking must be a string", "messages")
            thoughts.append(block["thinking"])
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input"), dict):
                raise BadRequest(f"{at} must have a name and an input object", "messages")
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block["name"], "arguments": block["input"]}})
        else:
            raise BadRequest(f"{at} is of type {kind!r}: only text, thinking and tool_use blocks are supported in an "
                             "assistant turn", "messages")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(body: dict) -> list[dict]:
    """The chat messages of a Messages body: system (a string or text blocks) and user/assistant turns."""
    system = field(body, "system", (str, list), "")
    messages = [{"role": "system", "content": text_of(system, "system")}] if system else []
    for i, m in enumerate(field(body, "messages", list)):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadRequest(f"{where} must be an object with role 'user' or 'assistant'", "messages")
        if m.get("content") is None:
            raise BadRequest(f"{where}.content is required", "messages")
        if m["role"] == "user":
            messages.extend(_user(m["content"], where))
        else:
            messages.append(_assistant(m["content"], where))
    if len(messages) == (1 if system else 0):
        raise BadRequest("'messages' must not be empty", "messages")
    return messages


def _prompt(body: dict, settings: Settings) -> tuple[ChatPrompt, ToolUse, int | None]:
    """(the prompt, the tool use, the thinking budget asked for) of a Messages body."""
    refuse(body, UNSUPPORTED)
    tools = _tools(body)
    use = _tool_use(body, tools)
    thinking, budget = _thinking(body)
    if use.forced and thinking:
        raise BadRequest("thinking may not be enabled when tool_choice forces tool use", "thinking")
    messages = _messages(body)
    check_template(settings, tools, messages, "messages", "tool_result blocks")
    return reply_prompt(settings, messages, thinking, tools, use), use, budget


def prompt_ids(body: dict, settings: Settings) -> list[int]:
    """The prompt of a Messages body: its messages (and tools) through the chat template."""
    return _prompt(body, settings)[0].ids


def parse_messages(body: dict, settings: Settings) -> GenRequest:
    """A /v1/messages body as a generation request; a last assistant message is continued (prefill)."""
    sampled = sampling(body, settings, MAX_TEMPERATURE)
    prompt, use, budget = _prompt(body, settings)
    limit = max_tokens(field(body, "max_tokens", int), len(prompt.ids), settings)
    if budget is not None and budget >= limit:
        raise BadRequest(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({limit})", "thinking")
    return GenRequest(prompt.ids, limit, stop_strings(body, "stop_sequences"), field(body, "stream", bool, False),
                      sampling=sampled, reasoning_budget=think_budget(settings, budget, prompt.thinks),
                      **prompt.fields(), **use.fields())


def _usage(job: Job) -> dict[str, int]:
    cached = job.outcome.cached_tokens
    return {"input_tokens": len(job.request.ids) - cached, "output_tokens": job.outcome.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _message(message_id: str, settings: Settings, content: list, stop_reason: str | None,
             stop_sequence: str | None, usage: dict[str, int]) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": settings.model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


def _stop_reason(job: Job, called: bool) -> str:
    return "tool_use" if called else STOP_REASON[job.outcome.finish]


def _tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": new_id("toolu_"), "name": call.name, "input": call.arguments}


def message_response(jobs: Sequence[Job], texts: Sequence[str], settings: Settings) -> dict[str, Any]:
    """The message: a thinking block (the think block), text, tool_use blocks, text after them; a text block at
    least."""
    (job,), (text,) = jobs, texts  # one choice: the Messages API has no n
    read = reply.read(text, job.request)
    content = [{"type": "thinking", "thinking": read.reasoning, "signature": SIGNATURE}] if read.reasoning else []
    content += [{"type": "text", "text": read.content}] if read.content else []
    content += [_tool_use_block(c) for c in read.calls]
    content += [{"type": "text", "text": read.tail}] if read.tail else []
    return _message(new_id("msg_"), settings, content or [{"type": "text", "text": ""}],
                    _stop_reason(job, bool(read.calls)), job.outcome.matched, _usage(job))


class _BlockStream:
    """Content block events of a streamed message: a block starts when a reply event of another kind arrives."""

    def __init__(self):
        self.index, self.open = -1, None  # the current block and its type (None: none open)

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self.stop()
        self.index, self.open = self.index + 1, block["type"]
        return out + [sse({"type": "content_block_start", "index": self.index, "content_block": block},
                          "content_block_start")]

    def stop(self) -> list[str]:
        """Close the open block (a thinking block gets its signature first)."""
        if self.open is None:
            return []
        out = [self._delta({"type": "signature_delta", "signature": SIGNATURE})] if self.open == "thinking" else []
        self.open = None
        return out + [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def add(self, event: reply.Event) -> list[str]:
        if isinstance(event, reply.Call):
            block = {**_tool_use_block(event.call), "input": {}}
            return self._start(block) + [self._delta({"type": "input_json_delta", "partial_json": piece})
                                         for piece in argument_pieces(event.call)] + self.stop()
        kind = "thinking" if isinstance(event, reply.Reasoning) else "text"
        out = [] if self.open == kind else self._start(
            {"type": "thinking", "thinking": "", "signature": SIGNATURE} if kind == "thinking"
            else {"type": "text", "text": ""})
        return out + [self._delta({"type": "thinking_delta", "thinking": event.text} if kind == "thinking"
                                  else {"type": "text_delta", "text": event.text})]

    def end(self) -> list[str]:
        """Close the last block; a reply of no text still gets an empty text block."""
        return self._start({"type": "text", "text": ""}) + self.stop() if self.index < 0 else self.stop()


async def message_stream(job: Job, settings: Settings) -> AsyncIterator[str]:
    """message_start; per block content_block_start, its deltas (thinking_delta, text_delta, input_json_delta),
    content_block_stop; message_delta (stop_reason `tool_use` when the reply called tools), message_stop."""
    start = _message(new_id("msg_"), settings, [], None, None,
                     {"input_tokens": len(job.request.ids), "output_tokens": 0})
    yield sse({"type": "message_start", "message": start}, "message_start")
    blocks, called = _BlockStream(), False
    # a failure ends the stream with an error event (app._guarded_events)
    async for event in reply.events(job.pieces(), job.request):
        called = called or isinstance(event, reply.Call)
        for out in blocks.add(event):
            yield out
    for out in blocks.end():
        yield out
    delta = {"stop_reason": _stop_reason(job, called), "stop_sequence": job.outcome.matched}
    yield sse({"type": "message_delta", "delta": delta, "usage": _usage(job)}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")
