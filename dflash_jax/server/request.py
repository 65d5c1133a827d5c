"""What every API's request becomes: checked fields, prompt ids and a token limit that fits the context."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from dflash_jax.chat_template import TemplateError
from dflash_jax.errors import InputError
from dflash_jax.tokenizer import Tokenizer

_MISSING = object()


class BadRequest(InputError):
    """A request the server refuses (HTTP 400 unless another status is given), naming the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclasses.dataclass(frozen=True)
class Settings:
    """The server's side of every request: the model, its context and what requests may ask for."""

    tokenizer: Tokenizer
    model: str  # the name /v1/models lists and responses carry
    max_ctx: int
    vocab_size: int  # the target's: token ids in a prompt must be below it
    default_max_tokens: int = 0  # for requests that give no limit; 0: the rest of the context
    thinking: bool = False  # the chat template's thinking block, unless a request says otherwise
    allow_greedy_fallback: bool = False  # run sampling requests greedily instead of refusing them


@dataclasses.dataclass(frozen=True)
class GenRequest:
    """One generation for the worker: the whole prompt's ids, at most max_tokens more, stop strings."""

    ids: list[int]
    max_tokens: int
    stops: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # OpenAI stream_options.include_usage: a last chunk with the token counts
    history: int = 0  # leading ids the conversation's next turn repeats (`next_turn_prefix`): the worker marks them


def field(body: Mapping[str, Any], name: str, types: type | tuple[type, ...], default: Any = _MISSING) -> Any:
    """body[name] checked against types (None counts as absent); a missing field without default is an error."""
    value = body.get(name)
    if value is None:
        if default is _MISSING:
            raise BadRequest(f"'{name}' is required", name)
        return default
    # bool is an int in Python: a field of numbers must not take true/false
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        names = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in _as_tuple(types))
        raise BadRequest(f"'{name}' must be {names}, got {_json_type(value)}", name)
    return value


def _as_tuple(types):
    return types if isinstance(types, tuple) else (types,)


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
               dict: "an object"}


def _json_type(value: Any) -> str:
    for t, name in [(bool, "a boolean"), (str, "a string"), (int, "an integer"), (float, "a number"),
                    (list, "an array"), (dict, "an object")]:
        if isinstance(value, t):
            return name
    return "null"


def check_greedy(body: Mapping[str, Any], settings: Settings) -> None:
    """Refuse sampling (until lossless sampling exists) unless the server runs it greedily by choice.

    A request is greedy when it gives temperature 0 or top_k 1, or no sampling field at all; temperature > 0,
    top_p < 1, top_k > 1 and penalties or logit biases that change the choice ask for something else."""
    temperature = field(body, "temperature", (int, float), None)
    top_p = field(body, "top_p", (int, float), None)
    top_k = field(body, "top_k", int, None)
    for name, value, low, high in [("temperature", temperature, 0, 2), ("top_p", top_p, 0, 1)]:
        if value is not None and not low <= value <= high:
            raise BadRequest(f"'{name}' must be between {low} and {high}, got {value}", name)
    if temperature == 0 or top_k == 1:
        asks = []
    else:
        asks = [f"{name} {value}" for name, value, greedy in
                [("temperature", temperature, 0), ("top_p", top_p, 1), ("top_k", top_k, None)]
                if value is not None and value != greedy]
    asks += [f"{name} {body[name]}" for name in ("frequency_penalty", "presence_penalty")
             if body.get(name) not in (None, 0)]
    asks += [f"repetition_penalty {body['repetition_penalty']}"] if body.get("repetition_penalty") not in (None, 1) \
        else []
    asks += ["logit_bias"] if body.get("logit_bias") else []
    if asks and not settings.allow_greedy_fallback:
        raise BadRequest(f"this server decodes greedily only and cannot honour {', '.join(asks)}; send temperature "
                         "0 (or leave the sampling fields out), or start the server with --allow_greedy_fallback "
                         "to run such requests greedily", asks[0].split()[0])


def refuse(body: Mapping[str, Any], fields: Mapping[str, str]) -> None:
    """400 for a field the server does not implement, when the request uses it (the value says what)."""
    for name, what in fields.items():
        if body.get(name) not in (None, False, [], {}):
            raise BadRequest(f"'{name}' is not supported: {what}", name)


def stop_strings(body: Mapping[str, Any], name: str) -> tuple[str, ...]:
    """The stop strings of a request: a string or an array of non-empty strings."""
    value = field(body, name, (str, list), [])
    stops = [value] if isinstance(value, str) else value
    if not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(f"'{name}' must be a string or an array of non-empty strings", name)
    if len(stops) > 16:
        raise BadRequest(f"'{name}' takes at most 16 strings, got {len(stops)}", name)
    return tuple(stops)


def text_of(content: Any, where: str, text_types: Sequence[str] = ("text",)) -> str:
    """Message content as text: a string, or an array of text parts joined by newlines (no images or tools)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or an array of content parts", where)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in text_types:
            raise BadRequest(f"{where}.content[{i}] is of type {kind!r}: only text content is supported", where)
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}.content[{i}].text must be a string", where)
        texts.append(part["text"])
    return "\n".join(texts)


def chat_prompt(settings: Settings, messages: list[dict], thinking: bool | None = None) -> list[int]:
    """Prompt ids of a conversation through the chat template; a last assistant message is continued, not closed."""
    if not messages:
        raise BadRequest("'messages' must not be empty", "messages")
    thinking = settings.thinking if thinking is None else thinking
    prefill = messages[-1]["content"] if messages[-1]["role"] == "assistant" else None
    head = messages[:-1] if prefill is not None else messages
    try:
        text = settings.tokenizer.render_chat(head, True, thinking) + (prefill or "")
    except TemplateError as e:
        raise BadRequest(str(e), "messages") from None
    return settings.tokenizer.encode(text)


def next_turn_prefix(settings: Settings, messages: list[dict], ids: list[int], thinking: bool | None = None) -> int:
    """How many leading ids of a chat prompt the conversation's next turn will repeat: the common prefix of the
    prompt and the template's rendering of these messages followed by a reply and a user message. That is not always
    the prompt and the reply: Qwen3.5's template opens the reply with an empty think block when thinking is off, but
    renders past replies without it."""
    thinking = settings.thinking if thinking is None else thinking
    prefill = messages[-1]["content"] if messages[-1]["role"] == "assistant" else None
    head = messages[:-1] if prefill is not None else messages
    later = head + [{"role": "assistant", "content": (prefill or "") + "x"}, {"role": "user", "content": "x"}]
    try:
        following = settings.tokenizer.encode(settings.tokenizer.render_chat(later, False, thinking))
    except TemplateError:  # a template that refuses the made-up turns: no reuse
        return 0
    return next((i for i, (a, b) in enumerate(zip(ids, following)) if a != b), min(len(ids), len(following)))


def max_tokens(value: int | None, n_prompt: int, settings: Settings, name: str = "max_tokens") -> int:
    """The generation limit: the request's, else the server default, checked against the room in the context."""
    room = settings.max_ctx - n_prompt
    if value is None:
        value = room if not settings.default_max_tokens else min(settings.default_max_tokens, room)
        if value < 1:
            raise BadRequest(f"the prompt of {n_prompt} tokens leaves no room in the context of {settings.max_ctx} "
                             "tokens", "messages")
    elif value < 1:
        raise BadRequest(f"'{name}' must be at least 1, got {value}", name)
    elif value > room:
        raise BadRequest(f"the prompt of {n_prompt} tokens + {name} {value} = {n_prompt + value} exceeds the "
                         f"context of {settings.max_ctx} tokens", name)
    return value
