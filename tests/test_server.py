"""The server as clients use it: the `openai` and `anthropic` packages against a server on 127.0.0.1 over the
fixture pair, streaming and not, greedy-identical to the engine; bad requests get 4xx and the server keeps serving;
internal errors get a 500 (or an error event) naming only a request id, their traceback logged under it; 20
concurrent clients; a full queue gives 429; a client that goes away mid-request stops its generation."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest
import uvicorn

from conftest import ROOT, TINY
from dflash_jax.engine.sampling import GREEDY, SamplingParams
from dflash_jax.errors import InputError

MAX_CTX = 256
MAX_QUEUE = 20


class GatedEngine:
    """The server's engine behind a gate the test can close, to hold the worker inside a request; a `fault` the test
    sets is raised in the next request, after its first tokens went out; a `script` of token ids the test sets is the
    next request's reply instead of the model's (a forced reply, ended by a stop token, streamed a token at a time; no
    state is kept)."""

    def __init__(self, engine):
        self.engine, self.open, self.entered = engine, threading.Event(), threading.Event()
        self.open.set()
        self.fault = self.script = None

    def generate(self, ids, n_gen, stop_ids, on_tokens, **kwargs):
        self.entered.set()
        self.open.wait()
        fault, self.fault = self.fault, None
        script, self.script = self.script, None
        if script is not None:
            from dflash_jax.engine.generate import Generation
            tokens = (list(script) + [stop_ids[0]])[:n_gen]
            for token in tokens:
                on_tokens([token])
            return Generation(tokens, [len(tokens)], 0, 0.0, 0.0, stopped=tokens[-1] in stop_ids)

        def failing(new):
            on_tokens(new)
            raise fault

        return self.engine.generate(ids, n_gen, stop_ids, on_tokens if fault is None else failing, **kwargs)

    def __getattr__(self, name):  # the rest (snapshot, restore) is the engine's own
        return getattr(self.engine, name)


class FaultyTokenizer:
    """The tokenizer requests are parsed with; a `fault` the test sets is raised by the next encode."""

    def __init__(self, tok):
        self.tok, self.fault = tok, None

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text):
        fault, self.fault = self.fault, None
        if fault is not None:
            raise fault
        return self.tok.encode(text)


class Server:
    """The app over the fixture pair on 127.0.0.1 in a thread; the target may be the fixture's copy with Qwen3.5's
    chat template (conftest.qwen35_gguf_path) in place of its own, which ignores thinking; a prefix cache of
    `prefix_cache_bytes` (0: none)."""

    def __init__(self, tiny_gguf_path, max_queue: int = MAX_QUEUE, max_ctx: int = MAX_CTX,
                 prefix_cache_bytes: int = 0):
        from dflash_jax.config import EngineConfig
        from dflash_jax.engine.generate import Engine
        from dflash_jax.load import load_draft, load_target
        from dflash_jax.server.app import build_app
        from dflash_jax.server.request import Settings
        from dflash_jax.server.worker import Worker
        from dflash_jax.tokenizer import load_tokenizer

        target = load_target(tiny_gguf_path, progress=False)
        draft = load_draft(TINY / "draft-full", target.config, progress=False)
        self.tok = load_tokenizer(tiny_gguf_path)
        self.engine = Engine.from_loaded(target, draft, EngineConfig(mode="ddtree", budget=8, max_ctx=max_ctx))
        self.gated, self.logs = GatedEngine(self.engine), []
        self.worker = Worker(self.gated, self.tok, max_queue, log=self.logs.append,
                             prefix_cache_bytes=prefix_cache_bytes)
        self.parsing = FaultyTokenizer(self.tok)
        self.settings = Settings(self.parsing, "tiny", max_ctx, target.config.vocab_size)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(build_app(self.worker, self.settings), log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs=dict(sockets=[sock]), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        self._expected = {}

    def close(self):
        self.gated.open.set()
        self.uvicorn.should_exit = True
        self.thread.join(10)
        self.worker.close()

    def chat_ids(self, messages):
        from dflash_jax.server.request import chat_prompt
        return chat_prompt(self.settings, messages)

    def expect(self, ids, n, sampling=None):
        """What the engine alone generates (greedy, or sampled as `sampling` says): (text without stop tokens,
        tokens)."""
        key = (tuple(ids), n, sampling)
        if key not in self._expected:
            gen = self.engine.generate(list(ids), n, self.tok.stop_ids, sampling=sampling or GREEDY)
            self._expected[key] = (self.tok.decode(gen.tokens, skip_stops=True), gen.tokens)
        return self._expected[key]

    def send(self, path, body, headers=None):
        """(status, headers, body text) of a raw POST; body may be bytes (sent as is)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        out = resp.status, resp.headers, resp.read().decode()
        conn.close()
        return out

    def post(self, path, body, headers=None):
        """(status, parsed JSON) of a raw POST; body may be bytes (sent as is)."""
        status, _, text = self.send(path, body, headers)
        return status, json.loads(text)

    def wait_log(self, pattern, timeout=60.0):
        deadline = time.monotonic() + timeout
        while not any(pattern in line for line in self.logs):
            assert time.monotonic() < deadline, f"no {pattern!r} in {self.logs[-3:]}"
            time.sleep(0.02)
        return next(line for line in self.logs if pattern in line)


@pytest.fixture(scope="module")
def server(tiny_gguf_path):
    srv = Server(tiny_gguf_path)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


USER = [{"role": "user", "content": "def fibonacci(n):"}]


def test_openai_chat_streaming_and_not_equals_the_engine(server, oai):
    want, tokens = server.expect(server.chat_ids(USER), 16)
    r = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=16)
    assert r.choices[0].message.content == want and r.model == "tiny"
    assert r.choices[0].finish_reason == ("stop" if tokens[-1] in server.tok.stop_ids else "length")
    assert r.usage.prompt_tokens == len(server.chat_ids(USER)) and r.usage.completion_tokens == len(tokens)
    chunks = list(oai.chat.completions.create(model="tiny", messages=USER, max_tokens=16, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want and chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(tokens) and not chunks[-1].choices
    parts = [{"type": "text", "text": "def fibonacci"}, {"type": "text", "text": "(n):"}]  # joined by a newline
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=4)
    assert r.choices[0].message.content == server.expect(server.chat_ids(
        [{"role": "user", "content": "def fibonacci\n(n):"}]), 4)[0]


def test_openai_completions_from_text_and_from_token_ids(server, oai):
    ids = server.tok.encode("import numpy as np\n")
    want, _ = server.expect(ids, 12)
    assert oai.completions.create(model="tiny", prompt="import numpy as np\n", max_tokens=12).choices[0].text == want
    assert oai.completions.create(model="tiny", prompt=ids, max_tokens=12).choices[0].text == want
    stream = oai.completions.create(model="tiny", prompt=ids, max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in stream) == want


def test_anthropic_messages_streaming_and_not_equals_the_engine(server, claude):
    system = "You write Python."
    ids = server.chat_ids([{"role": "system", "content": system}] + USER)
    want, tokens = server.expect(ids, 16)
    m = claude.messages.create(model="tiny", system=system, messages=USER, max_tokens=16)
    assert m.content[0].text == want and m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.output_tokens == len(tokens) and m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids)
    with claude.messages.stream(model="tiny", system=[{"type": "text", "text": system}], messages=USER,
                                max_tokens=16) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want and final.stop_reason == m.stop_reason and final.usage.output_tokens == len(tokens)
    assert claude.messages.count_tokens(model="tiny", system=system, messages=USER).input_tokens == len(ids)


def test_stop_strings_end_the_reply_before_them(server, oai, claude):
    want, _ = server.expect(server.chat_ids(USER), 16)
    stop = want[len(want) // 2:len(want) // 2 + 2]
    cut = want[:want.index(stop)]
    r = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=16, stop=[stop, "never appears"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    stream = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=16, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == cut
    m = claude.messages.create(model="tiny", messages=USER, max_tokens=16, stop_sequences=[stop])
    assert m.content[0].text == cut and m.stop_reason == "stop_sequence" and m.stop_sequence == stop


def test_a_request_extending_the_last_one_continues_its_state(server, oai):
    """Token ids that extend the last request's prompt and completion are not prefilled again; the output is the
    engine's on the whole prompt."""
    prompt = server.tok.encode("class Stack:\n")
    _, tokens = server.expect(prompt, 6)
    first = oai.completions.create(model="tiny", prompt=prompt, max_tokens=6)
    longer = prompt + tokens + server.tok.encode("    def push(self):")
    second = oai.completions.create(model="tiny", prompt=longer, max_tokens=6)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == len(prompt) + len(tokens) - 1  # the completion's last token was pending, not yet committed
    assert second.choices[0].text == server.expect(longer, 6)[0] and first.usage.completion_tokens == 6
    assert f"{len(longer)} prompt tokens ({cached} reused, {len(longer) - cached} prefilled" in server.logs[-1]
    other = oai.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # not an extension: a fresh prefill


def test_a_chat_continues_when_its_reply_tokenizes_back_the_same(server, oai):
    """A conversation sent back with the reply in it reuses the whole state when the reply's text encodes to the
    tokens generated (usual for a trained model; this random one often emits bytes that are not UTF-8), else the
    state of the first turn's prompt (the worker marked it there, where the template's next turn parts from it);
    either way the answer is the engine's on the whole conversation."""
    reused = {}
    for i in range(6):
        question = [{"role": "user", "content": f"Write function number {i}."}]
        first = oai.chat.completions.create(model="tiny", messages=question, max_tokens=6)
        reply = first.choices[0].message.content
        _, tokens = server.expect(server.chat_ids(question), 6)
        history = question + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Again."}]
        second = oai.chat.completions.create(model="tiny", messages=history, max_tokens=6)
        assert second.choices[0].message.content == server.expect(server.chat_ids(history), 6)[0]
        round_trip = server.tok.encode(reply) == [t for t in tokens if t not in server.tok.stop_ids]
        reused[round_trip] = second.usage.prompt_tokens_details.cached_tokens
        n_question = len(server.chat_ids(question))
        assert reused[round_trip] == (n_question + len(tokens) - 1 if round_trip else n_question)
    assert set(reused) == {True, False}  # both cases were seen


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, oai, claude):
    long_text = "word " * 300
    cases = [
        ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/chat/completions", {"model": "tiny"}, 400, "'messages' is required"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "'messages' must be an array"),
        ("/v1/chat/completions", {"messages": []}, 400, "must not be empty"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role must be one of"),
        ("/v1/chat/completions", {"messages": [{"role": "function", "content": "x"}]}, 400, "send 'tool'"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "content is required"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": "many"}, 400, "must be an integer"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, 400, "at least 1"),
        ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools[0] must be"),
        ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
         "need a chat template that renders them"),  # the fixture's own template renders no tools
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}, 400,
         "leaves no room in the context of 256"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 250}, 400, "exceeds the context of 256 tokens"),
        ("/v1/completions", {"prompt": [1, 99999]}, 400, "outside the vocabulary"),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400, "one prompt per request"),
        ("/v1/completions", {"prompt": ""}, 400, "empty"),
        ("/v1/messages", {"messages": USER}, 400, "'max_tokens' is required"),
        ("/v1/messages", {"messages": [{"role": "system", "content": "x"}], "max_tokens": 4}, 400, "role 'user'"),
        ("/v1/messages", {"messages": USER, "max_tokens": 4, "thinking": {"type": "enabled"}}, 400, "thinking"),
        ("/v1/nowhere", {}, 404, "Not Found"),
    ]
    for path, body, status, message in cases:
        got, err = server.post(path, body)
        text = err["error"]["message"]
        assert got == status and message in text, (path, body, got, text)
        assert (err.get("type") == "error") == path.startswith("/v1/messages")  # each API's error shape
    got, err = server.post("/v1/chat/completions", b"x", {"Content-Length": str(64 << 20)})
    assert got == 413
    with pytest.raises(openai.BadRequestError, match="exceeds the context"):
        oai.chat.completions.create(model="tiny", messages=USER, max_tokens=1000)
    with pytest.raises(anthropic.BadRequestError, match="only text content"):
        claude.messages.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAAA"}}]}])
    assert oai.chat.completions.create(model="tiny", messages=USER, max_tokens=16).choices[0].message.content == \
        server.expect(server.chat_ids(USER), 16)[0]
    assert [m.id for m in oai.models.list()] == ["tiny"]


def seed_of(response) -> int:
    """The seed a sampled response reports, checked to be the same in its `x-dflash-seed` header and usage."""
    seed = int(response.headers["x-dflash-seed"])
    assert response.parse().usage.seed == seed
    return seed


def test_a_sampled_request_with_a_seed_is_reproducible_and_equals_the_engine(server, oai):
    """Chat (streaming and not) and completions, with temperature, top_p, top_k, min_p and a seed: the engine's
    sampled text for those SamplingParams, every time, and not the greedy text."""
    ids = server.chat_ids(USER)
    params = SamplingParams(temperature=1.2, top_p=0.95, top_k=50, seed=1234)
    want, tokens = server.expect(ids, 12, params)
    assert want != server.expect(ids, 12)[0]  # the test sees whether sampling happened
    for _ in range(2):
        r = oai.chat.completions.with_raw_response.create(model="tiny", messages=USER, max_tokens=12,
                                                          temperature=1.2, top_p=0.95, seed=1234,
                                                          extra_body={"top_k": 50})
        assert r.parse().choices[0].message.content == want and seed_of(r) == 1234
        assert r.parse().usage.completion_tokens == len(tokens)
    with oai.chat.completions.with_streaming_response.create(
            model="tiny", messages=USER, max_tokens=12, temperature=1.2, top_p=0.95, seed=1234,
            extra_body={"top_k": 50}, stream=True, stream_options={"include_usage": True}) as r:
        chunks = list(r.parse())
        assert r.headers["x-dflash-seed"] == "1234"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.seed == 1234
    prompt = server.tok.encode("import numpy as np\n")
    params = SamplingParams(temperature=0.9, min_p=0.05, seed=77)
    want = server.expect(prompt, 10, params)[0]
    assert want != server.expect(prompt, 10)[0]
    r = oai.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0.9, seed=77,
                               extra_body={"min_p": 0.05})
    assert r.choices[0].text == want and r.usage.seed == 77


def test_a_request_without_a_seed_reports_the_one_it_drew(server, oai):
    """Two unseeded requests draw different seeds; each text is the engine's for its seed, and sending that seed
    back gives the same text. A greedy response reports no seed."""
    ids = server.chat_ids(USER)
    drawn = []
    for _ in range(2):
        r = oai.chat.completions.with_raw_response.create(model="tiny", messages=USER, max_tokens=10, temperature=1)
        seed, text = seed_of(r), r.parse().choices[0].message.content
        assert text == server.expect(ids, 10, SamplingParams(temperature=1.0, seed=seed))[0]
        again = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=10, temperature=1, seed=seed)
        assert again.choices[0].message.content == text
        drawn.append(seed)
    assert drawn[0] != drawn[1]
    r = oai.chat.completions.with_raw_response.create(model="tiny", messages=USER, max_tokens=4, seed=5)
    assert "x-dflash-seed" not in r.headers and r.parse().usage.model_extra.get("seed") is None


def test_n_choices_are_sampled_with_consecutive_seeds(server, oai):
    prompt = server.tok.encode("def add(a, b):")
    r = oai.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, n=2)
    seed, body = seed_of(r), r.parse()
    wants = [server.expect(prompt, 8, SamplingParams(temperature=1.0, seed=seed + i)) for i in range(2)]
    assert [c.text for c in body.choices] == [w[0] for w in wants] and [c.index for c in body.choices] == [0, 1]
    assert wants[0][0] != wants[1][0]
    assert body.usage.completion_tokens == sum(len(w[1]) for w in wants)
    assert body.usage.prompt_tokens == len(prompt)
    chat = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0.8, seed=9, n=3)
    assert [c.message.content for c in chat.choices] == \
        [server.expect(server.chat_ids(USER), 6, SamplingParams(temperature=0.8, seed=9 + i))[0] for i in range(3)]
    greedy = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=6, n=2)
    assert [c.message.content for c in greedy.choices] == [server.expect(server.chat_ids(USER), 6)[0]] * 2


def test_an_anthropic_request_samples_with_temperature_and_top_k(server, claude):
    """The anthropic package (2.x) has no sampling arguments any more: they go in extra_body, as the API takes
    them; `seed` is this server's extension."""
    ids = server.chat_ids(USER)
    sampled = {"temperature": 0.9, "top_k": 20, "top_p": 0.9}
    r = claude.messages.with_raw_response.create(model="tiny", messages=USER, max_tokens=10, extra_body=sampled)
    seed = int(r.headers["x-dflash-seed"])
    want = server.expect(ids, 10, SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=seed))[0]
    assert r.parse().content[0].text == want
    assert want != server.expect(ids, 10)[0]
    with claude.messages.with_streaming_response.create(model="tiny", messages=USER, max_tokens=10, stream=True,
                                                        extra_body={**sampled, "seed": seed}) as streamed:
        assert streamed.headers["x-dflash-seed"] == str(seed)
        events = list(streamed.parse())
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == want


def test_bad_sampling_values_get_a_400_naming_the_field(server):
    cases = [
        ("/v1/chat/completions", {"temperature": 2.5}, "temperature", "between 0 and 2"),
        ("/v1/chat/completions", {"temperature": "warm"}, "temperature", "must be a number"),
        ("/v1/chat/completions", {"top_p": 0}, "top_p", "in (0, 1]"),
        ("/v1/chat/completions", {"top_k": -1}, "top_k", "at least 0"),
        ("/v1/chat/completions", {"min_p": 1.0}, "min_p", "in [0, 1)"),
        ("/v1/chat/completions", {"seed": 1 << 32}, "seed", "0..2^32-1"),
        ("/v1/chat/completions", {"n": 17}, "n", "between 1 and 16"),
        ("/v1/chat/completions", {"n": 2, "stream": True}, "n", "stream with n > 1 is not supported"),
        ("/v1/completions", {"n": 2, "best_of": 4}, "best_of", "must equal n"),
        ("/v1/completions", {"frequency_penalty": 0.5}, "frequency_penalty", "penalties are not implemented"),
        ("/v1/completions", {"logit_bias": {"1": 5}}, "logit_bias", "logit biases are not implemented"),
        ("/v1/messages", {"temperature": 1.5}, "temperature", "between 0 and 1"),
        ("/v1/messages", {"top_k": 2.0}, "top_k", "must be an integer"),
    ]
    for path, fields, param, message in cases:
        body = {"prompt": "x"} if path == "/v1/completions" else {"messages": USER, "max_tokens": 4}
        status, err = server.post(path, {**body, **fields})
        assert status == 400 and message in err["error"]["message"], (path, fields, err)
        if path == "/v1/messages":  # Anthropic's error body has no param: the message names the field
            assert f"'{param}'" in err["error"]["message"]
        else:
            assert err["error"]["param"] == param


SECRET = "the text of an internal error"


def logged_traceback(caplog, request_id):
    """The traceback logged under a request id, as text."""
    records = [r for r in caplog.records if r.getMessage() == f"request {request_id} failed" and r.exc_info]
    assert len(records) == 1, caplog.text
    return "".join(traceback.format_exception(*records[0].exc_info))


def test_an_internal_error_is_a_500_naming_only_a_request_id_and_the_server_keeps_serving(server, oai, claude,
                                                                                           caplog):
    """Raised by the engine (in the worker) or while parsing (in the event loop): a 500 in the API's error shape
    whose message names the request id of the `x-request-id` header and nothing of the exception, logged with its
    traceback under that id; an input error the engine raises keeps its 400 and message; the next request is
    answered."""
    want = server.expect(server.chat_ids(USER), 4)[0]
    answer = {"/v1/chat/completions": lambda: oai.chat.completions.create(
                  model="tiny", messages=USER, max_tokens=4).choices[0].message.content,
              "/v1/messages": lambda: claude.messages.create(model="tiny", messages=USER, max_tokens=4).content[0].text}
    for path, kind in [("/v1/chat/completions", "server_error"), ("/v1/messages", "api_error")]:
        for armed in (server.gated, server.parsing):
            armed.fault = RuntimeError(SECRET)
            status, headers, text = server.send(path, {"messages": USER, "max_tokens": 4})
            request_id, error = headers["x-request-id"], json.loads(text)["error"]
            assert status == 500 and request_id.startswith("req_") and SECRET not in text
            assert error["type"] == kind and error["message"] == f"internal error; request id {request_id}"
            assert SECRET in logged_traceback(caplog, request_id)
            assert answer[path]() == want
        server.gated.fault = InputError("token id 7 is refused")
        status, headers, text = server.send(path, {"messages": USER, "max_tokens": 4})
        assert status == 400 and json.loads(text)["error"]["message"] == "token id 7 is refused"
        assert headers["x-request-id"].startswith("req_")


def test_a_stream_failing_midway_ends_with_an_error_event_naming_only_a_request_id(server, oai, claude, caplog):
    """After the stream's first events, an internal error ends it with an error event in the API's streaming shape
    (OpenAI's then [DONE], Anthropic's `event: error`), which the clients raise; the next stream is answered."""
    for path, start, kind in [("/v1/chat/completions", "data: ", "server_error"),
                              ("/v1/messages", "event: message_start\n", "api_error")]:
        server.gated.fault = RuntimeError(SECRET)
        status, headers, text = server.send(path, {"messages": USER, "max_tokens": 16, "stream": True})
        request_id, events = headers["x-request-id"], text.strip().split("\n\n")
        assert status == 200 and events[0].startswith(start) and len(events) >= 3 and SECRET not in text
        if path == "/v1/messages":
            assert events[-1].startswith("event: error\n")
            error = json.loads(events[-1].split("data: ", 1)[1])["error"]
        else:
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["type"] == kind and error["message"] == f"internal error; request id {request_id}"
        assert SECRET in logged_traceback(caplog, request_id)
    want = server.expect(server.chat_ids(USER), 16)[0]
    server.gated.fault = RuntimeError(SECRET)
    with pytest.raises(openai.APIError, match="^internal error; request id req_"):
        list(oai.chat.completions.create(model="tiny", messages=USER, max_tokens=16, stream=True))
    stream = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=16, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want
    server.gated.fault = RuntimeError(SECRET)
    with pytest.raises(anthropic.APIError, match="internal error; request id req_"):
        with claude.messages.stream(model="tiny", messages=USER, max_tokens=16) as stream:
            "".join(stream.text_stream)
    with claude.messages.stream(model="tiny", messages=USER, max_tokens=16) as stream:
        assert "".join(stream.text_stream) == want


def test_a_failed_generation_leaves_no_state_behind(server, oai):
    """A request that extends the last one fails after its prefill consumed that state: the same request again is
    prefilled afresh and answered as the engine answers it."""
    prompt = server.tok.encode("class Queue:\n")
    _, tokens = server.expect(prompt, 6)
    oai.completions.create(model="tiny", prompt=prompt, max_tokens=6)
    longer = prompt + tokens + server.tok.encode("    def pop(self):")
    server.gated.fault = RuntimeError(SECRET)
    with pytest.raises(openai.InternalServerError, match="internal error; request id req_"):
        oai.completions.create(model="tiny", prompt=longer, max_tokens=6)
    again = oai.completions.create(model="tiny", prompt=longer, max_tokens=6)
    assert again.choices[0].text == server.expect(longer, 6)[0]
    assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_twenty_concurrent_clients_get_their_own_answers(server, oai, claude):
    prompts = [[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}] for i in range(20)]
    wants = [server.expect(server.chat_ids(p), 8)[0] for p in prompts]

    def ask(i):
        if i % 4 == 0:
            return claude.messages.create(model="tiny", messages=prompts[i], max_tokens=8).content[0].text
        if i % 4 == 1:
            with claude.messages.stream(model="tiny", messages=prompts[i], max_tokens=8) as s:
                return "".join(s.text_stream)
        if i % 4 == 2:
            return oai.chat.completions.create(model="tiny", messages=prompts[i], max_tokens=8).choices[0].message.content
        stream = oai.chat.completions.create(model="tiny", messages=prompts[i], max_tokens=8, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream)

    with ThreadPoolExecutor(20) as pool:
        got = list(pool.map(ask, range(20)))
    assert got == wants


def test_a_full_queue_answers_429_and_then_serves_everyone(server, oai):
    server.gated.open.clear()
    server.gated.entered.clear()
    with ThreadPoolExecutor(MAX_QUEUE + 1) as pool:
        first = pool.submit(oai.chat.completions.create, model="tiny", messages=USER, max_tokens=2)
        assert server.gated.entered.wait(30)  # the worker holds the first request
        rest = [pool.submit(oai.completions.create, model="tiny", prompt=f"x = {i}", max_tokens=2)
                for i in range(MAX_QUEUE)]
        deadline = time.monotonic() + 30
        while server.worker.waiting < MAX_QUEUE:
            assert time.monotonic() < deadline and not any(f.done() for f in rest)
            time.sleep(0.02)
        with pytest.raises(openai.RateLimitError, match="already waiting"):
            oai.completions.create(model="tiny", prompt="one too many", max_tokens=2)
        server.gated.open.set()
        assert first.result(60).choices[0].message.content == server.expect(server.chat_ids(USER), 2)[0]
        assert [f.result(60).choices[0].text for f in rest] == \
            [server.expect(server.tok.encode(f"x = {i}"), 2)[0] for i in range(MAX_QUEUE)]


CLIENT = """
import openai, sys, time
client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0)
stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A long story"}],
                                        max_tokens=200, stream=True)
next(iter(stream))
print("streaming", flush=True)
time.sleep(600)
"""


def generated_before_cancel(server) -> int:
    """Tokens the cancelled request generated, from the worker's log line `... + N generated ...; cancelled`."""
    line = server.wait_log("; cancelled")
    return int(line.split(" generated")[0].split("+ ")[-1])


def test_a_client_killed_mid_stream_stops_its_generation(server, oai):
    server.gated.open.clear()
    server.gated.entered.clear()
    server.logs.clear()
    client = subprocess.Popen([sys.executable, "-c", CLIENT, server.url + "/v1"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        first_line = client.stdout.readline()
        assert server.gated.entered.wait(30)
    finally:
        client.kill()
        _, err = client.communicate()
    assert first_line == "streaming\n", err
    server.gated.open.set()
    assert generated_before_cancel(server) < 200, server.logs
    # a non-streaming client that hangs up: its request is cancelled too
    server.gated.open.clear()
    server.gated.entered.clear()
    server.logs.clear()
    conn = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"messages": [{"role": "user", "content": "Another story"}], "max_tokens": 200}).encode()
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert server.gated.entered.wait(30)
    conn.close()
    server.gated.open.set()
    assert generated_before_cancel(server) < 200, server.logs
    answer = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=4).choices[0].message.content
    assert answer == server.expect(server.chat_ids(USER), 4)[0], server.logs


def test_the_serve_command_answers_like_generate(tiny_gguf_path, jit_cache):
    """`python -m dflash_jax.serve` (flags spelled with dashes, as the issue's users write them) gives what
    `python -m dflash_jax.generate` prints for the same prompt and sampling flags, its own --temperature and --top-p
    the defaults of a request that gives only a seed; Ctrl+C stops it cleanly; bad flags exit 2."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    model = ["--target", str(tiny_gguf_path), "--draft", str(TINY / "draft-full"), f"--jit_cache={jit_cache}"]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "dflash_jax.serve", *model, "--port", str(port),
                             "--max-ctx", "512", "--temperature", "0.7", "--top-p", "0.9", "--model-name", "fixture"],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        gen = subprocess.run([sys.executable, "-m", "dflash_jax.generate", *model, "--prompt", "def fibonacci(n):",
                              "--n_gen", "12", "--temperature", "0.7", "--top_p", "0.9", "--seed", "5", "--json"],
                             capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
        assert gen.returncode == 0, gen.stderr
        want = json.loads(gen.stdout)
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except OSError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="fixture", messages=USER, max_tokens=12, seed=5)
        assert r.choices[0].message.content == want["text"] and r.model == "fixture" and r.usage.seed == 5
        assert r.usage.prompt_tokens == len(want["prompt_ids"]) and r.usage.completion_tokens == len(want["tokens"])
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    bad = subprocess.run([sys.executable, "-m", "dflash_jax.serve", *model, "--n_gen", "9000"], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip() == "serve: --n_gen 9000 does not fit --max_ctx 8192"
