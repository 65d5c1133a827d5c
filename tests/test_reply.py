"""The streamed reply parser (server/reply.py): over every split of a reply into two pieces, and one character at a
time, its events add up to what the whole reply read at once gives (reasoning split, then `tool_calls.parse`); text
that may be the start of a tag is held back; malformed calls come out as content."""

import random

import pytest

from dflash_jax.server.reply import Call, Content, Reasoning, Reply, ReplyParser, collect, split_reasoning, whole
from dflash_jax.server.tool_calls import ToolCall
from test_tool_calls import TOOLS, call

PARIS = call("get_weather", ("city", "Paris"), ("days", "3"), ("where", '{"lat": 48.9}'))
ROME = call("get_weather", ("city", "Rome </tool_call> </function> <tool_call>"), ("metric", "true"))
CALL_PARIS = ToolCall("get_weather", {"city": "Paris", "days": 3, "where": {"lat": 48.9}})
CALL_ROME = ToolCall("get_weather", {"city": "Rome </tool_call> </function> <tool_call>", "metric": True})
# (reply, the prompt opened a think block, tools parsed, what the whole reply reads as)
REPLIES = [
    ("\nLet me think.\n\nHard.  \n</think>\n\nLet me look.\n\n" + PARIS + "\n" + ROME + "\n", True, True,
     Reply("Let me think.\n\nHard.", "Let me look.", (CALL_PARIS, CALL_ROME))),
    ("Plain answer <tool_c with a tag-like end <", False, True,
     Reply("", "Plain answer <tool_c with a tag-like end <")),
    ("  <think>short</think>  answer  \n", False, False, Reply("short", "answer  \n")),
    ("still thinking when cut off <", True, True, Reply("still thinking when cut off <", "")),
    ("\n</think>\n\n" + PARIS + " and then text", True, True, Reply("", "", (CALL_PARIS,), " and then text")),
    ("Sure. " + PARIS + "\n" + call("delete_files", ("path", "/")), False, True,
     Reply("", "Sure.", (CALL_PARIS,), "\n" + call("delete_files", ("path", "/")))),
    ("Text\n\n" + PARIS[:-len("</tool_call>")] + "</tool_c", False, True,
     Reply("", "Text\n\n" + PARIS[:-len("</tool_call>")] + "</tool_c")),  # cut off: content
    ("<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>", False, True,
     Reply("", "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>")),  # Hermes JSON
    (call("get_weather", ("city", "Paris"), ("city", "Rome")), False, True,
     Reply("", call("get_weather", ("city", "Paris"), ("city", "Rome")))),  # a repeated parameter
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n</parameter>\n</function>\n"
     "</tool_call>", False, True, Reply("", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                                           "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")),
    ("A " + PARIS, False, False, Reply("", "A " + PARIS)),  # tools not parsed
    ("<think>\n" + call("noop") + "</think>" + call("noop") + "\n\n" + call("noop"), False, True,
     Reply(call("noop"), "", (ToolCall("noop", {}), ToolCall("noop", {})))),
]


def feed(pieces, thinking, tools):
    parser = ReplyParser(thinking, TOOLS if tools else None)
    events = [e for piece in pieces for e in parser.push(piece)]
    return events + parser.finish()


@pytest.mark.parametrize("text, thinking, tools, want", REPLIES)
def test_the_whole_reply_reads_as_the_reasoning_split_and_the_call_parser(text, thinking, tools, want):
    assert whole(text, thinking, TOOLS if tools else None) == want
    assert collect(feed([text], thinking, tools)) == want


@pytest.mark.parametrize("text, thinking, tools, want", REPLIES)
def test_every_split_of_a_reply_gives_the_events_of_the_whole(text, thinking, tools, want):
    at_once = feed([text], thinking, tools)
    for i in range(len(text) + 1):
        events = feed([text[:i], text[i:]], thinking, tools)
        assert collect(events) == want, i
        assert [e for e in events if isinstance(e, Call)] == [e for e in at_once if isinstance(e, Call)]
    assert collect(feed(list(text), thinking, tools)) == want
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(6, len(text) + 1)))
        assert collect(feed([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])], thinking, tools)) == want


def test_text_that_may_start_a_tag_is_held_until_decided():
    parser = ReplyParser(True, TOOLS)
    assert parser.push("Hmm, 2 + 2  \n</thi") == [Reasoning("Hmm, 2 + 2")]
    assert parser.push("nk>\n\n") == []
    assert parser.push("Four. \n<tool") == [Content("Four.")]
    assert parser.push("box>") == [Content(" \n<toolbox>")]  # not a call after all
    assert parser.push("\n" + PARIS[:40]) == []  # the newline before a call is dropped
    assert parser.push(PARIS[40:]) == [Call(0, CALL_PARIS)]
    assert parser.push("\n\n") == [] and parser.finish() == []


@pytest.mark.parametrize("head, decided", [
    ("<tool_call>\n<function=get_weath", "er_now>\n<param"),  # a tool not offered, known at its name's end
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", "is\n<parameter="),  # a parameter left open
    ("<tool_call>\n<function=get_weather>\n</function>\n</tool", "s>"),  # not the close
    ("<tool_call>\n<funct", "ion\n"),
])
def test_a_malformed_call_is_content_as_soon_as_no_text_can_mend_it(head, decided):
    parser = ReplyParser(False, TOOLS)
    assert parser.push(head) == []
    assert parser.push(decided) == [Content(head + decided)]
    assert parser.push("<tool_call>") == [Content("<tool_call>")]


@pytest.mark.parametrize("text, thinking, want", [
    ("a\n</think>\n\nb", True, ("a", "b")),
    ("a", True, ("a", "")),
    ("<think>a</think>b", False, ("a", "b")),
    ("b <think>a</think>", False, ("", "b <think>a</think>")),
    ("</think>b", False, ("", "</think>b")),
])
def test_reasoning_is_the_think_block_the_prompt_or_the_reply_opens(text, thinking, want):
    assert split_reasoning(text, thinking) == want


def test_single_keeps_the_first_call_only():
    text = PARIS + "\n" + ROME + " tail"
    assert whole(text, False, TOOLS, single=True) == Reply("", "", (CALL_PARIS,), " tail")
    parser = ReplyParser(False, TOOLS, single=True)
    events = [e for c in text for e in parser.push(c)] + parser.finish()
    assert collect(events) == whole(text, False, TOOLS, single=True)
