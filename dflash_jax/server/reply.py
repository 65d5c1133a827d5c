"""A chat reply read as it streams: reasoning (the think block), answer text, and tool calls, as typed events.

With thinking on, Qwen3.5's template opens the think block in the prompt (`<think>\\n`), so the reply starts inside it:
its text before `</think>` is reasoning. A reply that itself begins with `<think>` (templates that leave the tag to
the model) is read the same way. Reasoning loses its surrounding whitespace, the answer its leading whitespace (the
template writes `\\n</think>\\n\\n` between them). The answer is content, or, when the request's tools are parsed,
content and calls as `tool_calls.parse` reads them (server/tool_calls.py).

`ReplyParser` takes the text in pieces and gives each event once it is decided: text that may still be the start of
a tag (or whitespace that a tag after it would drop) is held back, and a call is given whole once its `</tool_call>`
closes it, since until then more text can still make it malformed, and a malformed call is content. Run over every
split of a reply, it gives the events `whole` gives for the whole reply.
"""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Mapping

from dflash_jax.server.request import GenRequest
from dflash_jax.server.tool_calls import CALL_OPEN, CallReader, Malformed, ToolCall, parse

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class Reasoning:
    """Text of the think block."""

    text: str


@dataclasses.dataclass(frozen=True)
class Content:
    """Answer text (before the calls, or, after them, text that is not a call)."""

    text: str


@dataclasses.dataclass(frozen=True)
class Call:
    """The reply's index-th well-formed tool call."""

    index: int
    call: ToolCall


Event = Reasoning | Content | Call


@dataclasses.dataclass(frozen=True)
class Reply:
    """A whole reply read: reasoning, content before the calls, the calls, and text after them (`tool_calls.parse`)."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[ToolCall, ...] = ()
    tail: str = ""


def opens_thinking(prompt: str) -> bool:
    """Whether a prompt's text leaves a think block open for the reply (it ends in `<think>` and whitespace)."""
    return prompt.rstrip().endswith(THINK_OPEN)


def split_reasoning(text: str, thinking: bool) -> tuple[str, str]:
    """(reasoning, answer) of a reply that starts inside a think block when `thinking`; else of one that opens it
    itself, else ("", text). An unclosed block is all reasoning."""
    if not thinking:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            return "", text
        text = stripped[len(THINK_OPEN):]
    end = text.find(THINK_CLOSE)
    if end < 0:
        return text.strip(), ""
    return text[:end].strip(), text[end + len(THINK_CLOSE):].lstrip()


def whole(text: str, thinking: bool, tools: Mapping[str, Any] | None, single: bool = False) -> Reply:
    """A whole reply read at once (tools: {name: parameters schema} whose calls are parsed, or None; single: only
    the first call is kept)."""
    reasoning, answer = split_reasoning(text, thinking)
    if not tools:
        return Reply(reasoning, answer)
    content, calls, tail = parse(answer, tools)
    return Reply(reasoning, content, tuple(calls[:1] if single else calls), tail)


def collect(events: list[Event]) -> Reply:
    """The Reply that a list of events adds up to."""
    calls = tuple(e.call for e in events if isinstance(e, Call))
    first = next((i for i, e in enumerate(events) if isinstance(e, Call)), len(events))
    return Reply("".join(e.text for e in events if isinstance(e, Reasoning)),
                 "".join(e.text for e in events[:first] if isinstance(e, Content)), calls,
                 "".join(e.text for e in events[first:] if isinstance(e, Content)))


def _held(text: str, tag: str) -> int:
    """Where the undecided end of text begins: its trailing whitespace and a proper prefix of tag after it."""
    cut = next((len(text) - k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])),
               len(text))
    return len(text[:cut].rstrip())


class ReplyParser:
    """Feed a reply's text in pieces (`push`), then `finish`; each returns the events decided by then."""

    def __init__(self, thinking: bool, tools: Mapping[str, Any] | None, single: bool = False):
        self.tools, self.single = tools or None, single
        self.state = "reasoning" if thinking else "start"
        self.buffer = ""  # text received and not yet given out
        self.gap = ""  # the whitespace between the content and the first call: dropped, unless the call is malformed
        self.started = False  # whether any reasoning was given out (its leading whitespace is dropped)
        self.reader: CallReader | None = None
        self.calls = 0

    def push(self, text: str) -> list[Event]:
        self.buffer += text
        return self._run(False)

    def finish(self) -> list[Event]:
        return self._run(True)

    def _run(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while getattr(self, "_" + self.state)(events, final):  # a state returns True when it hands on to another
            pass
        return events

    def _start(self, events: list[Event], final: bool) -> bool:
        """The reply's first text: `<think>` (after whitespace) opens reasoning; anything else is the answer."""
        stripped = self.buffer.lstrip()
        if stripped.startswith(THINK_OPEN):
            self.buffer, self.state = stripped[len(THINK_OPEN):], "reasoning"
            return True
        if not final and THINK_OPEN.startswith(stripped):
            return False
        self.state = "answer"
        return True

    def _reasoning(self, events: list[Event], final: bool) -> bool:
        end = self.buffer.find(THINK_CLOSE)
        cut = end if end >= 0 else len(self.buffer.rstrip()) if final else _held(self.buffer, THINK_CLOSE)
        text = self.buffer[:cut] if self.started else self.buffer[:cut].lstrip()
        text = text.rstrip() if end >= 0 else text
        if text:
            events.append(Reasoning(text))
            self.started = True
        if end < 0:
            self.buffer = "" if final else self.buffer[cut:]
            return False
        self.buffer, self.state = self.buffer[end + len(THINK_CLOSE):], "answer_start"
        return True

    def _answer_start(self, events: list[Event], final: bool) -> bool:
        """Whitespace between `</think>` and the answer is dropped."""
        self.buffer = self.buffer.lstrip()
        if not self.buffer and not final:
            return False
        self.state = "answer"
        return True

    def _answer(self, events: list[Event], final: bool) -> bool:
        start = self.buffer.find(CALL_OPEN) if self.tools else -1
        if start < 0:
            cut = len(self.buffer) if final or not self.tools else _held(self.buffer, CALL_OPEN)
            if cut:
                events.append(Content(self.buffer[:cut]))
            self.buffer = self.buffer[cut:]
            return False
        content = self.buffer[:start].rstrip()
        if content:
            events.append(Content(content))
        self.gap, self.buffer = self.buffer[len(content):start], self.buffer[start:]
        self.state, self.reader = "call", CallReader(self.tools)
        return True

    def _call(self, events: list[Event], final: bool) -> bool:
        try:
            read = self.reader.read(self.buffer, final)
        except Malformed:  # the rest of the reply is text
            if self.gap + self.buffer:
                events.append(Content(self.gap + self.buffer))
            self.gap = self.buffer = ""
            self.state = "tail"
            return False
        if read is None:
            return False
        call, end = read
        if not (self.single and self.calls):
            events.append(Call(self.calls, call))
        self.calls += 1
        self.gap, self.buffer, self.state = "", self.buffer[end:], "between"
        return True

    def _between(self, events: list[Event], final: bool) -> bool:
        """After a call: whitespace, then another call, or text that is not one (the tail)."""
        if not self.buffer.strip():
            self.buffer = "" if final else self.buffer
            return False
        self.state, self.reader = "call", CallReader(self.tools)
        return True

    def _tail(self, events: list[Event], final: bool) -> bool:
        if self.buffer:
            events.append(Content(self.buffer))
        self.buffer = ""
        return False


def read(text: str, request: GenRequest) -> Reply:
    """A request's whole reply: its forced prefix, then the generated text."""
    return whole(request.prefix + text, request.thinks, request.tools, request.single_call)


async def events(pieces: AsyncIterator[str], request: GenRequest) -> AsyncIterator[Event]:
    """The events of a request's streamed reply: its forced prefix, then the generated pieces."""
    parser = ReplyParser(request.thinks, request.tools, request.single_call)
    for event in parser.push(request.prefix):
        yield event
    async for piece in pieces:
        for event in parser.push(piece):
            yield event
    for event in parser.finish():
        yield event
