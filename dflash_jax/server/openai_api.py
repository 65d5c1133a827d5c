"""The OpenAI API: /v1/chat/completions and /v1/completions requests, their responses and stream chunks."""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Callable, Sequence

from dflash_jax.server.request import (BadRequest, GenRequest, Settings, call_arguments, chat_prompt, check_function,
                                       check_template, count, field, max_tokens, next_turn_prefix, refuse, sampling,
                                       stop_strings, text_of)
from dflash_jax.server.tool_calls import arguments_json, parse
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


def _request(body: dict, ids: list[int], settings: Settings, limit_names: tuple[str, ...],
             history: int = 0) -> GenRequest:
    name = next((n for n in limit_names if body.get(n) is not None), limit_names[-1])
    limit = field(body, name, int, None)
    options = field(body, "stream_options", dict, {})
    return GenRequest(ids, max_tokens(limit, len(ids), settings, name), stop_strings(body, "stop"),
                      field(body, "stream", bool, False), bool(options.get("include_usage")), history=history,
                      sampling=sampling(body, settings, MAX_TEMPERATURE), n=count(body))


def _tools(body: dict) -> list[dict]:
    """The request's `tools`, checked: functions with distinct names and an object schema of parameters."""
    tools, names = field(body, "tools", list, []), set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise BadRequest(f"{where} must be an object of type 'function' with a 'function' object", "tools")
        check_function(tool["function"], f"{where}.function", names)
    return tools


def _parses_calls(body: dict, tools: list[dict]) -> bool:
    """Whether the reply is parsed for tool calls: with tools and tool_choice 'auto' (the default); 'none' renders
    the tools but leaves the reply as text, as vLLM does; 'required' and a named function are refused."""
    choice = field(body, "tool_choice", (str, dict), "auto")
    if choice == "required" or isinstance(choice, dict):
        raise BadRequest("tool_choice 'required' and a named function are not implemented yet (send 'auto' or "
                         "'none')", "tool_choice")
    if choice not in ("auto", "none"):
        raise BadRequest(f"'tool_choice' must be 'auto', 'none', 'required' or a named function, got {choice!r}",
                         "tool_choice")
    if not field(body, "parallel_tool_calls", bool, True):
        raise BadRequest("parallel_tool_calls false is not implemented (the model may make several calls)",
                         "parallel_tool_calls")
    parsed = choice == "auto" and bool(tools)
    if parsed and field(body, "stream", bool, False):
        raise BadRequest("streaming a reply that may call tools is not implemented yet (send stream false, or "
                         "tool_choice 'none')", "stream")
    return parsed


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
    parsed = _parses_calls(body, tools)
    messages = [_message(m, f"messages[{i}]") for i, m in enumerate(field(body, "messages", list))]
    if not messages:
        raise BadRequest("'messages' must not be empty", "messages")
    check_template(settings, tools, messages, "messages")
    if "tool_calls" in messages[-1]:
        raise BadRequest("the last message makes tool calls: send their results (role 'tool') after it", "messages")
    kwargs = field(body, "chat_template_kwargs", dict, {})
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise BadRequest("chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs")
    ids = chat_prompt(settings, messages, thinking, tools)
    request = _request(body, ids, settings, ("max_completion_tokens", "max_tokens"),
                       next_turn_prefix(settings, messages, ids, thinking, tools))
    if not parsed:
        return request
    return dataclasses.replace(request, tools={t["function"]["name"]: t["function"].get("parameters", {})
                                               for t in tools})


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


def _chat_choice_of(index: int, job: Job, text: str) -> dict[str, Any]:
    """One choice of a chat completion: the reply's text, or, when it calls offered tools, the text before the calls
    (null if none) and the calls, finished by `tool_calls`."""
    content, calls = parse(text, job.request.tools) if job.request.tools else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message = {"role": "assistant", "content": content or None,
                   "tool_calls": [{"id": new_id("call_"), "type": "function",
                                   "function": {"name": c.name, "arguments": arguments_json(c)}} for c in calls]}
    return {"index": index, "message": message, "logprobs": None,
            "finish_reason": "tool_calls" if calls else FINISH[job.outcome.finish]}


def chat_response(jobs: Sequence[Job], texts: Sequence[str], settings: Settings) -> dict[str, Any]:
    return {"id": new_id("chatcmpl-"), "object": "chat.completion", "created": now(), "model": settings.model,
            "choices": [_chat_choice_of(i, job, text) for i, (job, text) in enumerate(zip(jobs, texts))],
            "usage": usage(jobs[0].request, [job.outcome for job in jobs])}


def completion_response(jobs: Sequence[Job], texts: Sequence[str], settings: Settings) -> dict[str, Any]:
    return {"id": new_id("cmpl-"), "object": "text_completion", "created": now(), "model": settings.model,
            "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": FINISH[job.outcome.finish]}
                        for i, (job, text) in enumerate(zip(jobs, texts))],
            "usage": usage(jobs[0].request, [job.outcome for job in jobs])}


def _chat_choice(text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
    delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


def _completion_choice(text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
    return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}


async def _stream(job: Job, settings: Settings, kind: str, choice: Callable[..., dict]) -> AsyncIterator[str]:
    head = {"id": new_id("chatcmpl-" if kind == "chat.completion.chunk" else "cmpl-"), "object": kind,
            "created": now(), "model": settings.model}
    if kind == "chat.completion.chunk":
        yield sse({**head, "choices": [choice(None, None, first=True)]})
    async for piece in job.pieces():  # a failure ends the stream with an error event (app._guarded_events)
        yield sse({**head, "choices": [choice(piece, None)]})
    yield sse({**head, "choices": [choice(None, FINISH[job.outcome.finish])]})
    if job.request.include_usage:
        yield sse({**head, "choices": [], "usage": usage(job.request, [job.outcome])})
    yield sse("[DONE]")


def chat_stream(job: Job, settings: Settings) -> AsyncIterator[str]:
    """chat.completion.chunk events: the role, a content delta per piece of text, the finish reason, [DONE]."""
    return _stream(job, settings, "chat.completion.chunk", _chat_choice)


def completion_stream(job: Job, settings: Settings) -> AsyncIterator[str]:
    """text_completion events: a text piece each, then the finish reason, then [DONE]."""
    return _stream(job, settings, "text_completion", _completion_choice)
