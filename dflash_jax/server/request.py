"""What every API's request becomes: checked fields, prompt ids and a token limit that fits the context."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from dflash_jax.chat_template import TemplateError
from dflash_jax.engine.sampling import GREEDY, SEED_LIMIT, SamplingParams, seed_or_drawn
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
    sampling: SamplingParams = GREEDY  # temperature, top_p, top_k, min_p of requests that leave them out
    seed: int | None = None  # the seed of sampled requests that give none (None: one drawn per request)
    reasoning_budget: int | None = None  # think-block tokens of requests that give no budget (None: no limit)


@dataclasses.dataclass(frozen=True)
class GenRequest:
    """One generation for the worker: the whole prompt's ids, at most max_tokens more, stop strings."""

    ids: list[int]
    max_tokens: int
    stops: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # OpenAI stream_options.include_usage: a last chunk with the token counts
    history: int = 0  # leading ids the conversation's next turn repeats (`next_turn_prefix`): the worker marks them
    shared: int = 0  # leading ids another conversation with the same system messages and tools repeats
    # (`conversation_prefix`): the worker's prefix cache keeps a snapshot there
    sampling: SamplingParams = GREEDY
    n: int = 1  # completions of the prompt, the i-th sampled with seed + i (`choices`)
    tools: Mapping[str, Any] | None = None  # {name: parameters schema} of the tools whose calls the reply is parsed for
    single_call: bool = False  # only the reply's first call is kept (parallel_tool_calls false)
    prefix: str = ""  # the reply's first text, forced at the end of the prompt (a required tool call)
    thinks: bool = False  # the prompt opens a think block: the reply starts with reasoning (server/reply.py)
    reasoning_budget: int | None = None  # reply tokens in that block after which the server closes it (None: never)


def field(body: Mapping[str, Any], name: str, types: type | tuple[type, ...], default: Any = _MISSING) -> Any:
    """body[name] checked against types (None counts as absent); a missing field without default is an error."""
    value = body.get(name)
    if value is None:
        if default is _MISSING:
            raise BadRequest(f"'{name}' is required", name)
        return default
    # bool is an int in Python: a field of numbers must not take true/false
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        named = [t for t in _as_tuple(types) if not (t is int and float in _as_tuple(types))]  # an int is a number
        names = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in named)
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


def _ranged(body: Mapping[str, Any], name: str, types: type | tuple[type, ...], ok: Callable[[Any], bool],
            rule: str) -> Any:
    """An optional field checked against types and a rule (None when absent)."""
    value = field(body, name, types, None)
    if value is not None and not ok(value):
        raise BadRequest(f"'{name}' must be {rule}, got {value}", name)
    return value


def refuse_penalties(body: Mapping[str, Any]) -> None:
    """400 for penalties and logit biases, which are not implemented, unless they are left at their neutral value."""
    for name, neutral in [("frequency_penalty", 0), ("presence_penalty", 0), ("repetition_penalty", 1)]:
        if field(body, name, (int, float), neutral) != neutral:
            raise BadRequest(f"'{name}' is not supported: penalties are not implemented (leave it out or send "
                             f"{neutral})", name)
    if field(body, "logit_bias", dict, {}):
        raise BadRequest("'logit_bias' is not supported: logit biases are not implemented", "logit_bias")


def sampling(body: Mapping[str, Any], settings: Settings, max_temperature: float) -> SamplingParams:
    """A request's sampling fields (temperature 0: greedy), those it leaves out the server's; a sampled request
    without a seed gets the server's, else one drawn at random, which the response reports."""
    number = (int, float)
    temperature = _ranged(body, "temperature", number, lambda v: 0 <= v <= max_temperature,
                          f"between 0 and {max_temperature:g}")
    top_p = _ranged(body, "top_p", number, lambda v: 0 < v <= 1, "in (0, 1]")
    top_k = _ranged(body, "top_k", int, lambda v: v >= 0, "at least 0 (0: off)")
    min_p = _ranged(body, "min_p", number, lambda v: 0 <= v < 1, "in [0, 1)")
    seed = _ranged(body, "seed", int, lambda v: 0 <= v < SEED_LIMIT, "in 0..2^32-1")
    refuse_penalties(body)
    d = settings.sampling
    temperature = d.temperature if temperature is None else float(temperature)
    seed = seed_or_drawn(settings.seed if seed is None else seed, temperature)
    return SamplingParams(temperature=temperature, top_p=d.top_p if top_p is None else float(top_p),
                          top_k=d.top_k if top_k is None else min(top_k, settings.vocab_size),
                          min_p=d.min_p if min_p is None else float(min_p), seed=seed)


def count(body: Mapping[str, Any], limit: int = 16) -> int:
    """OpenAI's n (with best_of, if given, equal to it): how many completions of the prompt to return."""
    n = _ranged(body, "n", int, lambda v: 1 <= v <= limit, f"between 1 and {limit}") or 1
    best_of = field(body, "best_of", int, n)
    if best_of != n:
        raise BadRequest(f"'best_of' must equal n ({n}): completions are not ranked", "best_of")
    if n > 1 and field(body, "stream", bool, False):
        raise BadRequest("stream with n > 1 is not supported", "n")
    return n


def choices(request: GenRequest) -> list[GenRequest]:
    """The request's n generations, one choice each: choice i samples with seed + i (modulo 2^32)."""
    return [dataclasses.replace(request, n=1, sampling=dataclasses.replace(
        request.sampling, seed=(request.sampling.seed + i) % SEED_LIMIT)) for i in range(request.n)]


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


def text_of(content: Any, where: str, text_types: Sequence[str] = ("text",), key: str = "content") -> str:
    """Message content (`where`.`key`) as text: a string, or an array of text parts joined by newlines (no images or
    tools)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.{key} must be a string or an array of content parts", where)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in text_types:
            raise BadRequest(f"{where}.{key}[{i}] is of type {kind!r}: only text content is supported", where)
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}.{key}[{i}].text must be a string", where)
        texts.append(part["text"])
    return "\n".join(texts)


def chat_text(settings: Settings, messages: list[dict], thinking: bool | None = None,
              tools: Sequence[dict] | None = None, param: str = "messages") -> str:
    """Prompt text of a conversation (and the tools offered) through the chat template; a last assistant message is
    continued, not closed; a template error is a 400 naming `param`."""
    if not messages:
        raise BadRequest(f"'{param}' must not be empty", param)
    thinking = settings.thinking if thinking is None else thinking
    prefill = messages[-1]["content"] if messages[-1]["role"] == "assistant" else None
    head = messages[:-1] if prefill is not None else messages
    try:
        return settings.tokenizer.render_chat(head, True, thinking, tools) + (prefill or "")
    except TemplateError as e:
        raise BadRequest(str(e), param) from None


def chat_prompt(settings: Settings, messages: list[dict], thinking: bool | None = None,
                tools: Sequence[dict] | None = None) -> list[int]:
    """Prompt ids of a conversation (and the tools offered) through the chat template (`chat_text`)."""
    return settings.tokenizer.encode(chat_text(settings, messages, thinking, tools))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def next_turn_prefix(settings: Settings, messages: list[dict], ids: list[int], thinking: bool | None = None,
                     tools: Sequence[dict] | None = None) -> int:
    """How many leading ids of a chat prompt the conversation's next turn will repeat: the common prefix of the
    prompt and the template's rendering of these messages followed by a reply and a user message. That is not always
    the prompt and the reply: Qwen3.5's template opens the reply with an empty think block when thinking is off, but
    renders past replies without it."""
    thinking = settings.thinking if thinking is None else thinking
    prefill = messages[-1]["content"] if messages[-1]["role"] == "assistant" else None
    head = messages[:-1] if prefill is not None else messages
    later = head + [{"role": "assistant", "content": (prefill or "") + "x"}, {"role": "user", "content": "x"}]
    try:
        following = settings.tokenizer.encode(settings.tokenizer.render_chat(later, False, thinking, tools))
    except TemplateError:  # a template that refuses the made-up turns: no reuse
        return 0
    return common_prefix(ids, following)


def conversation_prefix(settings: Settings, messages: list[dict], ids: list[int], thinking: bool | None = None,
                        tools: Sequence[dict] | None = None) -> int:
    """How many leading ids of a chat prompt another conversation with the same system messages and tools will
    repeat: the common prefix of the prompt and the template's renderings of those followed by two different user
    messages (0 when there are neither system messages nor tools: nothing but the template's own tokens is shared)."""
    system = []
    for m in messages:
        if m["role"] != "system":
            break
        system.append(m)
    if not system and not tools:
        return 0
    thinking = settings.thinking if thinking is None else thinking
    shared = len(ids)
    for text in ("x", "y"):
        try:
            other = settings.tokenizer.encode(settings.tokenizer.render_chat(
                system + [{"role": "user", "content": text}], False, thinking, tools))
        except TemplateError:  # a template that refuses the made-up turn: no snapshot there
            return 0
        shared = min(shared, common_prefix(ids, other))
    return shared


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


EFFORT = {"low": 1024, "medium": 4096, "high": 16384}  # a reasoning effort's think-block tokens before it is closed


def think_budget(settings: Settings, asked: int | None, thinks: bool) -> int | None:
    """The think-block token budget of a reply: the request's, else the server's; None when the reply does not start
    inside a think block."""
    return (settings.reasoning_budget if asked is None else asked) if thinks else None
