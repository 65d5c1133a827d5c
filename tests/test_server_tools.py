"""Tool calls through /v1/chat/completions with the `openai` client and /v1/messages with the `anthropic` client
(issue 44, item 1): tools and earlier calls and results rendered into the prompt by the published Qwen3.5 template, a
reply's Qwen3-Coder XML returned as `tool_calls` (streamed as `delta.tool_calls` with the arguments in pieces) and as
`tool_use` blocks (streamed as `input_json_delta`), round trips, `tool_choice` none, required (any) and a named
function, one call only, malformed XML as plain content, and the refusals. The template is the model's own: the
server reads it from the test GGUF (the fixture with the published template as `tokenizer.chat_template`,
conftest.qwen35_gguf_path), as it does a user's; a GGUF without one gets ChatML, which renders no tools.

The random fixture model does not write tool calls, so the replies that call tools are forced: the test server's
engine emits a given token script, a token at a time, instead of the model's choice
(test_server.GatedEngine.script), and everything after the engine (detokenizing, parsing, the response) runs as it
does for the model."""

import json

import openai
import pytest
from gguf import GGUFReader

from conftest import QWEN35_TEMPLATE
from dflash_jax.chat_template import render
from dflash_jax.server import anthropic_api, openai_api
from dflash_jax.server.request import BadRequest, Settings
from dflash_jax.server.tool_use import FORCED_CALL
from dflash_jax.testing.gguf_writer import rewrite_gguf
from dflash_jax.tokenizer import load_tokenizer
from test_server import USER, Server, claude, oai  # noqa: F401 (fixtures, on this module's server)

QWEN35 = QWEN35_TEMPLATE.read_text()  # the test model's own (conftest.qwen35_gguf_path); the tests render it
MAX_CTX = 1024  # the template's tool instructions alone are about 470 tokens of the fixture's vocabulary
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "temp": {"type": "number"}, "where": {"type": "object"}}}}}
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, NOOP]
BODY = ("<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n"
        "</parameter>\n<parameter=temp>\n21.5\n</parameter>\n<parameter=where>\n{\"lat\": 48.9}\n</parameter>\n"
        "</function>\n</tool_call>")
CALL = "<tool_call>\n<function=get_weather>\n" + BODY
ARGUMENTS = {"city": "Paris", "days": 3, "metric": True, "temp": 21.5, "where": {"lat": 48.9}}
MALFORMED = [
    CALL.replace("get_weather", "delete_files"),  # a tool that was not offered
    CALL[:-len("</function>\n</tool_call>")],  # never closed
    "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>",  # Hermes JSON, not this form
    "Text <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n</parameter>\n",
]


@pytest.fixture(scope="module")
def server(qwen35_gguf_path):
    srv = Server(qwen35_gguf_path, max_ctx=MAX_CTX)
    yield srv
    srv.close()


def metadata(reader: GGUFReader) -> dict:
    """A GGUF's key-value metadata (not the header's counts)."""
    return {key: f.contents() for key, f in reader.fields.items() if not key.startswith("GGUF.")}


def template_ids(server, messages, tools=None) -> list[int]:
    """The prompt ids of the published template's own rendering (not the server's request path), thinking off as
    the server's default is."""
    return server.tok.encode(render(messages, QWEN35, enable_thinking=False, tools=tools))


def forced(server, oai, text, **kwargs):
    """The server's answer (the first choice) to a chat request whose reply is forced to `text`."""
    server.gated.script = server.tok.encode(text)
    return oai.chat.completions.create(model="tiny", messages=USER, max_tokens=300, **kwargs).choices[0]


def streamed(chunks) -> dict:
    """What a stream of chat chunks adds up to: reasoning, content, the calls (id, name, arguments as sent) and the
    finish reason; each call's first delta carries its id, type and name and empty arguments, later ones only
    arguments."""
    out = {"reasoning": "", "content": "", "calls": [], "finish": None}
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        out["reasoning"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
        out["content"] += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.id is not None:
                assert call.index == len(out["calls"]) and call.type == "function" and call.function.arguments == ""
                out["calls"].append([call.id, call.function.name, ""])
            else:
                assert call.index == len(out["calls"]) - 1 and call.function.name is None
                out["calls"][-1][2] += call.function.arguments
        out["finish"] = choice.finish_reason or out["finish"]
    return out


def forced_stream(server, oai, text, **kwargs) -> dict:
    server.gated.script = server.tok.encode(text)
    return streamed(oai.chat.completions.create(model="tiny", messages=USER, max_tokens=300, stream=True, **kwargs))


def test_tools_are_rendered_into_the_prompt_and_the_reply_is_the_engines(server, oai):
    text = render(USER, QWEN35, tools=TOOLS)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(NOOP) + "\n</tools>" in text and "<tool_call>" in text
    ids = template_ids(server, USER, TOOLS)
    assert len(ids) > len(template_ids(server, USER)) + 400
    want, tokens = server.expect(ids, 8)
    for choice in ("auto", "none"):  # 'none' renders the tools too (vLLM's default) and parses nothing
        r = oai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=8)
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(tokens)
        assert r.choices[0].message.content == want and r.choices[0].message.tool_calls is None
        s = streamed(oai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=choice,
                                                 max_tokens=8, stream=True))
        assert s["content"] == want and s["calls"] == [] and s["finish"] == r.choices[0].finish_reason


def test_the_template_is_the_gguf_s_own(server, claude, qwen35_gguf_path, tiny_gguf_path):
    """The test model is the fixture with the published template as its `tokenizer.chat_template`, every other key and
    tensor as stored; the server, given no template, reads it from the file: a tools request's prompt, as each API
    builds it, is exactly the template's own rendering."""
    fixture, copy = GGUFReader(tiny_gguf_path), GGUFReader(qwen35_gguf_path)
    assert metadata(copy) == {**metadata(fixture), "tokenizer.chat_template": QWEN35}
    assert [(t.name, t.tensor_type, t.data.tobytes()) for t in copy.tensors] == \
        [(t.name, t.tensor_type, t.data.tobytes()) for t in fixture.tensors]
    assert server.settings.tokenizer.chat_template == QWEN35 != load_tokenizer(tiny_gguf_path).chat_template
    ids = template_ids(server, USER, TOOLS)
    assert openai_api.parse_chat({"messages": USER, "tools": TOOLS}, server.settings).ids == ids
    assert anthropic_api.prompt_ids({"messages": USER, "tools": CLAUDE_TOOLS}, server.settings) == ids
    assert claude.messages.count_tokens(model="tiny", messages=USER, tools=CLAUDE_TOOLS).input_tokens == len(ids)


def test_a_gguf_without_a_template_gets_chatml_which_renders_no_tools(tiny_gguf_path, tmp_path):
    """The documented fallback (README, chat_template.py): ChatML, with the empty think block of thinking off; tools,
    which ChatML would drop, get a 400 in both APIs."""
    path = tmp_path / "no-template.gguf"
    rewrite_gguf(tiny_gguf_path, path, drop_keys=["tokenizer.chat_template"])
    settings = Settings(load_tokenizer(path), "tiny", MAX_CTX, 1024)
    assert settings.tokenizer.chat_template is None
    text = f"<|im_start|>user\n{USER[0]['content']}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert openai_api.parse_chat({"messages": USER}, settings).ids == settings.tokenizer.encode(text)
    for api, body in [(openai_api.parse_chat, {"messages": USER, "tools": TOOLS}),
                      (anthropic_api.prompt_ids, {"messages": USER, "tools": CLAUDE_TOOLS})]:
        with pytest.raises(BadRequest, match="'tools' need a chat template that renders them") as e:
            api(body, settings)
        assert e.value.param == "tools" and e.value.status == 400


def test_a_forced_call_comes_back_as_tool_calls_with_typed_arguments(server, oai):
    choice = forced(server, oai, "Let me look it up.\n\n" + CALL, tools=TOOLS)
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look it up."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == len("call_") + 24
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS
    choice = forced(server, oai, CALL + "\n" + CALL.replace("Paris", "Rome"), tools=TOOLS)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [json.loads(c.function.arguments)["city"] for c in choice.message.tool_calls] == ["Paris", "Rome"]
    assert len({c.id for c in choice.message.tool_calls}) == 2


def test_a_streamed_call_sends_its_name_then_its_arguments_in_pieces(server, oai):
    text = "Let me look it up.\n\n" + CALL + "\n<tool_call>\n<function=noop>\n</function>\n</tool_call>"
    server.gated.script = server.tok.encode(text)
    chunks = list(oai.chat.completions.create(model="tiny", messages=USER, max_tokens=300, stream=True, tools=TOOLS))
    s = streamed(chunks)
    assert s["content"] == "Let me look it up." and s["finish"] == "tool_calls" and s["reasoning"] == ""
    assert [(name, json.loads(arguments)) for _, name, arguments in s["calls"]] == [("get_weather", ARGUMENTS),
                                                                                   ("noop", {})]
    whole = forced(server, oai, text, tools=TOOLS)
    assert [c.function.arguments for c in whole.message.tool_calls] == [c[2] for c in s["calls"]]
    pieces = [c.choices[0].delta.tool_calls[0].function.arguments for c in chunks
              if c.choices and c.choices[0].delta.tool_calls and c.choices[0].delta.tool_calls[0].index == 0]
    assert pieces == ["", '{"city": "Paris"', ', "days": 3', ', "metric": true', ', "temp": 21.5',
                      ', "where": {"lat": 48.9}', "}"]
    assert s["calls"][0][0].startswith("call_") and s["calls"][0][0] != s["calls"][1][0]


@pytest.mark.parametrize("text, kwargs", [(CALL, {"tools": TOOLS, "tool_choice": "none"}),  # not parsed
                                          (CALL, {})]  # no tools offered
                         + [(text, {"tools": TOOLS}) for text in MALFORMED])
def test_a_reply_that_is_not_a_call_of_an_offered_tool_is_plain_content(server, oai, text, kwargs):
    choice = forced(server, oai, text, **kwargs)
    assert choice.message.content == text and choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert forced_stream(server, oai, text, **kwargs) == {"reasoning": "", "content": text, "calls": [],
                                                          "finish": "stop"}


def test_text_after_the_calls_is_content_after_them(server, oai):
    text = "Sure.\n\n" + CALL + " and then some text"
    choice = forced(server, oai, text, tools=TOOLS)
    assert choice.message.content == "Sure. and then some text" and choice.finish_reason == "tool_calls"
    s = forced_stream(server, oai, text, tools=TOOLS)
    assert s["content"] == "Sure. and then some text" and json.loads(s["calls"][0][2]) == ARGUMENTS


def test_a_tool_round_trip_is_rendered_by_the_template(server, oai):
    """The call the server returned, sent back with its result, renders as the template renders that conversation
    (the arguments as an object), and the answer is the engine's on those ids."""
    call = forced(server, oai, CALL, tools=TOOLS).message
    sent = USER + [call.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.tool_calls[0].id,
                                                        "content": '{"temp": 21}'}]
    as_template = USER + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": '{"temp": 21}'}]
    text = render(as_template, QWEN35, tools=TOOLS)
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=temp>\n21.5\n</parameter>\n"
            "<parameter=where>\n{\"lat\": 48.9}\n</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n"
            "<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n") in text
    ids = template_ids(server, as_template, TOOLS)
    want, _ = server.expect(ids, 8)
    r = oai.chat.completions.create(model="tiny", messages=sent, tools=TOOLS, max_tokens=8)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == want


@pytest.mark.parametrize("choice, prefix", [("required", FORCED_CALL),
                                            ({"type": "function", "function": {"name": "get_weather"}},
                                             FORCED_CALL + "get_weather>\n")])
def test_tool_choice_required_or_named_begins_the_reply_with_a_call(server, oai, choice, prefix):
    text = render(USER, QWEN35, enable_thinking=False, tools=TOOLS) + prefix
    ids = server.tok.encode(text)
    want, tokens = server.expect(ids, 6)  # the model left alone goes on from inside the call
    r = oai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=6)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(tokens)
    assert r.choices[0].message.content == prefix + want and r.choices[0].message.tool_calls is None
    rest = CALL[len(prefix):]  # what a model that follows the forced start writes
    for thinking in (None, False):  # the server's default (off), or off as asked
        extra = {"chat_template_kwargs": {"enable_thinking": thinking}} if thinking is not None else None
        got = forced(server, oai, rest, tools=TOOLS, tool_choice=choice, extra_body=extra)
        assert got.finish_reason == "tool_calls" and json.loads(got.message.tool_calls[0].function.arguments) == \
            ARGUMENTS
        s = forced_stream(server, oai, rest, tools=TOOLS, tool_choice=choice)
        assert s["content"] == "" and s["calls"][0][1:] == ["get_weather", got.message.tool_calls[0].function.arguments]


def test_parallel_tool_calls_false_keeps_the_first_call(server, oai):
    text = CALL + "\n" + CALL.replace("Paris", "Rome")
    (call,) = forced(server, oai, text, tools=TOOLS, parallel_tool_calls=False).message.tool_calls
    assert json.loads(call.function.arguments)["city"] == "Paris"
    s = forced_stream(server, oai, text, tools=TOOLS, parallel_tool_calls=False)
    assert len(s["calls"]) == 1 and json.loads(s["calls"][0][2])["city"] == "Paris"


@pytest.mark.parametrize("body, param, message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "delete_files"}}}, "tool_choice",
     "names the function 'delete_files', which is not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools to call"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice",
     "a named 'tool_choice' must be"),
    ({"tools": TOOLS, "tool_choice": "required", "chat_template_kwargs": {"enable_thinking": True}}, "tool_choice",
     "thinking cannot be on"),
    ({"tools": TOOLS, "tool_choice": "required", "reasoning_effort": "low"}, "tool_choice", "thinking cannot be on"),
    ({"tools": TOOLS, "tool_choice": "required", "messages": USER + [{"role": "assistant", "content": "Sure"}]},
     "messages", "cannot continue a last assistant message"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be 'auto', 'none'"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "must be a boolean"),
    ({"tools": {"get_weather": {}}}, "tools", "must be an array"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0] must be an object of type 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "tools[0].function.name"),
    ({"tools": TOOLS + TOOLS}, "tools", "names an earlier tool"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools", "JSON schema object"),
    ({"functions": [{"name": "f"}]}, "functions", "send 'tools'"),
    ({"messages": USER + [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id must be a string"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}, {"role": "user", "content": "x",
                                                                        "tool_calls": [{}]}]},
     "messages", "only an assistant message makes tool calls"),
    ({"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}, {"role": "user", "content": "x"}]},
     "messages", "arguments must be a JSON object"),
    ({"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages",
     "send their results"),
    ({"messages": [{"role": "tool", "tool_call_id": "c", "content": "x"}]}, "messages", "No user query found"),
])
def test_bad_tool_requests_get_a_400_naming_the_field(server, body, param, message):
    status, err = server.post("/v1/chat/completions", {"messages": USER, "max_tokens": 4, **body})
    assert status == 400 and err["error"]["param"] == param and message in err["error"]["message"], err


def test_the_server_still_serves_after_the_refusals(server, oai):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        oai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=4,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    ids = template_ids(server, USER)
    r = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=4)
    assert r.choices[0].message.content == server.expect(ids, 4)[0]


# The same tools in Anthropic's shape; the server hands them to the template in the form above.
CLAUDE_TOOLS = [{"name": "get_weather", "description": "The weather of a city",
                 "input_schema": WEATHER["function"]["parameters"]},
                {"name": "noop", "input_schema": NOOP["function"]["parameters"]}]


def claude_forced(server, claude, text, **kwargs):
    server.gated.script = server.tok.encode(text)
    return claude.messages.create(model="tiny", messages=USER, max_tokens=300, **kwargs)


def claude_stream(server, claude, text, **kwargs):
    """(the events, the message the client's stream helper adds them up to) of a forced streamed reply."""
    server.gated.script = server.tok.encode(text)
    with claude.messages.stream(model="tiny", messages=USER, max_tokens=300, **kwargs) as stream:
        events = list(stream)
        return events, stream.get_final_message()


def blocks(message) -> list:
    """A message's content blocks without their ids, in order."""
    return [b.model_dump(exclude={"id"}) for b in message.content]


def test_anthropic_tools_are_rendered_as_the_template_renders_them(server, claude):
    assert claude.messages.count_tokens(model="tiny", messages=USER, tools=CLAUDE_TOOLS).input_tokens == len(
        template_ids(server, USER, TOOLS))
    result = [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": '{"temp": 21}'}]},
              {"type": "text", "text": "And tomorrow?"}]
    sent = USER + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "The user wants weather.", "signature": ""},
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": result}]
    as_template = USER + [{"role": "assistant", "content": "Looking.", "reasoning_content": "The user wants weather.",
                           "tool_calls": [{"id": "toolu_1", "type": "function",
                                           "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                          {"role": "tool", "tool_call_id": "toolu_1", "content": '{"temp": 21}'},
                          {"role": "user", "content": "And tomorrow?"}]
    ids = template_ids(server, as_template, TOOLS)
    assert claude.messages.count_tokens(model="tiny", messages=sent, tools=CLAUDE_TOOLS).input_tokens == len(ids)
    want, _ = server.expect(ids, 6)
    m = claude.messages.create(model="tiny", messages=sent, tools=CLAUDE_TOOLS, max_tokens=6)
    assert m.content[0].text == want and m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids)


def test_an_anthropic_call_is_a_tool_use_block_streamed_as_input_json(server, claude):
    text = "Let me look it up.\n\n" + CALL + "\n<tool_call>\n<function=noop>\n</function>\n</tool_call>"
    m = claude_forced(server, claude, text, tools=CLAUDE_TOOLS)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["text", "tool_use", "tool_use"]
    assert m.content[0].text == "Let me look it up." and m.content[1].input == ARGUMENTS and m.content[2].input == {}
    assert m.content[1].id.startswith("toolu_") and m.content[1].id != m.content[2].id
    events, final = claude_stream(server, claude, text, tools=CLAUDE_TOOLS)
    assert blocks(final) == blocks(m) and final.stop_reason == "tool_use"
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in starts] == [
        ("text", None, None), ("tool_use", "get_weather", {}), ("tool_use", "noop", {})]
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta" and e.index == 1]
    assert json.loads("".join(pieces)) == ARGUMENTS and len(pieces) == len(ARGUMENTS) + 1


def test_an_anthropic_tool_round_trip(server, claude):
    m = claude_forced(server, claude, CALL, tools=CLAUDE_TOOLS)
    (use,) = m.content
    history = USER + [{"role": "assistant", "content": [use.model_dump()]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21"}]}]
    ids = template_ids(server, USER + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                           "arguments": ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "21"}], TOOLS)
    want, _ = server.expect(ids, 6)
    r = claude.messages.create(model="tiny", messages=history, tools=CLAUDE_TOOLS, max_tokens=6)
    assert r.content[0].text == want and r.usage.input_tokens + r.usage.cache_read_input_tokens == len(ids)


@pytest.mark.parametrize("text, kwargs", [(CALL, {"tools": CLAUDE_TOOLS, "tool_choice": {"type": "none"}}), (CALL, {})]
                         + [(text, {"tools": CLAUDE_TOOLS}) for text in MALFORMED])
def test_an_anthropic_reply_that_is_not_a_call_is_plain_text(server, claude, text, kwargs):
    m = claude_forced(server, claude, text, **kwargs)
    assert blocks(m) == [{"type": "text", "text": text, "citations": None}] and m.stop_reason == "end_turn"
    _, final = claude_stream(server, claude, text, **kwargs)
    assert blocks(final) == blocks(m) and final.stop_reason == "end_turn"


@pytest.mark.parametrize("choice, prefix", [({"type": "any"}, FORCED_CALL),
                                            ({"type": "tool", "name": "get_weather"}, FORCED_CALL + "get_weather>\n")])
def test_anthropic_tool_choice_any_or_tool_begins_the_reply_with_a_call(server, claude, choice, prefix):
    ids = server.tok.encode(render(USER, QWEN35, enable_thinking=False, tools=TOOLS) + prefix)
    assert claude.messages.count_tokens(model="tiny", messages=USER, tools=CLAUDE_TOOLS,
                                        tool_choice=choice).input_tokens == len(ids)
    m = claude_forced(server, claude, CALL[len(prefix):], tools=CLAUDE_TOOLS, tool_choice=choice)
    assert m.stop_reason == "tool_use" and m.content[0].input == ARGUMENTS
    two = CALL[len(prefix):] + "\n" + CALL.replace("Paris", "Rome")
    m = claude_forced(server, claude, two, tools=CLAUDE_TOOLS, tool_choice={**choice, "disable_parallel_tool_use": True})
    assert [b.input["city"] for b in m.content] == ["Paris"]
    _, final = claude_stream(server, claude, two, tools=CLAUDE_TOOLS, tool_choice={**choice,
                                                                                   "disable_parallel_tool_use": True})
    assert blocks(final) == blocks(m)


@pytest.mark.parametrize("body, message", [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools are not implemented"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema must be a JSON schema object"),
    ({"tools": CLAUDE_TOOLS + CLAUDE_TOOLS}, "names an earlier tool"),
    ({"tools": CLAUDE_TOOLS, "tool_choice": {"type": "tool", "name": "delete_files"}}, "not among the tools"),
    ({"tools": CLAUDE_TOOLS, "tool_choice": {"type": "tool"}}, "needs the tool's name"),
    ({"tools": CLAUDE_TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice.type must be one of"),
    ({"tool_choice": {"type": "any"}}, "needs tools to call"),
    ({"tools": CLAUDE_TOOLS, "tool_choice": {"type": "any"}, "thinking": {"type": "enabled", "budget_tokens": 2}},
     "thinking may not be enabled when tool_choice forces tool use"),
    ({"messages": USER + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather",
                                                             "input": {}}]}], "tools": CLAUDE_TOOLS},
     "send their results"),
    ({"messages": USER + [{"role": "assistant", "content": [{"type": "tool_use", "name": "get_weather",
                                                             "input": "{}"}]}, USER[0]]}, "must have a name and an input"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}, "tool_use_id must be"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "only text content"),
    ({"messages": USER + [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}, USER[0]]},
     "only text, thinking and tool_use blocks"),
])
def test_bad_anthropic_tool_requests_get_a_400(server, body, message):
    status, err = server.post("/v1/messages", {"messages": USER, "max_tokens": 4, **body})
    assert status == 400 and err["type"] == "error" and message in err["error"]["message"], err
