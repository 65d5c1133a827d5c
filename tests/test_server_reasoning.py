"""Reasoning through both APIs (issue 44, item 2): with thinking on, Qwen3.5's template opens the think block in the
prompt, and the reply's text before `</think>` comes back apart from the answer: OpenAI `reasoning_content` and
Anthropic `thinking` blocks, streaming and not; and the reasoning budget (Anthropic `thinking.budget_tokens`, OpenAI
`reasoning_effort` and the Responses API's `reasoning.effort`, the server's `--reasoning_budget`), which closes the block after N tokens, on the tiny model
(greedy) against the engine run on the prompt, the first N tokens and the closing text; its logic on a scripted
engine. Replies that must say something particular are forced as in test_server_tools."""

import dataclasses

import pytest

from dflash_jax.chat_template import render
from dflash_jax.engine.generate import Generation
from dflash_jax.server import anthropic_api, budget, openai_api, responses_api
from dflash_jax.server.reply import THINK_CLOSE, split_reasoning
from dflash_jax.server.request import Settings
from dflash_jax.tokenizer import load_tokenizer
from test_server import USER, Server, claude, oai  # noqa: F401 (fixtures, on this module's server)
from test_server_tools import ARGUMENTS, CALL, CLAUDE_TOOLS, QWEN35, TOOLS, blocks, streamed

THINK = {"chat_template_kwargs": {"enable_thinking": True}}
REASONED = "Let me think.\n\nIt is 4.\n</think>\n\nThe answer is 4."


@pytest.fixture(scope="module")
def server(qwen35_gguf_path):
    srv = Server(qwen35_gguf_path, max_ctx=1024)
    yield srv
    srv.close()


def thinking_ids(server, messages=USER, tools=None) -> list[int]:
    """The prompt ids of the template's own rendering with thinking on: the prompt ends in `<think>\\n`."""
    text = render(messages, QWEN35, enable_thinking=True, tools=tools)
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    return server.tok.encode(text)


def openai_forced(server, oai, text, stream=False, **kwargs):
    server.gated.script = server.tok.encode(text)
    r = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=300, stream=stream, **kwargs)
    return streamed(r) if stream else r


def claude_forced(server, claude, text, stream=False, **kwargs):
    server.gated.script = server.tok.encode(text)
    if not stream:
        return claude.messages.create(model="tiny", messages=USER, max_tokens=300, **kwargs)
    with claude.messages.stream(model="tiny", messages=USER, max_tokens=300, **kwargs) as s:
        return list(s), s.get_final_message()


@pytest.mark.parametrize("extra", [THINK, {"reasoning_effort": "low"}])
def test_openai_reasoning_content_is_apart_from_the_answer(server, oai, extra):
    r = openai_forced(server, oai, REASONED, extra_body=extra)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == "Let me think.\n\nIt is 4." and message.content == \
        "The answer is 4." and r.usage.prompt_tokens == len(thinking_ids(server))
    assert openai_forced(server, oai, REASONED, stream=True, extra_body=extra) == {
        "reasoning": "Let me think.\n\nIt is 4.", "content": "The answer is 4.", "calls": [], "finish": "stop"}


def test_anthropic_thinking_blocks_are_apart_from_the_text(server, claude):
    thinking = {"type": "enabled", "budget_tokens": 200}
    m = claude_forced(server, claude, REASONED, thinking=thinking)
    assert blocks(m) == [{"type": "thinking", "thinking": "Let me think.\n\nIt is 4.", "signature": ""},
                         {"type": "text", "text": "The answer is 4.", "citations": None}]
    events, final = claude_forced(server, claude, REASONED, stream=True, thinking=thinking)
    assert blocks(final) == blocks(m)
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas[0] == "thinking_delta" and deltas.count("signature_delta") == 1
    assert deltas.index("signature_delta") < deltas.index("text_delta")
    assert claude.messages.count_tokens(model="tiny", messages=USER, thinking=thinking).input_tokens == len(
        thinking_ids(server))
    off = claude.messages.count_tokens(model="tiny", messages=USER, thinking={"type": "disabled"}).input_tokens
    assert off == len(server.tok.encode(render(USER, QWEN35, enable_thinking=False)))


def test_reasoning_then_a_tool_call(server, oai, claude):
    text = "I need the weather.\n</think>\n\n" + CALL
    r = openai_forced(server, oai, text, tools=TOOLS, extra_body=THINK)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == "I need the weather." and message.content is None
    assert r.choices[0].finish_reason == "tool_calls" and r.usage.prompt_tokens == len(thinking_ids(server,
                                                                                                   tools=TOOLS))
    s = openai_forced(server, oai, text, stream=True, tools=TOOLS, extra_body=THINK)
    assert s["reasoning"] == "I need the weather." and s["content"] == "" and s["finish"] == "tool_calls"
    assert s["calls"][0][1:] == ["get_weather", message.tool_calls[0].function.arguments]
    thinking = {"type": "enabled", "budget_tokens": 200}
    m = claude_forced(server, claude, text, tools=CLAUDE_TOOLS, thinking=thinking)
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.content[1].input == ARGUMENTS
    _, final = claude_forced(server, claude, text, stream=True, tools=CLAUDE_TOOLS, thinking=thinking)
    assert blocks(final) == blocks(m) and final.stop_reason == "tool_use"


def test_the_models_own_reply_with_thinking_on_is_reasoning(server, oai, claude):
    want, _ = server.expect(thinking_ids(server), 8)
    reasoning, answer = split_reasoning(want, True)
    r = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=8, extra_body=THINK)
    assert (r.choices[0].message.model_extra.get("reasoning_content", ""), r.choices[0].message.content) == (
        reasoning, answer)
    s = streamed(oai.chat.completions.create(model="tiny", messages=USER, max_tokens=8, extra_body=THINK, stream=True))
    assert (s["reasoning"], s["content"]) == (reasoning, answer)
    m = claude.messages.create(model="tiny", messages=USER, max_tokens=8,
                               thinking={"type": "enabled", "budget_tokens": 7})  # too big to close anything
    assert blocks(m)[0] == {"type": "thinking", "thinking": reasoning, "signature": ""}


def test_a_budget_closes_the_think_block_after_n_tokens(server, claude):
    """The reasoning is the first N tokens of the engine's greedy reply; then the closing text, and the answer is
    the engine's continuation of the prompt, those tokens and that text."""
    n, limit = 5, 16
    ids, close = thinking_ids(server), server.tok.encode(budget.CLOSE_TEXT)
    first = server.engine.generate(ids, n, server.tok.stop_ids)
    assert len(first.tokens) == n and not first.stopped and THINK_CLOSE not in server.tok.decode(first.tokens)
    rest = server.engine.generate(ids + first.tokens + close, limit - n - len(close), server.tok.stop_ids)
    want = [{"type": "thinking", "thinking": server.tok.decode(first.tokens).strip(), "signature": ""},
            {"type": "text", "text": server.tok.decode(rest.tokens, skip_stops=True).lstrip(), "citations": None}]
    thinking = {"type": "enabled", "budget_tokens": n}
    m = claude.messages.create(model="tiny", messages=USER, max_tokens=limit, thinking=thinking)
    assert blocks(m) == want and m.usage.output_tokens == n + len(close) + len(rest.tokens)
    again = claude.messages.create(model="tiny", messages=USER, max_tokens=limit, thinking=thinking)
    assert blocks(again) == want and again.usage.cache_read_input_tokens > 0  # its state was kept for the next
    with claude.messages.stream(model="tiny", messages=USER, max_tokens=limit, thinking=thinking) as s:
        assert blocks(s.get_final_message()) == want
    unlimited = claude.messages.create(model="tiny", messages=USER, max_tokens=limit,
                                       thinking={"type": "enabled", "budget_tokens": limit - 1})
    assert [b.type for b in unlimited.content] == ["thinking"]  # without the budget, it reasons to the end


@pytest.fixture(scope="module")
def settings(qwen35_gguf_path):
    return Settings(load_tokenizer(qwen35_gguf_path), "tiny", 1024, 1024, reasoning_budget=7)


@pytest.mark.parametrize("body, want", [
    ({"chat_template_kwargs": {"enable_thinking": True}}, 7),  # the server's --reasoning_budget
    ({"reasoning_effort": "low"}, 1024),
    ({"reasoning_effort": "medium"}, 4096),
    ({"reasoning_effort": "high"}, 16384),
    ({}, None),  # thinking off (the server's default): no think block to close
])
def test_an_openai_request_gets_its_effort_or_the_servers_budget(settings, body, want):
    request = openai_api.parse_chat({"messages": USER, **body}, settings)
    assert request.reasoning_budget == want and request.thinks == (want is not None)


@pytest.mark.parametrize("reasoning, want", [
    ({"effort": "minimal"}, 7), ({"effort": "max"}, 7),  # efforts chat lacks: the server's --reasoning_budget
    ({"effort": "low"}, 1024), ({"effort": "medium"}, 4096), ({"effort": "high"}, 16384),
    ({"effort": "none"}, None), ({}, None),  # thinking off (the server's default)
])
def test_a_responses_request_gets_chats_effort_budget_or_the_servers(settings, reasoning, want):
    request = responses_api.parse_responses({"input": "Hi", "reasoning": reasoning}, settings)
    assert request.reasoning_budget == want and request.thinks == (want is not None)


def test_an_anthropic_request_gets_its_budget_or_the_servers(settings):
    enabled = {"messages": USER, "max_tokens": 100, "thinking": {"type": "enabled", "budget_tokens": 30}}
    assert anthropic_api.parse_messages(enabled, settings).reasoning_budget == 30
    thinking_on = dataclasses.replace(settings, thinking=True)
    assert anthropic_api.parse_messages({"messages": USER, "max_tokens": 100}, thinking_on).reasoning_budget == 7
    assert anthropic_api.parse_messages({"messages": USER, "max_tokens": 100}, settings).reasoning_budget is None


@pytest.mark.parametrize("path, body, message", [
    ("/v1/chat/completions", {"reasoning_effort": "extreme"}, "'reasoning_effort' must be one of low, medium, high"),
    ("/v1/chat/completions", {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}},
     "turns thinking on"),
    ("/v1/messages", {"thinking": {"type": "enabled"}}, "thinking.budget_tokens must be an integer of at least 1"),
    ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 8}}, "must be less than max_tokens (8)"),
    ("/v1/messages", {"thinking": {"type": "adaptive"}}, "thinking.type must be 'enabled' or 'disabled'"),
    ("/v1/messages", {"messages": USER + [{"role": "assistant", "content": [{"type": "thinking", "thinking": 1}]},
                                          USER[0]]}, "thinking must be a string"),
])
def test_bad_reasoning_requests_get_a_400(server, path, body, message):
    status, err = server.post(path, {"messages": USER, "max_tokens": 8, **body})
    assert status == 400 and message in err["error"]["message"], err


class ScriptedEngine:
    """An engine whose model writes `script` whatever the prompt: each generation goes on where the state it
    continues left off (the state is that position); it records the calls it gets."""

    def __init__(self, script: list[int]):
        self.script, self.calls = script, []

    def generate(self, ids, n_gen, stop_ids, on_tokens, after=None, keep_pending=True, mark_at=0, sampling=None,
                 snapshot_at=()):
        self.calls.append((list(ids), n_gen, after, keep_pending))
        at = after or 0
        tokens = self.script[at:at + n_gen]
        stop = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
        tokens = tokens if stop is None else tokens[:stop + 1]
        on_tokens(tokens)
        return Generation(tokens, [len(tokens)], 0, 1.0, 2.0, stop is not None, state=at + len(tokens),
                          mark="mark" if mark_at else None, snapshots=tuple(f"after {n}" for n in snapshot_at))


@pytest.fixture(scope="module")
def tok(tiny_gguf_path):
    return load_tokenizer(tiny_gguf_path)


def run_budget(tok, script, n_budget, n_gen, halt=False):
    engine, sent = ScriptedEngine(script), []

    def on_tokens(new):
        sent.append(list(new))
        return halt and new == tok.encode(budget.CLOSE_TEXT)

    gen = budget.generate(engine, tok, n_budget, [1, 2, 3], n_gen, on_tokens, mark_at=2, snapshot_at=(1, 2))
    assert sum(sent, []) == gen.tokens
    return engine.calls, gen


def test_the_budget_stops_forces_the_closing_text_and_goes_on_from_the_state(tok):
    script, close = list(range(100, 130)), tok.encode(budget.CLOSE_TEXT)
    calls, gen = run_budget(tok, script, 6, 20)
    assert calls == [([1, 2, 3], 6, None, True), ([105] + close, 20 - 6 - len(close), 6, False)]
    assert gen.tokens == script[:6] + close + script[6:6 + 20 - 6 - len(close)] and gen.state == 16
    assert gen.mark == "mark" and gen.prefill_s == 2.0 and gen.accept_lengths == [6, 10]
    assert gen.snapshots == ("after 1", "after 2")  # the prompt's, which the first part prefilled
    script[3] = tok.encode(THINK_CLOSE)[0]  # the block closed by itself: nothing is forced, the reply goes on
    calls, gen = run_budget(tok, script, 6, 20)
    assert calls[1] == ([105], 14, 6, False) and gen.tokens == script[:20]


def test_the_budget_leaves_a_reply_alone_when_it_cannot_or_need_not_close_it(tok):
    script, close = list(range(100, 130)), tok.encode(budget.CLOSE_TEXT)
    for n_budget, n_gen in [(None, 20), (6, 6 + len(close)), (30, 20)]:
        calls, gen = run_budget(tok, script, n_budget, n_gen)
        assert len(calls) == 1 and gen.tokens == script[:n_gen] and gen.snapshots == ("after 1", "after 2")
    script[2] = tok.stop_ids[0]  # ended before the budget
    calls, gen = run_budget(tok, script, 6, 20)
    assert len(calls) == 1 and gen.tokens == script[:3] and gen.stopped
    calls, gen = run_budget(tok, list(range(100, 130)), 6, 20, halt=True)  # a stop string in the closing text
    assert len(calls) == 1 and gen.halted and gen.state is None and gen.tokens == list(range(100, 106)) + close
