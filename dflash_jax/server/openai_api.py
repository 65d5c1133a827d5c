"""The OpenAI API: /v1/chat/completions and /v1/completions requests, their responses and stream chunks."""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Sequence

from dflash_jax.server.request import (BadRequest, GenRequest, Settings, chat_prompt, count, field, max_tokens,
                                       next_turn_prefix, refuse, sampling, stop_strings, text_of)
from dflash_jax.server.wire import new_id, now, sse
from dflash_jax.server.worker import Job, Outcome

UNSUPPORTED = {"tools": "tool calls are not implemented", "functions": "function calls are not implemented",
               "logprobs": "log probabilities are not implemented",
               "top_logprobs": "log probabilities are not implemented", "audio": "only text output is supported"}
COMPLETION_UNSUPPORTED = {"echo": "echoing the prompt is not implemented", "suffix": "insertion is not implemented",
                          "logprobs": "log probabilities are not implemented"}
FINISH = {"stop_token": "stop", "stop_sequence": "stop", "length": "length"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


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


def parse_chat(body: dict, settings: Settings) -> GenRequest:
    """A /v1/chat/completions body as a generation request (400 for anything the server cannot honour)."""
    refuse(body, UNSUPPORTED)
    _common(body)
    messages = []
    for i, m in enumerate(field(body, "messages", list)):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}"
                             + (" (tool calls are not implemented)" if role in ("tool", "function") else ""),
                             "messages")
        if m.get("tool_calls"):
            raise BadRequest(f"{where} has tool_calls: tool calls are not implemented", "messages")
        if m.get("content") is None:
            raise BadRequest(f"{where}.content is required", "messages")
        messages.append({"role": ROLES[role], "content": text_of(m["content"], where)})
    kwargs = field(body, "chat_template_kwargs", dict, {})
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise BadRequest("chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs")
    ids = chat_prompt(settings, messages, thinking)
    return _request(body, ids, settings, ("max_completion_tokens", "max_tokens"),
                    next_turn_prefix(settings, messages, ids, thinking))


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


def chat_response(jobs: Sequence[Job], texts: Sequence[str], settings: Settings) -> dict[str, Any]:
    return {"id": new_id("chatcmpl-"), "object": "chat.completion", "created": now(), "model": settings.model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": FINISH[job.outcome.finish]}
                        for i, (job, text) in enumerate(zip(jobs, texts))],
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
