"""The OpenAI Responses API: /v1/responses requests, responses and stream events (issue 44, item 3).

A request is rendered by the chat template as the equivalent chat (`responses_input`), its tools and tool choice
handled as chat completions handles them (server/tool_use.py). Its reply is read by server/reply.py, as chat replies
are, into output items: the think block as a `reasoning` item, the answer as a `message`, each call as a
`function_call` item, and text after the calls as a second `message`. A stream sends the same items, its text as it
comes and each call once it is complete."""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Mapping, Sequence

from dflash_jax.server import reply
from dflash_jax.server.reply import THINK_CLOSE
from dflash_jax.server.request import (EFFORT, BadRequest, GenRequest, Settings, field, max_tokens, refuse, sampling,
                                       think_budget)
from dflash_jax.server.responses_input import input_messages
from dflash_jax.server.tool_calls import ToolCall, argument_pieces, arguments_json
from dflash_jax.server.tool_use import check_template, function_tool, openai_tool_use, reply_prompt
from dflash_jax.server.wire import ERROR_TYPES, new_id, now, sse
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


@dataclasses.dataclass(frozen=True)
class ResponsesRequest(GenRequest):
    """A generation request of the Responses API, with the request fields its response repeats."""

    echo: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _tools(body: dict) -> tuple[list[dict], list[dict]]:
    """(as sent, as the template reads them) of the request's function tools (the flat Responses shape
    `{"type": "function", "name", "description", "parameters"}` becomes chat's `{"type", "function": {...}}`)."""
    tools, names, rendered = field(body, "tools", list, []), set(), []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise BadRequest(f"tools[{i}] is of type {kind!r}: only function tools are supported", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        rendered.append(function_tool(function, f"tools[{i}]", names))
    return tools, rendered


def _named(choice: dict) -> Any:
    """The function a tool_choice object names: {"type": "function", "name": ...} (None otherwise)."""
    return choice.get("name") if choice.get("type") == "function" else None


def _reasoning(body: dict) -> tuple[bool | None, int | None, dict]:
    """(thinking on or off, None for the server's default; its token budget; the `reasoning` the response repeats):
    effort 'none' turns the chat template's thinking off, any other effort on, low, medium and high with chat's
    reasoning_effort budgets (`request.EFFORT`); a summary is accepted (none is written)."""
    reasoning = field(body, "reasoning", dict, {})
    other = [k for k, v in reasoning.items() if k not in ("effort", "summary", "generate_summary") and v is not None]
    if other:
        raise BadRequest(f"reasoning.{other[0]} is not supported (send effort and summary)", "reasoning")
    effort, summary = reasoning.get("effort"), reasoning.get("summary") or reasoning.get("generate_summary")
    if effort is not None and effort not in EFFORTS:
        raise BadRequest(f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {effort!r}", "reasoning")
    if summary is not None and summary not in SUMMARIES:
        raise BadRequest(f"reasoning.summary must be one of {', '.join(SUMMARIES)}, got {summary!r}", "reasoning")
    return (None if effort is None else effort != "none"), EFFORT.get(effort), {"effort": effort, "summary": summary}


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
    use = openai_tool_use(body, tools, _named, "{\"type\": \"function\", \"name\": ...} (allowed tools and "
                          "built-in tools are not supported)")
    thinking, budget, reasoning = _reasoning(body)
    if use.forced and thinking:
        raise BadRequest("a tool_choice that forces a call starts the reply with it, so thinking cannot be on (send "
                         "reasoning.effort 'none' or leave it out)", "tool_choice")
    messages = input_messages(body)
    check_template(settings, tools, messages, "input", "function_call_output items")
    prompt = reply_prompt(settings, messages, thinking, tools, use, "input")
    limit = field(body, "max_output_tokens", int, None)
    echo = {"instructions": field(body, "instructions", str, None), "tools": sent_tools,
            "tool_choice": body.get("tool_choice") or "auto", "parallel_tool_calls": not use.single,
            "max_output_tokens": limit, "reasoning": reasoning, "metadata": field(body, "metadata", dict, {}),
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "previous_response_id": None}
    return ResponsesRequest(prompt.ids, max_tokens(limit, len(prompt.ids), settings, "max_output_tokens"),
                            stream=field(body, "stream", bool, False), echo=echo,
                            sampling=sampling(body, settings, MAX_TEMPERATURE),
                            reasoning_budget=think_budget(settings, budget, prompt.thinks), **prompt.fields(),
                            **use.fields())


def _closed(request: GenRequest, text: str) -> bool:
    """Whether a reply's think block was closed (or it had none): its text is the forced prefix and the generated."""
    return not request.thinks or THINK_CLOSE in text


def _usage(request: ResponsesRequest, outcome: Outcome, text: str, settings: Settings) -> dict[str, Any]:
    """Token counts; the reasoning's by encoding its text again, up to and including `</think>` (all of the reply
    when it never closed)."""
    n, c = len(request.ids), outcome.completion_tokens
    reasoning = 0
    if request.thinks:
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
              output: list[dict], usage: dict | None = None, error: dict | None = None) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "created_at": created, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": settings.model, "output": output, "usage": usage, "temperature": request.sampling.temperature,
            "top_p": request.sampling.top_p, **request.echo}


def _output(read: reply.Reply, closed: bool, status: str) -> list[dict[str, Any]]:
    """A whole reply's output items: a reasoning item (if it reasoned), a message (unless the reply is only calls or
    never left its reasoning), a function_call item per call, a message of the text after them. An item that another
    follows is completed; the last one has the response's status."""
    output = [_reasoning_item(new_id("rs_"), read.reasoning, "completed" if closed else "incomplete")
              ] if read.reasoning else []
    if read.content or (closed and not read.calls):
        output.append(_message_item(new_id("msg_"), read.content, "completed" if read.calls else status))
    output += [_call_item(call) for call in read.calls]
    return output + ([_message_item(new_id("msg_"), read.tail, status)] if read.tail else [])


def response_object(jobs: Sequence[Job], texts: Sequence[str], settings: Settings) -> dict[str, Any]:
    """The response object of a finished reply (`_output`)."""
    (job,), (text,) = jobs, texts  # one choice: the Responses API has no n
    request, status = job.request, _status(job.outcome)
    output = _output(reply.read(text, request), _closed(request, request.prefix + text), status)
    return _response(request, settings, new_id("resp_"), now(), status, output,
                     _usage(request, job.outcome, request.prefix + text, settings))


class _Events:
    """A response's stream events, numbered, and the output items it has opened and finished."""

    def __init__(self, request: ResponsesRequest, settings: Settings):
        self.request, self.settings = request, settings
        self.id, self.created, self.sequence = new_id("resp_"), now(), 0
        self.done: list[dict] = []  # finished output items, in order
        self.open: dict[str, Any] | None = None  # the reasoning or message item being streamed
        self.text = ""  # its text sent so far

    def event(self, kind: str, **fields: Any) -> str:
        self.sequence += 1
        return sse({"type": kind, "sequence_number": self.sequence - 1, **fields}, kind)

    def lifecycle(self, kind: str, status: str, usage: dict | None = None, error: dict | None = None) -> str:
        return self.event(kind, response=_response(self.request, self.settings, self.id, self.created, status,
                                                   self.done, usage, error))

    def _place(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.done)}

    def _start(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[str]:
        """An output item's opening events (and its content part's)."""
        self.open = item
        events = [self.event("response.output_item.added", output_index=len(self.done), item=item)]
        if part is not None:
            events.append(self.event("response.content_part.added", **self._place(), content_index=0, part=part))
        return events

    def _finish(self, item: dict[str, Any], done: str | None = None, part: dict[str, Any] | None = None) -> list[str]:
        """The open item's closing events: its text's `done` event and its part's, then the item, finished."""
        events = []
        if done is not None:
            events.append(self.event(done, **self._place(), content_index=0, text=part["text"],
                                     **({"logprobs": []} if part["type"] == "output_text" else {})))
            events.append(self.event("response.content_part.done", **self._place(), content_index=0, part=part))
        events.append(self.event("response.output_item.done", output_index=len(self.done), item=item))
        self.done.append(item)
        self.open = None
        return events

    def _open_text(self, kind: str) -> list[str]:
        """A reasoning or message item opened, with its empty content part."""
        self.text = ""
        if kind == "reasoning":
            return self._start(_reasoning_item(new_id("rs_"), None, "in_progress"),
                               {"type": "reasoning_text", "text": ""})
        return self._start(_message_item(new_id("msg_"), None, "in_progress"), _output_text(""))

    def _close_text(self, status: str) -> list[str]:
        """The open reasoning or message item (if any) closed with its whole text."""
        if self.open is None:
            return []
        if self.open["type"] == "reasoning":
            return self._finish(_reasoning_item(self.open["id"], self.text, status), "response.reasoning_text.done",
                                {"type": "reasoning_text", "text": self.text})
        return self._finish(_message_item(self.open["id"], self.text, status), "response.output_text.done",
                            _output_text(self.text))

    def add(self, event: reply.Event) -> list[str]:
        """The events of a reply event: a text delta (in a new item when its kind changes), or a whole function_call
        item (the item before it completed)."""
        if isinstance(event, reply.Call):
            item = _call_item(event.call)
            events = self._close_text("completed") + self._start({**item, "arguments": "", "status": "in_progress"},
                                                                 None)
            events += [self.event("response.function_call_arguments.delta", **self._place(), delta=piece)
                       for piece in argument_pieces(event.call)]
            events.append(self.event("response.function_call_arguments.done", **self._place(),
                                     arguments=item["arguments"]))
            return events + self._finish(item)
        kind = "reasoning" if isinstance(event, reply.Reasoning) else "message"
        events = [] if self.open is not None and self.open["type"] == kind else (
            self._close_text("completed") + self._open_text(kind))
        self.text += event.text
        if kind == "reasoning":
            return events + [self.event("response.reasoning_text.delta", **self._place(), content_index=0,
                                        delta=event.text)]
        return events + [self.event("response.output_text.delta", **self._place(), content_index=0, delta=event.text,
                                    logprobs=[])]

    def end(self, closed: bool, status: str) -> list[str]:
        """The open item closed (a reasoning item incomplete when its think block never closed); an empty message
        when the reply, its reasoning over, gave neither text nor calls (as `_output`)."""
        events = []
        if self.open is not None and self.open["type"] == "reasoning":
            events += self._close_text("completed" if closed else "incomplete")
        if closed and self.open is None and all(item["type"] == "reasoning" for item in self.done):
            events += self._open_text("message")
        return events + self._close_text(status)


class ResponseStream:
    """A response's stream: response.created and .in_progress; each output item's added, content part, deltas, done
    events (`_Events`); then response.completed (response.incomplete when max_output_tokens ended it), or, when the
    reply fails midway, response.failed (`failed`, which app._guarded_events sends) as the OpenAI API ends it."""

    def __init__(self, job: Job, settings: Settings):
        self.job, self.settings = job, settings
        self.events = _Events(job.request, settings)

    def __aiter__(self) -> AsyncIterator[str]:
        return self._stream()

    def failed(self, status: int, message: str) -> str:
        """The response.failed event that ends a stream whose reply raised (`status`, `message` as the error)."""
        return self.events.lifecycle("response.failed", "failed",
                                     error={"code": ERROR_TYPES.get(status, ERROR_TYPES[500])[0], "message": message})

    async def _stream(self) -> AsyncIterator[str]:
        request, events = self.job.request, self.events
        yield events.lifecycle("response.created", "in_progress")
        yield events.lifecycle("response.in_progress", "in_progress")
        generated = []

        async def pieces() -> AsyncIterator[str]:
            async for piece in self.job.pieces():
                generated.append(piece)
                yield piece

        async for event in reply.events(pieces(), request):
            for out in events.add(event):
                yield out
        text, status = request.prefix + "".join(generated), _status(self.job.outcome)
        for out in events.end(_closed(request, text), status):
            yield out
        yield events.lifecycle(f"response.{status}", status, _usage(request, self.job.outcome, text, self.settings))
