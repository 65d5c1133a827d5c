"""The OpenAI API: /v1/chat/completions and /v1/completions requests, their responses and stream chunks."""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Sequence

from dflash_jax.server import reply
from dflash_jax.server.request import (EFFORT, BadRequest, GenRequest, Settings, count, field, max_tokens, refuse,
                                       sampling, stop_strings, text_of, think_budget)
from dflash_jax.server.tool_calls import ToolCall, argument_pieces, arguments_json
from dflash_jax.server.tool_use import (ToolUse, call_arguments, check_template, function_tool, openai_tool_use,
                                        reply_prompt)
from dflash_jax.server.wire import new_id, now, sse
from dflash_jax.server.worker import Job, Outcome

UNSUPPORTED = {"functions": "the deprecated function calls are not implemented (send 'tools')",
               "function_call": "the deprecated function calls are not implemented (send 'tool_choice')",
               "logprobs": "log probabilities are not implemented",
               "top_logprobs": "log probabilities are not implemented", "audio": "only text output is supported"}
COMPLETION_UNSUPPORTED = {"echo": "echoing the prompt is not implemented", "suffix": "insertion is not implemented",
                          "logprobs": "log probabilities are not implemented"}
FINISH = {"stop_token": "stop", "stop_sequence": "stop", "length": "length"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


MAX_TEMPERATURE = 2.0  # OpenAI's range of temperature


def _common(body: dict) -> None:
    fmt = field(body, "response_format", dict, {"type": "text"})
    if fmt.get("type") != "text":
        raise BadRequest(f"response_format {fmt.get('type')!r} is not supported (only text)", "response_format")


def _request(body: dict, ids: list[int], settings: Settings, limit_names: tuple[str, ...]) -> GenRequest:
    name = next((n for n in limit_names if body.get(n) is not None), limit_names[-1])
    limit = field(body, name, int, None)
    options = field(body, "stream_options", dict, {})
    return GenRequest(ids, max_tokens(limit, len(ids), settings, name), stop_strings(body, "stop"),
                      field(body, "stream", bool, False), bool(options.get("include_usage")),
                      sampling=sampling(body, settings, MAX_TEMPERATURE), n=count(body))


def _tools(body: dict) -> list[dict]:
    """The request's `tools`, checked (`function_tool`): functions with distinct names and an object schema of
    parameters."""
    tools, names = [], set()
    for i, tool in enumerate(field(body, "tools", list, [])):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise BadRequest(f"{where} must be an object of type 'function' with a 'function' object", "tools")
        tools.append(function_tool(tool["function"], f"{where}.function", names))
    return tools


def _named(choice: dict) -> Any:
    """The function a tool_choice object names: {"type": "function", "function": {"name": ...}} (None otherwise)."""
    function = choice.get("function")
    return function.get("name") if choice.get("type") == "function" and isinstance(function, dict) else None


def _thinking(body: dict, use: ToolUse) -> tuple[bool | None, int | None]:
    """(thinking, budget) a request asks for: chat_template_kwargs.enable_thinking (None: the server's), and
    reasoning_effort, which turns thinking on with its token budget."""
    kwargs = field(body, "chat_template_kwargs", dict, {})
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise BadRequest("chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs")
    effort = field(body, "reasoning_effort", str, None)
    if effort is not None:
        if effort not in EFFORT:
            raise BadRequest(f"'reasoning_effort' must be one of {', '.join(EFFORT)}, got {effort!r}",
                             "reasoning_effort")
        if thinking is False:
            raise BadRequest("'reasoning_effort' turns thinking on, which chat_template_kwargs.enable_thinking false "
                             "turns off", "reasoning_effort")
        thinking = True
    if use.forced and thinking:
        raise BadRequest("a tool_choice that forces a call starts the reply with it, so thinking cannot be on (leave "
                         "out reasoning_effort and enable_thinking)", "tool_choice")
    return thinking, EFFORT.get(effort)


def _past_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls` as the template reads them: the arguments a JSON object, not a string."""
    if not isinstance(calls, list):
        raise BadRequest(f"{where}.tool_calls must be an array", "messages")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest(f"{at}.function must be an object with a name", "messages")
        arguments = call_arguments(function.get("arguments", "{}"), f"{at}.function", "messages")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def _message(m: Any, where: str) -> dict:
    """One chat message as the template reads it: role, text content, and an assistant's tool calls or a tool
    result's call id."""
    if not isinstance(m, dict):
        raise BadRequest(f"{where} must be an object", "messages")
    role, calls = m.get("role"), m.get("tool_calls")
    if role not in ROLES:
        raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}"
                         + (" (the deprecated 'function' role is not implemented: send 'tool')"
                            if role == "function" else ""), "messages")
    if calls and role != "assistant":
        raise BadRequest(f"{where}.tool_calls: only an assistant message makes tool calls", "messages")
    if m.get("content") is None and not calls:
        raise BadRequest(f"{where}.content is required", "messages")
    message = {"role": ROLES[role], "content": "" if m.get("content") is None else text_of(m["content"], where)}
    if role == "assistant" and m.get("reasoning_content") is not None:
        if not isinstance(m["reasoning_content"], str):
            raise BadRequest(f"{where}.reasoning_content must be a string", "messages")
        message["reasoning_content"] = m["reasoning_content"]  # the template writes it back as the think block
    if calls:
        message["tool_calls"] = _past_calls(calls, where)
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise BadRequest(f"{where}.tool_call_id must be a string (the id of the call this answers)", "messages")
        message["tool_call_id"] = m["tool_call_id"]
    return message


def parse_chat(body: dict, settings: Settings) -> GenRequest:
    """A /v1/chat/completions body as a generation request (400 for anything the server cannot honour)."""
    refuse(body, UNSUPPORTED)
    _common(body)
    tools = _tools(body)
    use = openai_tool_use(body, tools, _named, "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    messages = [_message(m, f"messages[{i}]") for i, m in enumerate(field(body, "messages", list))]
    if not messages:
        raise BadRequest("'messages' must not be empty", "messages")
    check_template(settings, tools, messages)
    thinking, budget = _thinking(body, use)
    prompt = reply_prompt(settings, messages, thinking, tools, use)
    request = _request(body, prompt.ids, settings, ("max_completion_tokens", "max_tokens"))
    return dataclasses.replace(request, reasoning_budget=think_budget(settings, budget, prompt.thinks),
                               **prompt.fields(), **use.fields())


def parse_completion(body: dict, settings: Settings) -> GenRequest:
    """A /v1/completions body (one prompt: text, or token ids) as a generation request."""
    refuse(body, COMPLETION_UNSUPPORTED)
    _common(body)
    prompt = field(body, "prompt", (str, list))
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = settings.tokenizer.encode(prompt)
    elif prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < settings.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary (0..{settings.vocab_size - 1})", "prompt")
        ids = list(prompt)
    else:
        raise BadRequest("'prompt' must be a string or an array of token ids (one prompt per request)", "prompt")
    if not ids:
        raise BadRequest("'prompt' is empty", "prompt")
    return _request(body, ids, settings, ("max_tokens",))


def usage(request: GenRequest, outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Token counts: the prompt once, the completions of every choice summed, and the seed of a sampled request."""
    n, c = len(request.ids), sum(o.completion_tokens for o in outcomes)
    counts = {"prompt_tokens": n, "completion_tokens": c, "total_tokens": n + c,
              "prompt_tokens_details": {"cached_tokens": outcomes[0].cached_tokens}}
    return counts if request.sampling.greedy else {**counts, "seed": request.sampling.seed}


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": new_id("call_"), "type": "function",
            "function": {"name": call.name, "arguments": arguments_json(call)}}


def _chat_choice_of(index: int, job: Job, text: str) -> dict[str, Any]:
    """One choice of a chat completion: the answer as content, the think block as reasoning_content, and, when the
    reply calls offered tools, the calls, finished by `tool_calls` (content is then null if empty)."""
    read = reply.read(text, job.request)
    content = read.content + read.tail
    message: dict[str, Any] = {"role": "assistant", "content": (content or None) if read.calls else content}
    if read.reasoning:
        message["reasoning_content"] = read.reasoning
    if read.calls:
        message["tool_calls"] = [_tool_call(c) for c in read.calls]
    return {"index": index, "message": message, "logprobs": None,
            "finish_reason": "tool_calls" if read.calls else FINISH[job.outcome.finish]}


def chat_response(jobs: Sequence[Job], texts: Sequence[str], settings: Settings) -> dict[str, Any]:
    return {"id": new_id("chatcmpl-"), "object": "chat.completion", "created": now(), "model": settings.model,
            "choices": [_chat_choice_of(i, job, text) for i, (job, text) in enumerate(zip(jobs, texts))],
            "usage": usage(jobs[0].request, [job.outcome for job in jobs])}


def completion_response(jobs: Sequence[Job], texts: Sequence[str], settings: Settings) -> dict[str, Any]:
    return {"id": new_id("cmpl-"), "object": "text_completion", "created": now(), "model": settings.model,
            "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": FINISH[job.outcome.finish]}
                        for i, (job, text) in enumerate(zip(jobs, texts))],
            "usage": usage(jobs[0].request, [job.outcome for job in jobs])}


def _delta(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


def _text(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def _deltas(event: reply.Event) -> list[dict[str, Any]]:
    """The chunk deltas of a reply event: reasoning_content, content, or a tool call: its id and name (arguments
    empty), then the arguments JSON in pieces (`argument_pieces`) that join into it."""
    if isinstance(event, reply.Reasoning):
        return [{"reasoning_content": event.text}]
    if isinstance(event, reply.Content):
        return [{"content": event.text}]
    call = _tool_call(event.call)
    call["function"]["arguments"] = ""
    return [{"tool_calls": [{"index": event.index, **call}]}] + [
        {"tool_calls": [{"index": event.index, "function": {"arguments": piece}}]}
        for piece in argument_pieces(event.call)]


def _head(kind: str, settings: Settings) -> dict[str, Any]:
    return {"id": new_id("chatcmpl-" if kind == "chat.completion.chunk" else "cmpl-"), "object": kind,
            "created": now(), "model": settings.model}


def _ending(job: Job, head: dict[str, Any], last: dict[str, Any]) -> list[str]:
    """The chunk with the finish reason, the usage chunk if asked for, and [DONE]."""
    usage_chunk = [sse({**head, "choices": [], "usage": usage(job.request, [job.outcome])})]
    return [sse({**head, "choices": [last]})] + (usage_chunk if job.request.include_usage else []) + [sse("[DONE]")]


async def chat_stream(job: Job, settings: Settings) -> AsyncIterator[str]:
    """chat.completion.chunk events: the role, then a delta per reply event (`_deltas`), the finish reason
    (`tool_calls` when the reply called tools), [DONE]."""
    head = _head("chat.completion.chunk", settings)
    yield sse({**head, "choices": [_delta({"role": "assistant", "content": ""})]})
    called = False
    # a failure ends the stream with an error event (app._guarded_events)
    async for event in reply.events(job.pieces(), job.request):
        called = called or isinstance(event, reply.Call)
        for delta in _deltas(event):
            yield sse({**head, "choices": [_delta(delta)]})
    for chunk in _ending(job, head, _delta({}, "tool_calls" if called else FINISH[job.outcome.finish])):
        yield chunk


async def completion_stream(job: Job, settings: Settings) -> AsyncIterator[str]:
    """text_completion events: a text piece each, then the finish reason, then [DONE]."""
    head = _head("text_completion", settings)
    async for piece in job.pieces():
        yield sse({**head, "choices": [_text(piece)]})
    for chunk in _ending(job, head, _text("", FINISH[job.outcome.finish])):
        yield chunk
