"""The OpenAI Responses API: /v1/responses requests, responses and stream events (issue 44, item 3).

A request is rendered by the chat template as the equivalent chat (`responses_input`); its reply is split into output
items: the text before `</think>` (when the prompt opened a think block) as a `reasoning` item, the answer as a
`message`, and the Qwen3-Coder calls after it (`tool_calls.parse`) as `function_call` items. A stream sends the same
items, its text as it comes, each call once it is complete."""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Mapping, NamedTuple, Sequence

from dflash_jax.server.request import (BadRequest, GenRequest, Settings, chat_text, check_function, check_template,
                                       field, max_tokens, next_turn_prefix, refuse, sampling)
from dflash_jax.server.responses_input import input_messages
from dflash_jax.server.tool_calls import CALL_OPEN, ToolCall, arguments_json, parse
from dflash_jax.server.wire import new_id, now, sse
from dflash_jax.server.worker import Job, Outcome

UNSUPPORTED = {
    "previous_response_id": "responses are not stored (send the whole conversation in 'input')",
    "conversation": "conversations are not stored (send the whole conversation in 'input')",
    "prompt": "prompt templates are not implemented (send 'instructions' and 'input')",
    "background": "background responses are not implemented",
    "max_tool_calls": "a limit on tool calls is not implemented",
    "top_logprobs": "log probabilities are not implemented",
    "context_management": "context management is not implemented",
}
INCLUDABLE = ("reasoning.encrypted_content",)  # accepted: a reasoning item carries its text, not encrypted content
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
SUMMARIES = ("auto", "concise", "detailed")
MAX_TEMPERATURE = 2.0
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_CLOSE = "</tool_call>"
CALL_START = CALL_OPEN + "\n<function="  # what Qwen3.5 writes to begin a call: a forced reply starts with it


@dataclasses.dataclass(frozen=True)
class ResponsesRequest(GenRequest):
    """A generation request of the Responses API, with what its reply's split and its response need."""

    reasoning: bool = False  # the prompt opened a think block: the reply starts with reasoning
    forced: str = ""  # the start of a call that the prompt ends with (tool_choice required or named)
    echo: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # request fields the response repeats


def _tools(body: dict) -> tuple[list[dict], list[dict]]:
    """(as sent, as the template reads them) of the request's function tools (the flat Responses shape
    `{"type": "function", "name", "description", "parameters"}` becomes chat's `{"type", "function": {...}}`)."""
    tools, names, rendered = field(body, "tools", list, []), set(), []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise BadRequest(f"tools[{i}] is of type {kind!r}: only function tools are supported", "tools")
        check_function(tool, f"tools[{i}]", names)
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        rendered.append({"type": "function", "function": function})
    return tools, rendered


def _tool_choice(body: dict, tools: list[dict]) -> tuple[bool, str]:
    """(whether the reply is parsed for calls, the start of a call the reply is forced to begin with): `auto` parses,
    `none` renders the tools but leaves the reply as text, `required` and a named function force a call."""
    choice = field(body, "tool_choice", (str, dict), "auto")
    names = [t["function"]["name"] for t in tools]
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise BadRequest("tool_choice as an object must be {\"type\": \"function\", \"name\": ...} (allowed tools "
                             "and built-in tools are not supported)", "tool_choice")
        if choice["name"] not in names:
            raise BadRequest(f"tool_choice names the function {choice['name']!r}, which 'tools' does not offer",
                             "tool_choice")
        return True, f"{CALL_START}{choice['name']}>\n"
    if choice not in ("auto", "none", "required"):
        raise BadRequest(f"'tool_choice' must be 'auto', 'none', 'required' or a named function, got {choice!r}",
                         "tool_choice")
    if choice == "required" and not tools:
        raise BadRequest("tool_choice 'required' needs 'tools'", "tool_choice")
    return choice != "none" and bool(tools), CALL_START if choice == "required" else ""


def _reasoning(body: dict) -> tuple[bool | None, dict]:
    """(thinking on or off, None for the server's default; the `reasoning` the response repeats): effort 'none' turns
    the chat template's thinking off, any other effort on; a summary is accepted (none is written)."""
    reasoning = field(body, "reasoning", dict, {})
    other = [k for k, v in reasoning.items() if k not in ("effort", "summary", "generate_summary") and v is not None]
    if other:
        raise BadRequest(f"reasoning.{other[0]} is not supported (send effort and summary)", "reasoning")
    effort, summary = reasoning.get("effort"), reasoning.get("summary") or reasoning.get("generate_summary")
    if effort is not None and effort not in EFFORTS:
        raise BadRequest(f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {effort!r}", "reasoning")
    if summary is not None and summary not in SUMMARIES:
        raise BadRequest(f"reasoning.summary must be one of {', '.join(SUMMARIES)}, got {summary!r}", "reasoning")
    return None if effort is None else effort != "none", {"effort": effort, "summary": summary}


def _check_options(body: dict) -> None:
    """400 for `include`, `text`, `truncation` and `store` values that ask for what the server does not do."""
    include = field(body, "include", list, [])
    bad = [x for x in include if x not in INCLUDABLE]
    if bad:
        raise BadRequest(f"include {bad[0]!r} is not supported (only {', '.join(INCLUDABLE)})", "include")
    text = field(body, "text", dict, {})
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind != "text":
        raise BadRequest(f"text.format {kind!r} is not supported: structured output is not implemented (only text)",
                         "text")
    if text.get("verbosity") not in (None, "medium"):
        raise BadRequest("text.verbosity is not supported (leave it out or send 'medium')", "text")
    if field(body, "truncation", str, "disabled") != "disabled":
        raise BadRequest("truncation 'auto' is not implemented: a conversation over the context is refused",
                         "truncation")
    field(body, "store", bool, False)  # accepted either way: nothing is stored


def parse_responses(body: dict, settings: Settings) -> ResponsesRequest:
    """A /v1/responses body as a generation request (400 for anything the server cannot honour)."""
    refuse(body, UNSUPPORTED)
    _check_options(body)
    sent_tools, tools = _tools(body)
    parsed, forced = _tool_choice(body, tools)
    parallel = field(body, "parallel_tool_calls", bool, True)
    thinking, reasoning = _reasoning(body)
    messages = input_messages(body)
    check_template(settings, tools, messages, "input")
    if "tool_calls" in messages[-1]:
        raise BadRequest("the last input item is a function_call: send its function_call_output after it", "input")
    text = chat_text(settings, messages, thinking, tools, "input")
    opened = text.rstrip().endswith(THINK_OPEN)
    if forced and opened:
        raise BadRequest("tool_choice 'required' or a named function with thinking on is not implemented (send "
                         "reasoning.effort 'none')", "tool_choice")
    ids = settings.tokenizer.encode(text + forced)
    limit = field(body, "max_output_tokens", int, None)
    echo = {"instructions": field(body, "instructions", str, None), "tools": sent_tools,
            "tool_choice": body.get("tool_choice") or "auto", "parallel_tool_calls": parallel,
            "max_output_tokens": limit, "reasoning": reasoning, "metadata": field(body, "metadata", dict, {}),
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "previous_response_id": None}
    return ResponsesRequest(
        ids, max_tokens(limit, len(ids), settings, "max_output_tokens"),
        stops=(CALL_CLOSE,) if parsed and not parallel else (),  # one call: the reply ends where it closes
        stream=field(body, "stream", bool, False), history=next_turn_prefix(settings, messages, ids, thinking, tools),
        sampling=sampling(body, settings, MAX_TEMPERATURE),
        tools={t["function"]["name"]: t["function"].get("parameters") or {} for t in tools} if parsed else None,
        reasoning=opened, forced=forced, echo=echo)


class Parts(NamedTuple):
    """A reply split into what its output items show."""

    thought: str  # the reasoning, stripped ("" without a think block)
    closed: bool  # the think block was closed (or there was none)
    content: str  # the answer: the text after the think block, less the calls
    calls: list[ToolCall]


def _held(text: str, tag: str) -> str:
    """The text less its longest ending that may be the start of `tag` (which the next piece may complete)."""
    return next((text[:-k] for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), text)


def split(text: str, request: ResponsesRequest, final: bool) -> Parts:
    """The parts of a reply's text: of the whole reply when `final`, else of the text so far, less what more text
    could change (a possible tag's start, whitespace that may be stripped, a call not yet complete); each part so far
    is the start of the final one. No calls until final."""
    thought, closed = "", True
    if request.reasoning:
        thought, close, text = text.partition(THINK_CLOSE)
        closed = bool(close)
        if not closed:
            return Parts((thought if final else _held(thought, THINK_CLOSE).rstrip()).strip(), False, "", [])
        thought, text = thought.strip(), text.lstrip()
    if request.tools is None:
        return Parts(thought, closed, text, [])
    if final:
        return Parts(thought, closed, *parse(text, request.tools))
    at = text.find(CALL_OPEN)
    return Parts(thought, closed, (text[:at] if at >= 0 else _held(text, CALL_OPEN)).rstrip(), [])


def reply_text(request: ResponsesRequest, outcome: Outcome, text: str) -> str:
    """What the model wrote: a forced call's start, the generated text, and the call's end that stopped it."""
    return request.forced + text + (outcome.matched or "")


def _usage(request: ResponsesRequest, outcome: Outcome, text: str, settings: Settings) -> dict[str, Any]:
    """Token counts; the reasoning's by encoding its text again, up to and including `</think>` (all of the reply
    when it never closed)."""
    n, c = len(request.ids), outcome.completion_tokens
    reasoning = 0
    if request.reasoning:
        head, close, _ = text.partition(THINK_CLOSE)
        reasoning = min(len(settings.tokenizer.encode(head + close)), c) if close else c
    counts = {"input_tokens": n, "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
              "output_tokens": c, "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": n + c}
    return counts if request.sampling.greedy else {**counts, "seed": request.sampling.seed}


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [] if text is None else [_output_text(text)]}


def _call_item(call: ToolCall) -> dict[str, Any]:
    return {"type": "function_call", "id": new_id("fc_"), "call_id": new_id("call_"), "name": call.name,
            "arguments": arguments_json(call), "status": "completed"}


def _status(outcome: Outcome) -> str:
    return "incomplete" if outcome.finish == "length" else "completed"


def _response(request: ResponsesRequest, settings: Settings, response_id: str, created: int, status: str,
              output: list[dict], usage: dict | None = None) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": settings.model, "output": output, "usage": usage, "temperature": request.sampling.temperature,
            "top_p": request.sampling.top_p, **request.echo}


def response_object(jobs: Sequence[Job], texts: Sequence[str], settings: Settings) -> dict[str, Any]:
    """The response object: a reasoning item (if the reply reasoned), a message (unless the reply is only calls or
    never left its reasoning), a function_call item per call."""
    (job,), (text,) = jobs, texts  # one choice: the Responses API has no n
    request, status = job.request, _status(job.outcome)
    text = reply_text(request, job.outcome, text)
    parts = split(text, request, final=True)
    output = [_reasoning_item(new_id("rs_"), parts.thought, "completed" if parts.closed else "incomplete")
              ] if parts.thought else []
    if parts.content or (parts.closed and not parts.calls):
        output.append(_message_item(new_id("msg_"), parts.content, status))
    output += [_call_item(call) for call in parts.calls]
    return _response(request, settings, new_id("resp_"), now(), status, output,
                     _usage(request, job.outcome, text, settings))


class _Events:
    """A response's stream events, numbered, and the output items it has opened and finished."""

    def __init__(self, request: ResponsesRequest, settings: Settings):
        self.request, self.settings = request, settings
        self.id, self.created, self.sequence = new_id("resp_"), now(), 0
        self.done: list[dict] = []  # finished output items, in order
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.shown = Parts("", True, "", [])  # the reasoning and answer text sent so far

    def event(self, kind: str, **fields: Any) -> str:
        self.sequence += 1
        return sse({"type": kind, "sequence_number": self.sequence - 1, **fields}, kind)

    def lifecycle(self, kind: str, status: str, usage: dict | None = None) -> str:
        return self.event(kind, response=_response(self.request, self.settings, self.id, self.created, status,
                                                   self.done, usage))

    def _place(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.done)}

    def start(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[str]:
        """An output item's opening events (and its content part's)."""
        self.open = item
        events = [self.event("response.output_item.added", output_index=len(self.done), item=item)]
        if part is not None:
            events.append(self.event("response.content_part.added", **self._place(), content_index=0, part=part))
        return events

    def finish(self, item: dict[str, Any], done: str | None = None, part: dict[str, Any] | None = None) -> list[str]:
        """The open item's closing events: its text's `done` event and its part's, then the item, finished."""
        events = []
        if done is not None:
            text = part["text"]
            events.append(self.event(done, **self._place(), content_index=0, text=text,
                                     **({"logprobs": []} if part["type"] == "output_text" else {})))
            events.append(self.event("response.content_part.done", **self._place(), content_index=0, part=part))
        events.append(self.event("response.output_item.done", output_index=len(self.done), item=item))
        self.done.append(item)
        self.open = None
        return events

    def _close_reasoning(self, closed: bool) -> list[str]:
        text = self.shown.thought
        return self.finish(_reasoning_item(self.open["id"], text, "completed" if closed else "incomplete"),
                           "response.reasoning_text.done", {"type": "reasoning_text", "text": text})

    def show(self, parts: Parts) -> list[str]:
        """Events for the text of `parts` not sent yet: reasoning deltas, then (the reasoning item closed) text
        deltas."""
        events = []
        if len(parts.thought) > len(self.shown.thought):
            if self.open is None:
                events += self.start(_reasoning_item(new_id("rs_"), None, "in_progress"),
                                     {"type": "reasoning_text", "text": ""})
            events.append(self.event("response.reasoning_text.delta", **self._place(), content_index=0,
                                     delta=parts.thought[len(self.shown.thought):]))
            self.shown = self.shown._replace(thought=parts.thought)
        if len(parts.content) > len(self.shown.content):
            if self.open is not None and self.open["type"] == "reasoning":
                events += self._close_reasoning(True)
            if self.open is None:
                events += self.start(_message_item(new_id("msg_"), None, "in_progress"), _output_text(""))
            events.append(self.event("response.output_text.delta", **self._place(), content_index=0,
                                     delta=parts.content[len(self.shown.content):], logprobs=[]))
            self.shown = self.shown._replace(content=parts.content)
        return events

    def end(self, parts: Parts, status: str) -> list[str]:
        """The rest of the reply: its last text, the open items closed, an empty message if it answered with neither
        text nor calls, each call as a function_call item."""
        events = self.show(parts)
        if self.open is not None and self.open["type"] == "reasoning":
            events += self._close_reasoning(parts.closed)
        if self.open is None and parts.closed and not parts.calls:  # no message was opened: an empty one
            events += self.start(_message_item(new_id("msg_"), None, "in_progress"), _output_text(""))
        if self.open is not None:
            text = self.shown.content
            events += self.finish(_message_item(self.open["id"], text, status), "response.output_text.done",
                                  _output_text(text))
        for call in parts.calls:
            item = _call_item(call)
            events += self.start({**item, "arguments": "", "status": "in_progress"}, None)
            events.append(self.event("response.function_call_arguments.delta", **self._place(),
                                     delta=item["arguments"]))
            events.append(self.event("response.function_call_arguments.done", **self._place(),
                                     arguments=item["arguments"]))
            events += self.finish(item)
        return events


async def response_stream(job: Job, settings: Settings) -> AsyncIterator[str]:
    """response.created and .in_progress; each output item's added, content part, deltas, done events; then
    response.completed (response.incomplete when max_output_tokens ended it)."""
    request = job.request
    events = _Events(request, settings)
    yield events.lifecycle("response.created", "in_progress")
    yield events.lifecycle("response.in_progress", "in_progress")
    generated = ""
    async for piece in job.pieces():  # a failure ends the stream with an error event (app._guarded_events)
        generated += piece
        for event in events.show(split(request.forced + generated, request, final=False)):
            yield event
    text = reply_text(request, job.outcome, generated)
    status = _status(job.outcome)
    for event in events.end(split(text, request, final=True), status):
        yield event
    yield events.lifecycle(f"response.{status}", status, _usage(request, job.outcome, text, settings))
