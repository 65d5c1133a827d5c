"""POST /v1/responses with the `openai` client (issue 44, item 3): text and item input rendered by the published Qwen3.5
template as the equivalent chat, replies equal to the engine's, streaming (raw events and the `responses.stream`
helper), usage, max_output_tokens, reasoning items, a function-call round trip, forced calls (tool_choice required or
named), one call (parallel_tool_calls false), streamed items equal to the whole reply's, and the refusals.

Replies that reason or call tools are forced, as in test_server_tools.py: the test engine emits a given token script
in place of the model's choice (test_server.GatedEngine.script); everything after it runs as it does for the model."""

import json
import re

import openai
import pytest

from dflash_jax.chat_template import render
from dflash_jax.engine.sampling import SamplingParams
from dflash_jax.server.tool_use import FORCED_CALL
from test_server import USER, Server, oai  # noqa: F401 (a fixture, on this module's server)
from test_server_tools import ARGUMENTS, CALL, MAX_CTX, QWEN35, WEATHER

TOOLS = [{"type": "function", **WEATHER["function"], "strict": False}]  # the Responses API's flat shape
PROMPT = USER[0]["content"]


@pytest.fixture(scope="module")
def server(qwen35_gguf_path):
    srv = Server(qwen35_gguf_path, max_ctx=MAX_CTX)
    yield srv
    srv.close()


def template_text(messages, tools=None, thinking=False) -> str:
    """The published template's own rendering of the equivalent chat (not the server's request path)."""
    return render(messages, QWEN35, enable_thinking=thinking, tools=tools and [WEATHER])


def forced(server, oai, text, **kwargs):
    """The server's response to a request whose reply is forced to `text`."""
    server.gated.script = server.tok.encode(text)
    return oai.responses.create(model="tiny", input=PROMPT, max_output_tokens=400, **kwargs)


def events_of(server, oai, text, **kwargs) -> list:
    """The raw stream events of a request whose reply is forced to `text`."""
    server.gated.script = server.tok.encode(text)
    return list(oai.responses.create(model="tiny", input=PROMPT, max_output_tokens=400, stream=True, **kwargs))


def check_usage(usage, ids, tokens, reasoning=0):
    assert (usage.input_tokens, usage.output_tokens) == (len(ids), len(tokens))
    assert usage.total_tokens == len(ids) + len(tokens)
    assert usage.input_tokens_details.cached_tokens <= len(ids)
    assert usage.output_tokens_details.reasoning_tokens == reasoning


def test_text_input_is_the_chat_of_one_user_message_and_the_reply_the_engines(server, oai):
    ids = server.tok.encode(template_text(USER))
    want, tokens = server.expect(ids, 12)
    assert tokens[-1] not in server.tok.stop_ids  # cut off: the response is incomplete
    r = oai.responses.create(model="tiny", input=PROMPT, max_output_tokens=12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.status == "incomplete" and message.content[0].type == "output_text"
    assert message.content[0].annotations == [] and r.output_text == want
    check_usage(r.usage, ids, tokens)
    assert r.temperature == 0 and r.max_output_tokens == 12 and r.tools == [] and r.tool_choice == "auto"
    short = forced(server, oai, "Hello there.")  # ended by a stop token: completed
    assert short.status == "completed" and short.incomplete_details is None and short.output_text == "Hello there."
    assert short.output[0].status == "completed" and short.usage.output_tokens == len(server.tok.encode(
        "Hello there.")) + 1


def test_items_with_instructions_render_as_the_equivalent_chat(server, oai):
    items = [{"role": "developer", "content": "Answer in Python."},
             {"role": "user", "content": [{"type": "input_text", "text": "def fib"}, {"type": "input_text",
                                                                                      "text": "(n):"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "    pass"}]},
             {"role": "user", "content": "Again."}]
    chat = [{"role": "system", "content": "Be brief.\n\nAnswer in Python."},
            {"role": "user", "content": "def fib\n(n):"}, {"role": "assistant", "content": "    pass"},
            {"role": "user", "content": "Again."}]
    ids = server.tok.encode(template_text(chat))
    want, tokens = server.expect(ids, 8)
    r = oai.responses.create(model="tiny", instructions="Be brief.", input=items, max_output_tokens=8)
    assert r.output_text == want and r.instructions == "Be brief."
    check_usage(r.usage, ids, tokens)


def test_the_next_turn_continues_the_state_of_the_last(server, oai):
    """An agent's next request sends the last response's output back with a new message: the worker goes on from
    the last request's state where the two prompts part (as for chat, test_server_faults), and the answer is the
    engine's on the whole conversation."""
    first = oai.responses.create(model="tiny", instructions="Be brief.", input=PROMPT, max_output_tokens=4)
    sent = [{"role": "user", "content": PROMPT}, *first.output, {"role": "user", "content": "And?"}]
    second = oai.responses.create(model="tiny", instructions="Be brief.", input=sent, max_output_tokens=4)
    system = [{"role": "system", "content": "Be brief."}]
    ids1 = server.tok.encode(template_text(system + USER))
    ids2 = server.tok.encode(template_text(system + USER + [{"role": "assistant", "content": first.output_text},
                                                            {"role": "user", "content": "And?"}]))
    assert first.output_text == server.expect(ids1, 4)[0] and second.output_text == server.expect(ids2, 4)[0]
    shared = next(i for i, (a, b) in enumerate(zip(ids1, ids2)) if a != b)
    assert second.usage.input_tokens_details.cached_tokens == shared > len(server.tok.encode("Be brief."))


def test_streaming_events_come_in_order_and_carry_the_engines_text(server, oai):
    ids = server.tok.encode(template_text(USER))
    want, tokens = server.expect(ids, 12)
    events = list(oai.responses.create(model="tiny", input=PROMPT, max_output_tokens=12, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * deltas
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.incomplete"]) and deltas >= 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == want
    assert final.output[0].id == events[2].item.id and events[-2].item.content[0].text == want
    check_usage(final.usage, ids, tokens)
    server.gated.script = server.tok.encode("Hello there.")  # ended by a stop token: response.completed
    with oai.responses.stream(model="tiny", input=PROMPT, max_output_tokens=40) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        done = stream.get_final_response()
    assert "".join(texts) == done.output_text == "Hello there." and done.status == "completed"


def test_a_sampled_response_equals_the_engines_for_its_seed(server, oai):
    ids = server.tok.encode(template_text(USER))
    params = SamplingParams(temperature=1.2, top_p=0.95, seed=1234)
    want, tokens = server.expect(ids, 12, params)
    assert want != server.expect(ids, 12)[0]
    r = oai.responses.with_raw_response.create(model="tiny", input=PROMPT, max_output_tokens=12, temperature=1.2,
                                               top_p=0.95, extra_body={"seed": 1234})
    assert r.headers["x-dflash-seed"] == "1234" and r.parse().output_text == want
    assert (r.parse().temperature, r.parse().top_p) == (1.2, 0.95)


def test_a_forced_call_is_a_function_call_item_and_its_output_goes_back_through_the_template(server, oai):
    r = forced(server, oai, "Let me look it up.\n\n" + CALL, tools=TOOLS)
    assert r.status == "completed"
    message, call = r.output
    assert message.type == "message" and message.content[0].text == "Let me look it up."
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and json.loads(call.arguments) == ARGUMENTS
    sent = [{"role": "user", "content": PROMPT}, *r.output,
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}]
    chat = USER + [{"role": "assistant", "content": "Let me look it up.", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 21}'}]
    text = template_text(chat, tools=True)
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in text and "<parameter=days>\n3\n</parameter>" in text
    ids = server.tok.encode(text)
    want, tokens = server.expect(ids, 8)
    r = oai.responses.create(model="tiny", input=sent, tools=TOOLS, max_output_tokens=8)
    assert r.output_text == want
    check_usage(r.usage, ids, tokens)
    r = forced(server, oai, CALL + "\n" + CALL.replace("Paris", "Rome"), tools=TOOLS)  # two calls, no text
    assert [item.type for item in r.output] == ["function_call"] * 2
    assert [json.loads(c.arguments)["city"] for c in r.output] == ["Paris", "Rome"]


def test_a_streamed_call_comes_as_one_function_call_item_after_the_text(server, oai):
    events = events_of(server, oai, "Let me look it up.\n\n" + CALL, tools=TOOLS)
    kinds = [e.type for e in events]
    at = kinds.index("response.output_text.done")
    pieces = len(ARGUMENTS) + 1  # `{` with the first parameter, each further one, `}`: as chat streams them
    assert kinds[at:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.output_item.added"] + ["response.function_call_arguments.delta"] * pieces + [
                          "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Let me look it up."
    added, deltas, (done, item) = events[at + 3], events[at + 4:at + 4 + pieces], events[at + 4 + pieces:-1]
    assert added.item.arguments == "" and added.item.call_id == item.item.call_id and added.output_index == 1
    assert "".join(d.delta for d in deltas) == done.arguments == item.item.arguments
    assert json.loads(done.arguments) == ARGUMENTS and deltas[0].delta == '{"city": "Paris"'
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"] and final.output[1] == item.item
    server.gated.script = server.tok.encode(CALL)
    with oai.responses.stream(model="tiny", input=PROMPT, tools=TOOLS, max_output_tokens=400) as stream:
        (call,) = stream.get_final_response().output
    assert call.type == "function_call" and json.loads(call.arguments) == ARGUMENTS


@pytest.mark.parametrize("text", [CALL[:-len("</function>\n</tool_call>")],  # never closed
                                  "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>"])  # Hermes JSON
def test_malformed_calls_are_plain_text_streaming_and_not(server, oai, text):
    assert forced(server, oai, "Hmm. " + text, tools=TOOLS).output_text == "Hmm. " + text
    events = events_of(server, oai, "Hmm. " + text, tools=TOOLS)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hmm. " + text
    assert [o.type for o in events[-1].response.output] == ["message"]


def test_a_null_description_or_parameters_is_left_out_on_both_openai_endpoints(server, oai):
    """OpenAI's clients may send them as null (the Responses shape's are nullable): the template gets the tool
    without them."""
    bare = {"name": "noop", "description": None, "parameters": None}
    want = len(server.tok.encode(render(USER, QWEN35, enable_thinking=False,
                                        tools=[{"type": "function", "function": {"name": "noop"}}])))
    r = oai.responses.create(model="tiny", input=PROMPT, tools=[{"type": "function", **bare}], max_output_tokens=1)
    c = oai.chat.completions.create(model="tiny", messages=USER, tools=[{"type": "function", "function": bare}],
                                    max_tokens=1)
    assert r.usage.input_tokens == c.usage.prompt_tokens == want


def test_tool_choice_none_renders_the_tools_and_leaves_the_reply_as_text(server, oai):
    r = forced(server, oai, CALL, tools=TOOLS, tool_choice="none")
    assert r.output_text == CALL and r.usage.input_tokens == len(server.tok.encode(template_text(USER, tools=True)))


@pytest.mark.parametrize("choice, start", [
    ("required", FORCED_CALL), ({"type": "function", "name": "get_weather"}, FORCED_CALL + "get_weather>\n")])
def test_a_required_or_named_tool_choice_forces_the_reply_to_start_a_call(server, oai, choice, start):
    ids = server.tok.encode(template_text(USER, tools=True) + start)
    want, tokens = server.expect(ids, 6)
    r = oai.responses.create(model="tiny", input=PROMPT, tools=TOOLS, tool_choice=choice, max_output_tokens=6)
    assert r.usage.input_tokens == len(ids) and r.output_text == start + want  # unclosed: the text as written
    r = forced(server, oai, CALL[len(start):], tools=TOOLS, tool_choice=choice)
    (call,) = r.output
    assert call.type == "function_call" and json.loads(call.arguments) == ARGUMENTS


def test_parallel_tool_calls_false_keeps_the_first_call(server, oai):
    r = forced(server, oai, CALL + "\n" + CALL.replace("Paris", "Rome"), tools=TOOLS, parallel_tool_calls=False)
    (call,) = r.output
    assert json.loads(call.arguments)["city"] == "Paris" and r.status == "completed" and not r.parallel_tool_calls
    events = events_of(server, oai, CALL + "\n" + CALL, tools=TOOLS, parallel_tool_calls=False)
    assert [o.type for o in events[-1].response.output] == ["function_call"]


def test_reasoning_is_its_own_item_streaming_and_not(server, oai):
    ids = server.tok.encode(template_text(USER, thinking=True))
    assert template_text(USER, thinking=True).endswith("<think>\n")
    want, tokens = server.expect(ids, 6)
    assert "</think>" not in want
    r = oai.responses.create(model="tiny", input=PROMPT, reasoning={"effort": "high"}, max_output_tokens=6)
    (item,) = r.output  # no </think> in 6 tokens: all reasoning
    assert item.type == "reasoning" and item.status == "incomplete" and item.summary == []
    assert item.content[0].type == "reasoning_text" and item.content[0].text == want.strip()
    check_usage(r.usage, ids, tokens, reasoning=len(tokens))
    reply = "\nFirst, the base case.\n</think>\n\nThe answer."
    r = forced(server, oai, reply, reasoning={"effort": "low", "summary": "auto"})
    thought, message = r.output
    assert thought.content[0].text == "First, the base case." and thought.status == "completed"
    assert message.content[0].text == "The answer." and r.reasoning.effort == "low"
    assert r.usage.output_tokens_details.reasoning_tokens == len(server.tok.encode(reply[:reply.index("\n\nThe")]))
    events = events_of(server, oai, reply, reasoning={"effort": "low"})
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "First, the base case."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "The answer."
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]
    assert events[-1].response.output[0].content[0].text == "First, the base case."
    sent = [{"role": "user", "content": PROMPT}, *r.output, {"role": "user", "content": "And?"}]
    chat = USER + [{"role": "assistant", "content": "The answer.", "reasoning_content": "First, the base case."},
                   {"role": "user", "content": "And?"}]
    assert oai.responses.create(model="tiny", input=sent, max_output_tokens=2).usage.input_tokens == len(
        server.tok.encode(template_text(chat)))
    r = oai.responses.create(model="tiny", input=PROMPT, reasoning={"effort": "none"}, max_output_tokens=2)
    assert r.usage.input_tokens == len(server.tok.encode(template_text(USER)))


def items(output) -> list[dict]:
    """Output items less their ids (drawn afresh for every response)."""
    return [{k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")} for item in output]


@pytest.mark.parametrize("text, kwargs, kinds", [
    ("\nFirst.\n</think>\n\nText <tool_ \n\n" + CALL + "\n" + CALL.replace("Paris", "Rome") + "\nDone.",
     {"reasoning": {"effort": "low"}}, ["reasoning", "message", "function_call", "function_call", "message"]),
    ("A thought, never closed </thin", {"reasoning": {"effort": "low"}}, ["reasoning"]),
    ("\nDone.\n</think>\n\n", {"reasoning": {"effort": "low"}}, ["reasoning", "message"]),  # an empty answer
    ("Hmm. " + CALL + "\n" + CALL + "\nAfter.", {"parallel_tool_calls": False}, ["message", "function_call", "message"]),
    ("Hmm. <tool_call>\n<function=get_weather>\n</tool_call>", {}, ["message"]),  # malformed: text
])
def test_a_streamed_response_has_the_items_of_the_whole_one(server, oai, text, kwargs, kinds):
    """The stream's items (reply.py's incremental parser) equal the non-streamed response's (its whole-reply read),
    statuses included: an item that another follows is completed, the last has the response's status."""
    whole = forced(server, oai, text, tools=TOOLS, **kwargs)
    streamed = events_of(server, oai, text, tools=TOOLS, **kwargs)[-1].response
    assert [item.type for item in whole.output] == kinds and items(streamed.output) == items(whole.output)
    assert whole.output[-1].status == ("incomplete" if kinds == ["reasoning"] else "completed")


def test_a_stream_failing_midway_ends_with_response_failed_naming_only_a_request_id(server, oai):
    """An internal error after the first events ends the stream as the OpenAI API ends a failed one: a last
    response.failed event (the same response, status failed, the error naming only a request id), which the SDK's
    stream helper takes in order; the next stream is answered."""
    server.gated.fault = RuntimeError("a secret")
    events = list(oai.responses.create(model="tiny", input=PROMPT, max_output_tokens=12, stream=True))
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "failed", last
    assert re.match("^internal error; request id req_", last.response.error.message), last.response.error
    assert last.response.error.code == "server_error" and "secret" not in last.response.error.message
    assert last.response.id == events[0].response.id and [e.sequence_number for e in events] == list(range(len(events)))
    server.gated.fault = RuntimeError("a secret")
    with oai.responses.stream(model="tiny", input=PROMPT, max_output_tokens=12) as stream:
        assert [e.type for e in stream][-1] == "response.failed"
    events = list(oai.responses.create(model="tiny", input=PROMPT, max_output_tokens=12, stream=True))
    assert events[-1].response.output_text == server.expect(server.tok.encode(template_text(USER)), 12)[0]


@pytest.mark.parametrize("body, param, message", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "responses are not stored"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "responses are not stored"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input", "only message, function_call"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "role must be one of"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0]",
     "only text content"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "c", "output": "x"}]},
     "input", "answers no function_call item"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "get_weather",
                                                    "arguments": "{}"}], "tools": TOOLS}, "input",
     "send their results (function_call_output items)"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                    "arguments": "[1]"}]}, "input", "must be a JSON object"),
    ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"tools": TOOLS + TOOLS}, "tools", "names an earlier tool"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "delete_files"}}, "tool_choice",
     "which is not among the tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice", "allowed tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools to call"),
    ({"tools": TOOLS, "tool_choice": "required", "reasoning": {"effort": "high"}}, "tool_choice",
     "thinking cannot be on"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning", "reasoning.effort must be one of"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text", "structured output"),
    ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"truncation": "auto"}, "truncation", "not implemented"),
    ({"background": True}, "background", "not implemented"),
    ({"max_output_tokens": 2000}, "max_output_tokens", "exceeds the context"),
    ({"temperature": 3}, "temperature", "between 0 and 2"),
    ({"input": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "name": "f",
                                                                "parameters": [1]}]}, "tools", "JSON schema object"),
])
def test_bad_requests_get_a_400_naming_the_field(server, body, param, message):
    status, err = server.post("/v1/responses", {"model": "tiny", "input": PROMPT, "max_output_tokens": 4, **body})
    assert status == 400 and err["error"]["param"] == param and message in err["error"]["message"], err
    assert err["error"]["type"] == "invalid_request_error"


def test_the_client_raises_on_a_refusal_and_the_server_keeps_serving(server, oai):
    with pytest.raises(openai.BadRequestError, match="responses are not stored"):
        oai.responses.create(model="tiny", input=PROMPT, previous_response_id="resp_1", max_output_tokens=4)
    r = oai.responses.create(model="tiny", input=PROMPT, max_output_tokens=4, store=False)
    assert r.output_text == server.expect(server.tok.encode(template_text(USER)), 4)[0]
