"""Tool calls through /v1/chat/completions with the `openai` client (issue 44, item 1, non-streaming): tools and
earlier calls and results rendered into the prompt by the published Qwen3.5 template, a reply's Qwen3-Coder XML
returned as `tool_calls`, `tool_choice: none`, malformed XML as plain content, and the refusals.

The random fixture model does not write tool calls, so the replies that call tools are forced: the test server's
engine emits a given token script instead of the model's choice (test_server.GatedEngine.script), and everything
after the engine (detokenizing, parsing, the response) runs as it does for the model."""

import json

import openai
import pytest

from conftest import FIXTURES
from dflash_jax.chat_template import render
from test_server import USER, Server, oai  # noqa: F401 (a fixture, on this module's server)

QWEN35 = (FIXTURES / "templates" / "qwen3.5.jinja").read_text()
MAX_CTX = 1024  # the template's tool instructions alone are about 470 tokens of the fixture's vocabulary
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "temp": {"type": "number"}, "where": {"type": "object"}}}}}
TOOLS = [WEATHER]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=temp>\n21.5\n</parameter>\n"
        "<parameter=where>\n{\"lat\": 48.9}\n</parameter>\n</function>\n</tool_call>")
ARGUMENTS = {"city": "Paris", "days": 3, "metric": True, "temp": 21.5, "where": {"lat": 48.9}}


@pytest.fixture(scope="module")
def server(tiny_gguf_path):
    srv = Server(tiny_gguf_path, chat_template=QWEN35, max_ctx=MAX_CTX)
    yield srv
    srv.close()


def template_ids(server, messages, tools=None) -> list[int]:
    """The prompt ids of the published template's own rendering (not the server's request path), thinking off as
    the server's default is."""
    return server.tok.encode(render(messages, QWEN35, enable_thinking=False, tools=tools))


def forced(server, oai, text, **kwargs):
    """The server's answer to a chat request whose reply is forced to `text`."""
    server.gated.script = server.tok.encode(text)
    return oai.chat.completions.create(model="tiny", messages=USER, max_tokens=400, **kwargs).choices[0]


def test_tools_are_rendered_into_the_prompt_and_the_reply_is_the_engines(server, oai):
    text = render(USER, QWEN35, tools=TOOLS)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text and "<tool_call>" in text
    ids = template_ids(server, USER, TOOLS)
    assert len(ids) > len(template_ids(server, USER)) + 400
    want, tokens = server.expect(ids, 8)
    for choice in ("auto", "none"):  # 'none' renders the tools too (vLLM's default) and parses nothing
        r = oai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=8)
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(tokens)
        assert r.choices[0].message.content == want and r.choices[0].message.tool_calls is None


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


@pytest.mark.parametrize("text, kwargs", [
    (CALL, {"tools": TOOLS, "tool_choice": "none"}),  # not parsed: the XML is the text
    (CALL, {}),  # no tools offered
    (CALL.replace("get_weather", "delete_files"), {"tools": TOOLS}),  # a tool that was not offered
    (CALL[:-len("</function>\n</tool_call>")], {"tools": TOOLS}),  # never closed
    ("<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>", {"tools": TOOLS}),  # Hermes JSON, not this form
])
def test_a_reply_that_is_not_a_call_of_an_offered_tool_is_plain_content(server, oai, text, kwargs):
    choice = forced(server, oai, text, **kwargs)
    assert choice.message.content == text and choice.message.tool_calls is None and choice.finish_reason == "stop"


def test_a_tool_result_follow_up_is_rendered_by_the_template_and_answered(server, oai):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}
    sent = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    as_template = USER + [{"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    text = render(as_template, QWEN35, tools=TOOLS)
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n"
            "</tool_response><|im_end|>\n") in text
    ids = template_ids(server, as_template, TOOLS)
    want, _ = server.expect(ids, 8)
    r = oai.chat.completions.create(model="tiny", messages=sent, tools=TOOLS, max_tokens=8)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == want


@pytest.mark.parametrize("body, param, message", [
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice", "not implemented yet"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice",
     "not implemented yet"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be 'auto', 'none'"),
    ({"tools": TOOLS, "stream": True}, "stream", "streaming a reply that may call tools"),
    ({"tools": TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls", "not implemented"),
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
    with pytest.raises(openai.BadRequestError, match="not implemented yet"):
        oai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=4)
    ids = template_ids(server, USER)
    r = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=4)
    assert r.choices[0].message.content == server.expect(ids, 4)[0]
