"""The Anthropic Messages API: /v1/messages (and count_tokens) requests, responses and stream events."""

from __future__ import annotations

from typing import Any, AsyncIterator, Sequence

from dflash_jax.server.request import (BadRequest, GenRequest, Settings, chat_prompt, conversation_prefix, field,
                                       max_tokens, next_turn_prefix, refuse, sampling, stop_strings, text_of)
from dflash_jax.server.wire import new_id, sse
from dflash_jax.server.worker import Job

UNSUPPORTED = {"tools": "tool use is not implemented", "mcp_servers": "tool use is not implemented"}
STOP_REASON = {"stop_token": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens"}
MAX_TEMPERATURE = 1.0  # Anthropic's range of temperature


def _messages(body: dict) -> list[dict]:
    """The chat messages of a Messages body: system (a string or text blocks) and user/assistant turns."""
    refuse(body, UNSUPPORTED)
    thinking = field(body, "thinking", dict, {})
    if thinking.get("type", "disabled") != "disabled":
        raise BadRequest("extended thinking is not implemented (send thinking {\"type\": \"disabled\"} or leave it "
                         "out)", "thinking")
    system = field(body, "system", (str, list), "")
    messages = [{"role": "system", "content": text_of(system, "system")}] if system else []
    for i, m in enumerate(field(body, "messages", list)):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadRequest(f"{where} must be an object with role 'user' or 'assistant'", "messages")
        if m.get("content") is None:
            raise BadRequest(f"{where}.content is required", "messages")
        messages.append({"role": m["role"], "content": text_of(m["content"], where)})
    if len(messages) == (1 if system else 0):
        raise BadRequest("'messages' must not be empty", "messages")
    return messages


def prompt_ids(body: dict, settings: Settings) -> list[int]:
    """The prompt of a Messages body: its messages through the chat template."""
    return chat_prompt(settings, _messages(body))


def parse_messages(body: dict, settings: Settings) -> GenRequest:
    """A /v1/messages body as a generation request; a last assistant message is continued (prefill)."""
    sampled = sampling(body, settings, MAX_TEMPERATURE)
    messages = _messages(body)
    ids = chat_prompt(settings, messages)
    limit = max_tokens(field(body, "max_tokens", int), len(ids), settings)
    return GenRequest(ids, limit, stop_strings(body, "stop_sequences"), field(body, "stream", bool, False),
                      history=next_turn_prefix(settings, messages, ids),
                      shared=conversation_prefix(settings, messages, ids), sampling=sampled)


def _usage(job: Job) -> dict[str, int]:
    cached = job.outcome.cached_tokens
    return {"input_tokens": len(job.request.ids) - cached, "output_tokens": job.outcome.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _message(message_id: str, settings: Settings, content: list, stop_reason: str | None,
             stop_sequence: str | None, usage: dict[str, int]) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": settings.model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


def message_response(jobs: Sequence[Job], texts: Sequence[str], settings: Settings) -> dict[str, Any]:
    (job,), (text,) = jobs, texts  # one choice: the Messages API has no n
    return _message(new_id("msg_"), settings, [{"type": "text", "text": text}], STOP_REASON[job.outcome.finish],
                    job.outcome.matched, _usage(job))


async def message_stream(job: Job, settings: Settings) -> AsyncIterator[str]:
    """message_start, content_block_start, a text_delta per piece, content_block_stop, message_delta, message_stop."""
    start = _message(new_id("msg_"), settings, [], None, None,
                     {"input_tokens": len(job.request.ids), "output_tokens": 0})
    yield sse({"type": "message_start", "message": start}, "message_start")
    yield sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
              "content_block_start")
    async for piece in job.pieces():  # a failure ends the stream with an error event (app._guarded_events)
        yield sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}},
                  "content_block_delta")
    yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
    delta = {"stop_reason": STOP_REASON[job.outcome.finish], "stop_sequence": job.outcome.matched}
    yield sse({"type": "message_delta", "delta": delta, "usage": _usage(job)}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")
