"""Qwen3-Coder XML tool calls parsed from a reply: values typed by the tool's schema, several calls, text before
them, replies whose first call is not a well-formed call of an offered tool returned whole as text, and what follows
well-formed calls and is not one kept as text after them."""

import json

import pytest

from dflash_jax.server.tool_calls import ToolCall, argument_pieces, arguments_json, convert, parse

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
    "metric": {"type": "boolean"}, "where": {"type": "object"}, "tags": {"type": "array"},
    "maybe": {"type": ["integer", "null"]}, "code": {"type": "string"}}}
TOOLS = {"get_weather": SCHEMA, "noop": {}}


def call(name, *params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize("text, schema, want", [
    ("Paris", {"type": "string"}, "Paris"),
    ("42", {"type": "string"}, "42"),  # a string stays a string, digits or not
    ("null", {"type": "string"}, "null"),
    ("3", {"type": "integer"}, 3),
    (" -7 ", {"type": "integer"}, -7),
    ("3.5", {"type": "integer"}, "3.5"),  # not an integer: kept as written
    ("2.5", {"type": "number"}, 2.5),
    ("4.0", {"type": "number"}, 4),  # an integral number becomes an int
    ("1e3", {"type": "number"}, 1000),
    ("nan", {"type": "number"}, "nan"),  # no JSON value
    ("True", {"type": "boolean"}, True),
    ("false", {"type": "boolean"}, False),
    ("yes", {"type": "boolean"}, "yes"),
    ('{"a": [1, 2]}', {"type": "object"}, {"a": [1, 2]}),
    ("{'a': True}", {"type": "object"}, {"a": True}),  # a Python literal, as Qwen3.5's template writes history
    ("[1, \"x\"]", {"type": "array"}, [1, "x"]),
    ("[1, 2]", {"type": "object"}, "[1, 2]"),  # an array where an object is due: kept as written
    ("{not json", {"type": "object"}, "{not json"),
    ("{1, 2}", {"type": "array"}, "{1, 2}"),  # a Python set is no JSON value
    ("null", {"type": ["integer", "null"]}, None),
    ("5", {"type": ["integer", "null"]}, 5),
    ("5", {"type": ["string", "integer"]}, "5"),  # string-like wins: the model's text is the value
    ("5", None, "5"),  # a parameter the schema does not name
    ("5", {"description": "no type"}, "5"),
])
def test_each_value_is_converted_by_its_schema_type(text, schema, want):
    got = convert(text, schema)
    assert got == want and type(got) is type(want)


def test_one_call_with_every_type_and_text_before_it():
    text = "Let me look.\n\n" + call("get_weather", ("city", "New York"), ("days", "3"), ("temp", "21.5"),
                                    ("metric", "true"), ("where", '{"lat": 40.7}'), ("tags", '["a", "b"]'),
                                    ("code", "def f():\n    return 1\n"))
    content, calls, tail = parse(text, TOOLS)
    assert content == "Let me look." and tail == ""
    assert calls == [ToolCall("get_weather", {"city": "New York", "days": 3, "temp": 21.5, "metric": True,
                                              "where": {"lat": 40.7}, "tags": ["a", "b"],
                                              "code": "def f():\n    return 1\n"})]
    assert json.loads(arguments_json(calls[0])) == calls[0].arguments


def test_several_calls_and_a_call_without_parameters():
    text = call("get_weather", ("city", "Paris")) + "\n" + call("noop") + "\n" + call("get_weather", ("days", "2"))
    assert parse(text + "\n \n", TOOLS) == parse(text, TOOLS)  # whitespace after the calls is no tail
    content, calls, tail = parse(text, TOOLS)
    assert content == "" and tail == ""
    assert calls == [ToolCall("get_weather", {"city": "Paris"}), ToolCall("noop", {}),
                     ToolCall("get_weather", {"days": 2})]


def test_non_ascii_values_stay_text_in_the_arguments_json():
    _, calls, _ = parse(call("get_weather", ("city", "Zürich")), TOOLS)
    assert arguments_json(calls[0]) == '{"city": "Zürich"}'


def test_a_multiline_value_loses_only_one_newline_each_side():
    _, calls, _ = parse(call("get_weather", ("city", "\nline one\nline two\n")), TOOLS)
    assert calls[0].arguments == {"city": "\nline one\nline two\n"}


def test_a_reply_without_calls_is_all_content():
    text = "Just text, with <function=x> but no call."
    assert parse(text, TOOLS) == (text, [], "")


@pytest.mark.parametrize("text", [
    call("delete_everything", ("path", "/")),  # a tool the request did not offer
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",  # cut off (max_tokens)
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",  # no </function>
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",  # parameter open
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n</parameter>\n"
     "</function>\n</tool_call>"),  # a parameter left open before the next
    call("get_weather", ("city", "Paris"), ("city", "Rome")),  # a repeated parameter
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>",  # Hermes JSON, not this form
    "<tool_call>\n<function=get_weather>\nstray text\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n</function>\n</tool_cal",  # the close cut off
])
def test_a_malformed_first_call_makes_the_reply_all_content(text):
    assert parse(text, TOOLS) == (text, [], "")
    assert parse("Sure.\n\n" + text, TOOLS) == ("Sure.\n\n" + text, [], "")


@pytest.mark.parametrize("tail", [
    " and some text after",  # text after the calls
    "<tool_call>",  # a call begun and never finished
    "\n" + call("delete_everything", ("path", "/")),  # a tool the request did not offer
    "\n" + call("get_weather", ("city", "Paris"), ("city", "Rome")) + "\n" + call("noop"),  # a malformed call
])
def test_what_follows_well_formed_calls_and_is_not_one_is_the_tail(tail):
    paris = call("get_weather", ("city", "Paris"))
    assert parse("Sure. " + paris + tail, TOOLS) == ("Sure.", [ToolCall("get_weather", {"city": "Paris"})], tail)


def test_the_arguments_pieces_join_into_the_arguments_json():
    for arguments in ({}, {"city": "Zürich"}, {"city": "Paris", "days": 3, "where": {"lat": [1, None]}}):
        pieces = argument_pieces(ToolCall("get_weather", arguments))
        assert "".join(pieces) == json.dumps(arguments, ensure_ascii=False) and len(pieces) == len(arguments) + 1 + (
            not arguments)


def test_no_offered_tools_means_every_call_is_content():
    text = call("get_weather", ("city", "Paris"))
    assert parse(text, {}) == (text, [], "")
