"""Chat prompts: a model's Jinja chat template rendered the way transformers' `apply_chat_template` does.

The template comes from the GGUF (`tokenizer.chat_template`) or the HF tokenizer config; without one, ChatML
(`<|im_start|>role\\ncontent<|im_end|>\\n`), which is what Qwen's templates produce for plain messages. The Jinja
environment matches transformers': sandboxed, `trim_blocks` and `lstrip_blocks`, loop controls, a `tojson` filter
that keeps non-ASCII text, and the `raise_exception` and `strftime_now` globals.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any, Mapping, Sequence

from dflash_jax.errors import InputError

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


class TemplateError(InputError):
    """A chat template that does not parse or that rejects the messages."""


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(f"the chat template refused the messages: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise TemplateError(f"the chat template does not parse: {e}") from None


def render(messages: Sequence[Mapping[str, Any]], template: str | None = None, *, add_generation_prompt: bool = True,
           enable_thinking: bool | None = None, bos_token: str | None = None, eos_token: str | None = None,
           tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The prompt text for messages ({"role", "content"} dicts, with any other keys the template reads, such as an
    assistant's `tool_calls`); template None means ChatML.

    enable_thinking None leaves the template's own default; True or False is passed to it (Qwen3.5's template opens
    an empty `<think></think>` block when it is False). tools, when given, are passed as `tools`, as transformers
    passes them (Qwen3.5's template lists them in the system turn)."""
    import jinja2

    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise TemplateError(f"a message needs 'role' and 'content', got {m!r}")
    kwargs: dict[str, Any] = dict(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                                  bos_token=bos_token or "", eos_token=eos_token or "")
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    if tools:
        kwargs["tools"] = [dict(t) for t in tools]
    try:
        return _compile(template or CHATML).render(**kwargs)
    except jinja2.TemplateError as e:
        raise TemplateError(f"the chat template failed: {e}") from None
