"""A chat request's tools and tool choice, for every API (chat completions, Responses, Messages): the tools and past
calls checked, whether the reply is parsed for calls, the text that forces a call, and the prompt that ends in it.

A call is forced (OpenAI `tool_choice` "required" or a named function, Anthropic "any" or "tool") by beginning the
reply in the prompt: `<tool_call>\\n<function=` after the generation prompt, and for a named function its name and
`>\\n`, so the model goes on from inside a call. That text is part of the reply the server parses. The template's
think block is closed for such a reply (thinking off): the call comes first.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Mapping, Sequence

from dflash_jax.server.reply import opens_thinking
from dflash_jax.server.request import BadRequest, Settings, chat_text, conversation_prefix, field, next_turn_prefix

TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
FORCED_CALL = "<tool_call>\n<function="


@dataclasses.dataclass(frozen=True)
class ToolUse:
    """What the reply does with the offered tools."""

    tools: Mapping[str, Any]  # {name: parameters schema} of the tools offered
    parsed: bool = False  # the reply is parsed for their calls
    forced: str = ""  # the reply's first text, in the prompt: a call begun
    single: bool = False  # only the first call is kept

    def fields(self) -> dict[str, Any]:
        """The GenRequest fields this sets."""
        return {"tools": self.tools if self.parsed else None, "single_call": self.single, "prefix": self.forced}


def check_tool(where: str, name: Any, description: Any, parameters: Any, seen: set[str],
               schema: str = "parameters") -> None:
    """400 (naming 'tools') for a tool the template cannot render as a function: a bad or repeated name, a description
    that is not a string, parameters (the field named `schema`) that are not a JSON schema object with an object of
    properties."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise BadRequest(f"{where}.name must be 1 to 64 letters, digits or '_.:-', got {name!r}", "tools")
    if name in seen:
        raise BadRequest(f"{where}.name {name!r} names an earlier tool too", "tools")
    seen.add(name)
    if not isinstance(description, str):
        raise BadRequest(f"{where}.description must be a string", "tools")
    if not isinstance(parameters, dict) or not isinstance(parameters.get("properties", {}), dict):
        raise BadRequest(f"{where}.{schema} must be a JSON schema object whose 'properties' is an object", "tools")


def function_tool(function: Mapping[str, Any], where: str, seen: set[str]) -> dict:
    """An OpenAI function definition checked (`check_tool`) and in the form the template renders, its null fields
    left out (OpenAI's clients may send a null description or parameters)."""
    function = {k: v for k, v in function.items() if v is not None}
    check_tool(where, function.get("name"), function.get("description", ""), function.get("parameters", {}), seen)
    return {"type": "function", "function": function}


def choose(tools: Mapping[str, Any], choice: str, name: str | None, single: bool, param: str) -> ToolUse:
    """The ToolUse of a choice: 'auto' (parsed), 'none' (the tools rendered, the reply left as text), 'required' or
    'named' (a call forced; `name` the function's, which must be offered)."""
    if choice in ("required", "named") and not tools:
        raise BadRequest(f"{param} {choice!r} needs tools to call", param)
    if choice == "named" and name not in tools:
        raise BadRequest(f"{param} names the function {name!r}, which is not among the tools", param)
    forced = FORCED_CALL + (f"{name}>\n" if choice == "named" else "") if choice in ("required", "named") else ""
    return ToolUse(dict(tools), choice != "none" and bool(tools), forced, single)


def openai_tool_use(body: Mapping[str, Any], tools: Sequence[dict], name_of: Callable[[dict], Any],
                    shape: str) -> ToolUse:
    """What an OpenAI `tool_choice` (auto, none, required, or an object naming a function: `name_of` reads its name,
    None when it names none; `shape` is its form, for the error) and `parallel_tool_calls` ask of the reply; `tools`
    in the template's form."""
    choice = field(body, "tool_choice", (str, dict), "auto")
    name = None
    if isinstance(choice, dict):
        name = name_of(choice)
        if not isinstance(name, str):
            raise BadRequest(f"a named 'tool_choice' must be {shape}", "tool_choice")
        choice = "named"
    elif choice not in ("auto", "none", "required"):
        raise BadRequest(f"'tool_choice' must be 'auto', 'none', 'required' or a named function, got {choice!r}",
                         "tool_choice")
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}
    return choose(schemas, choice, name, not field(body, "parallel_tool_calls", bool, True), "tool_choice")


def call_arguments(arguments: Any, where: str, param: str) -> dict:
    """A past tool call's arguments as the template reads them: a JSON object, sent as a string (or as an object)."""
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError):
        arguments = None
    if not isinstance(arguments, dict):
        raise BadRequest(f"{where}.arguments must be a JSON object, as a string", param)
    return arguments


def check_template(settings: Settings, tools: Sequence[dict], messages: list[dict], param: str = "messages",
                   results: str = "role 'tool' messages") -> None:
    """400 for tools or past tool calls that the model's chat template would drop without a word, and for a
    conversation (`param`) whose last message makes calls (their `results` must follow)."""
    template = settings.tokenizer.chat_template or ""
    if tools and "tools" not in template:
        raise BadRequest("'tools' need a chat template that renders them; this model's does not", "tools")
    if any("tool_calls" in m for m in messages) and "tool_calls" not in template:
        raise BadRequest(f"{param} with tool calls need a chat template that renders them; this model's does not",
                         param)
    if "tool_calls" in messages[-1]:
        raise BadRequest(f"the last of '{param}' makes tool calls: send their results ({results}) after it", param)


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """A chat's prompt ids and what the worker and the reply's reader need to know of them."""

    ids: list[int]
    thinks: bool  # the reply starts inside a think block
    history: int  # leading ids the conversation's next turn repeats (`next_turn_prefix`)
    shared: int  # leading ids another conversation with the same system messages and tools repeats

    def fields(self) -> dict[str, Any]:
        """The GenRequest fields this sets besides the ids."""
        return {"thinks": self.thinks, "history": self.history, "shared": self.shared}


def reply_prompt(settings: Settings, messages: list[dict], thinking: bool | None, tools: Sequence[dict],
                 use: ToolUse, param: str = "messages") -> ChatPrompt:
    """The prompt of a chat (`param` names it in errors) whose tools are rendered as `tools` (the template's form); a
    forced call ends the prompt, thinking off."""
    if use.forced:
        if messages[-1]["role"] == "assistant":
            raise BadRequest("a forced tool call cannot continue a last assistant message (prefill)", param)
        thinking = False
    text = chat_text(settings, messages, thinking, tools, param)
    ids = settings.tokenizer.encode(text + use.forced)
    return ChatPrompt(ids, opens_thinking(text), next_turn_prefix(settings, messages, ids, thinking, tools),
                      conversation_prefix(settings, messages, ids, thinking, tools))
