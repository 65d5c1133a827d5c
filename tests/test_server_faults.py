"""The server under faults (issue 39): clients that leave while queued or mid-body, bodies chunked past the limit,
JSON that is not Unicode text or nests too deeply, a `serve` that cannot bind, a second turn with thinking off; then
100 concurrent clients of both APIs, some leaving while queued or mid-stream, after which the server is healthy,
answers correctly, and its handlers, connections, jobs and memory are back where they were. The server is the one of
test_server.py (the fixture pair on 127.0.0.1, in a thread) serving the fixture's copy with the Qwen3.5 chat template
(conftest.qwen35_gguf_path)."""

import contextlib
import gc
import http.client
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import psutil
import pytest

from conftest import ROOT
from test_server import USER, Server, claude, oai  # noqa: F401 (fixtures, on this module's server)

MAX_QUEUE = 128  # room for every client of the crowd
MIB = 1 << 20


@pytest.fixture(scope="module")
def server(qwen35_gguf_path):  # Qwen3.5's own template renders no empty think block into history
    srv = Server(qwen35_gguf_path, max_queue=MAX_QUEUE)
    yield srv
    srv.close()




def handlers(server) -> int:
    """Requests the server is handling: uvicorn's task per request."""
    return len(server.uvicorn.server_state.tasks)


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    """Poll until condition() holds; fail naming `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


class Records(logging.Handler):
    """Log records at WARNING and above, from the root logger and uvicorn's (which does not propagate)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    @property
    def text(self) -> str:
        return "\n".join(self.format(r) for r in self.records)


@contextlib.contextmanager
def logged():
    """The warnings and errors logged inside the block (tracebacks included, by their `exc_info`)."""
    records, loggers = Records(), [logging.getLogger(), logging.getLogger("uvicorn")]
    for logger in loggers:
        logger.addHandler(records)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(records)


def send_raw(server, path: str, body: bytes | dict, headers: dict | None = None) -> socket.socket:
    """A socket that has sent a whole POST request and not read its answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = {"Host": "x", "Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\n".encode() + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode()
                 + b"\r\n" + data)
    return sock


def answer(oai, claude, kind: str, messages: list[dict], n: int) -> str:
    """The reply text through the clients: kind is openai, openai_stream, anthropic or anthropic_stream."""
    if kind == "openai":
        return oai.chat.completions.create(model="tiny", messages=messages, max_tokens=n).choices[0].message.content
    if kind == "openai_stream":
        stream = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=n, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream)
    if kind == "anthropic":
        return claude.messages.create(model="tiny", messages=messages, max_tokens=n).content[0].text
    with claude.messages.stream(model="tiny", messages=messages, max_tokens=n) as stream:
        return "".join(stream.text_stream)


def test_a_client_leaving_its_queued_request_frees_its_handler_at_once(server, oai):
    """Fault 1: a non-streaming client (and a streaming one) that disconnects while its request waits behind
    another: its handler ends then, not when (or never, as before) the worker reaches the request, which the worker
    drops without running it."""
    want = server.expect(server.chat_ids(USER), 2)[0]
    server.gated.open.clear()
    server.gated.entered.clear()
    server.logs.clear()
    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(oai.chat.completions.create, model="tiny", messages=USER, max_tokens=2)
        try:
            assert server.gated.entered.wait(30)  # the worker holds the first request
            base = handlers(server)
            socks = [send_raw(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "stream": stream})
                     for stream in (False, True)]
            wait_until(lambda: server.worker.waiting == 2, "both requests wait")
            for sock in socks:
                sock.close()
            wait_until(lambda: handlers(server) == base, "the handlers of the clients that left end")
        finally:
            server.gated.open.set()
        assert holder.result(60).choices[0].message.content == want
    wait_until(lambda: handlers(server) == 0 and server.worker.waiting == 0, "the server is idle")
    assert len(server.logs) == 1, server.logs  # only the first request ran


def send_chunked(sock: socket.socket, total: int, chunk: int = 256 << 10) -> int:
    """Send a chunked body of up to `total` bytes until the server answers or closes; the bytes sent."""
    sent, piece = 0, b"[" + b" " * (chunk - 1)
    try:
        while sent < total and not select.select([sock], [], [], 0)[0]:
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            sent += len(piece)
        if sent >= total:
            sock.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(server, oai):
    """Fault 2: a chunked body (no Content-Length) gets its 413 once 16 MiB have arrived, not after the server read
    all of it; a chunked body within the limit is answered as any other."""
    from dflash_jax.server.app import MAX_BODY

    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    sent = send_chunked(sock, 16 * MAX_BODY)
    response = http.client.HTTPResponse(sock)
    response.begin()
    error = json.loads(response.read())["error"]
    sock.close()
    assert response.status == 413 and "over the limit of 16777216 bytes" in error["message"]
    assert sent < 2 * MAX_BODY, f"the server read {sent / MIB:.0f} MiB before refusing the body"
    sock = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"messages": USER, "max_tokens": 3}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7])
                                                                  for i in range(0, len(body), 7)) + b"0\r\n\r\n")
    response = http.client.HTTPResponse(sock)
    response.begin()
    reply = json.loads(response.read())
    sock.close()
    assert response.status == 200
    assert reply["choices"][0]["message"]["content"] == server.expect(server.chat_ids(USER), 3)[0]


DEEP = 100_000


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens"])
def test_json_that_is_not_unicode_text_or_nests_too_deeply_is_a_400_in_the_apis_shape(server, path):
    """Fault 3: a lone surrogate escape in a message, in a key, and JSON nested 100,000 levels deep: a 400 in the
    endpoint's API error shape that says what is wrong and where, nothing logged; a surrogate pair (an emoji) is
    text like any other."""
    anthropic_shape = path.startswith("/v1/messages")
    cases = [
        (b'{"max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}',
         "messages[0].content holds a lone UTF-16 surrogate", "messages"),
        (b'{"max_tokens": 2, "messages": [{"role": "user", "content": "hi", "\\udfff": 1}]}',
         "a key of messages[0] holds a lone UTF-16 surrogate", "messages"),
        (b'{"max_tokens": 2, "messages": [], "x": ' + b"[" * DEEP + b"]" * DEEP + b"}",
         "nests arrays or objects too deeply", None),
        (b'{"max_tokens": 2, "messages": [], "x": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}",
         "nests arrays or objects too deeply", None),
    ]
    with logged() as records:
        for body, message, param in cases:
            status, err = server.post(path, body)
            assert status == 400 and message in err["error"]["message"], (body[:80], status, err)
            assert (err.get("type") == "error") == anthropic_shape  # each API's error shape
            assert err["error"]["type"] == "invalid_request_error"
            if not anthropic_shape:
                assert err["error"]["param"] == param
        emoji = b'{"max_tokens": 2, "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
        status, _ = server.post(path, emoji)
        assert status == 200
    assert not records.records, records.text


def test_a_client_leaving_in_the_middle_of_its_body_leaves_no_traceback(server, oai):
    """Fault 4: half a body (with a Content-Length, or chunked) and then the connection closes: the handler ends
    and nothing is logged; the next request is answered."""
    body = json.dumps({"messages": USER, "max_tokens": 2}).encode()
    with logged() as records:
        for head in [b"Content-Length: %d\r\n" % len(body), b"Transfer-Encoding: chunked\r\n"]:
            sock = socket.create_connection(("127.0.0.1", server.port))
            half = body[:len(body) // 2]
            if b"chunked" in head:
                half = b"%x\r\n%s\r\n" % (len(half), half)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + head + b"\r\n" + half)
            wait_until(lambda: handlers(server) == 1, "the request is being read")
            sock.close()
            wait_until(lambda: handlers(server) == 0, "its handler ends")
        time.sleep(0.2)  # uvicorn logs an application's exception after its task ends
    assert not records.records, records.text
    assert oai.chat.completions.create(model="tiny", messages=USER, max_tokens=2).choices[0].message.content == \
        server.expect(server.chat_ids(USER), 2)[0]


def test_serve_checks_its_address_before_loading_the_model(jit_cache):
    """Fault 5: `serve` on a port in use, or on an address of no interface here, exits 2 with one line at once,
    before loading and compiling (and before printing an address it would not listen on)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for host, reason in [("127.0.0.1", "Address already in use"), ("192.0.2.1", "Cannot assign requested address")]:
            t0 = time.monotonic()
            run = subprocess.run([sys.executable, "-m", "dflash_jax.serve", "--host", host, "--port", str(port),
                                  f"--jit_cache={jit_cache}"], capture_output=True, text=True, cwd=ROOT, env=env,
                                 timeout=300)
            assert (run.returncode, run.stderr) == (2, f"serve: cannot listen on {host}:{port}: {reason}\n")
            assert time.monotonic() - t0 < 60


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids two prompts share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_a_second_turn_reuses_the_first_with_thinking_off(server, oai, claude):
    """Fault 6: with thinking off (the default), Qwen3.5's template opens turn 1's reply with an empty think block
    but renders that reply into turn 2's history without it, so turn 2's ids do not extend turn 1's. The worker
    marked turn 1's state where the template's next turn parts from it, and turn 2 reuses it up to there, as much as
    the two prompts share; the same with thinking on and through the Anthropic API. The answers are the engine's on
    the whole conversation (with thinking on, the reply starts inside the think block: reasoning_content)."""
    from dflash_jax.server.reply import split_reasoning
    from dflash_jax.server.request import chat_prompt

    def read(r):
        message = r.choices[0].message
        return (message.model_extra or {}).get("reasoning_content", ""), message.content

    system = "You are a careful Python programmer who writes short, well-tested functions."
    for thinking in (False, True):
        question = [{"role": "system", "content": system}, {"role": "user", "content": f"Write function {thinking}."}]
        extra = {"chat_template_kwargs": {"enable_thinking": True}} if thinking else None
        ids1 = chat_prompt(server.settings, question, thinking)
        first = oai.chat.completions.create(model="tiny", messages=question, max_tokens=4, extra_body=extra)
        assert read(first) == split_reasoning(server.expect(ids1, 4)[0], thinking)
        history = question + [{"role": "assistant", "content": first.choices[0].message.content},
                              {"role": "user", "content": "And another one."}]
        ids2 = chat_prompt(server.settings, history, thinking)
        assert ids2[:len(ids1)] != ids1  # the case at issue: turn 2 does not extend turn 1
        second = oai.chat.completions.create(model="tiny", messages=history, max_tokens=4, extra_body=extra)
        assert read(second) == split_reasoning(server.expect(ids2, 4)[0], thinking)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached == common_prefix(ids1, ids2) > len(server.tok.encode(system)), (thinking, cached)
    question = [{"role": "user", "content": "Write a stack class."}]
    m = claude.messages.create(model="tiny", system=system, messages=question, max_tokens=4)
    history = question + [{"role": "assistant", "content": m.content[0].text}, {"role": "user", "content": "More."}]
    m2 = claude.messages.create(model="tiny", system=system, messages=history, max_tokens=4)
    ids2 = server.chat_ids([{"role": "system", "content": system}] + history)
    assert m2.usage.cache_read_input_tokens > 0 and m2.content[0].text == server.expect(ids2, 4)[0]
    assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens == len(ids2)


N_CLIENTS, N_GEN = 100, 3
KINDS = ("openai", "openai_stream", "anthropic", "anthropic_stream", "leave_mid_stream", "leave_queued")
PROMPTS = [[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}] for i in range(8)]


def has_text(line: bytes) -> bool:
    """Whether an SSE line of either API carries generated text."""
    if not line.startswith(b"data: {"):
        return False
    event = json.loads(line[6:])
    return event.get("type") == "content_block_delta" or any(c["delta"].get("content")
                                                              for c in event.get("choices", []))


def leave_mid_stream(server, path: str, messages: list[dict]) -> None:
    """Ask for a long stream, read it until its first text, then hang up."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", path, json.dumps({"messages": messages, "max_tokens": 64, "stream": True}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    while (line := response.readline()) and not has_text(line):
        pass
    response.close()
    conn.close()


def crowd(server, oai, claude, n: int) -> list[str | None]:
    """n concurrent clients, of each kind in KINDS in turn and of both APIs, all queued behind a request the worker
    holds; those of kind leave_queued hang up then, the rest once the worker goes on. The answers (None for those
    that left)."""
    queued, server.logs[:] = threading.Event(), []
    server.gated.open.clear()
    server.gated.entered.clear()

    def client(i: int) -> str | None:
        kind, messages = KINDS[i % len(KINDS)], PROMPTS[i % len(PROMPTS)]
        path = "/v1/messages" if i // len(KINDS) % 2 else "/v1/chat/completions"
        if kind == "leave_queued":
            sock = send_raw(server, path, {"messages": messages, "max_tokens": 64, "stream": i // 12 % 2 == 1})
            queued.wait(120)
            sock.close()
            return None
        if kind == "leave_mid_stream":
            return leave_mid_stream(server, path, messages)
        return answer(oai, claude, kind, messages, N_GEN)

    leaving = sum(KINDS[i % len(KINDS)] == "leave_queued" for i in range(n))
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(client, i) for i in range(n)]
        try:
            wait_until(lambda: server.gated.entered.is_set() and server.worker.waiting == n - 1,
                       "every request is in", 120)
            queued.set()
            wait_until(lambda: handlers(server) == n - leaving, "the handlers of the clients that left end")
        finally:
            queued.set()
            server.gated.open.set()
        return [f.result(300) for f in futures]


def server_memory() -> tuple[int, int]:
    """(jobs alive, resident bytes) of the process the server runs in, after a garbage collection."""
    from dflash_jax.server.worker import Job

    gc.collect()
    # type(), not isinstance(), which reads __class__ and so wakes deprecated module attributes (torch's)
    return sum(type(o) is Job for o in gc.get_objects()), psutil.Process().memory_info().rss


def get(server, path: str) -> str:
    """The body of a GET."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", path)
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def test_a_hundred_clients_some_leaving_then_the_server_is_healthy_and_as_it_was(server):
    """100 concurrent clients of both APIs, streaming and not, a sixth leaving while queued and a sixth mid-stream:
    each that stays gets the engine's answer, nothing is logged; then /health is ok with nothing waiting, a new
    request is answered correctly, and the server's handlers, connections, jobs and memory are back to where they
    were before (after a smaller crowd that warmed it up)."""
    wants = [server.expect(server.chat_ids(p), N_GEN)[0] for p in PROMPTS]
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    crowd(server, oai, claude, 2 * len(KINDS))
    wait_until(lambda: handlers(server) == 0, "the warm-up's handlers end")
    # the worker drops the warm-up's queued jobs whose clients left only when it reaches them
    wait_until(lambda: server_memory()[0] == 0, "the worker drops the warm-up's jobs")
    jobs, rss = server_memory()
    connections = len(server.uvicorn.server_state.connections)
    with logged() as records:
        got = crowd(server, oai, claude, N_CLIENTS)
    assert not records.records, records.text
    for i, text in enumerate(got):
        if KINDS[i % len(KINDS)] not in ("leave_queued", "leave_mid_stream"):
            assert text == wants[i % len(PROMPTS)], (i, KINDS[i % len(KINDS)])
    leaving = sum(KINDS[i % len(KINDS)] == "leave_queued" for i in range(N_CLIENTS))
    # one line per request run: not those that left the queue (but the one the worker held may have been one)
    assert N_CLIENTS - leaving <= len(server.logs) <= N_CLIENTS - leaving + 1
    assert sum("; cancelled" in line for line in server.logs) >= N_CLIENTS // len(KINDS)  # those mid-stream
    health = json.loads(get(server, "/health"))
    assert health["status"] == "ok" and health["waiting"] == 0
    assert answer(oai, claude, "openai", PROMPTS[3], N_GEN) == wants[3]
    oai.close()
    claude.close()
    wait_until(lambda: handlers(server) == 0, "every handler ends")
    wait_until(lambda: len(server.uvicorn.server_state.connections) <= connections, "the clients' connections close")
    jobs_after, rss_after = server_memory()
    assert jobs_after == jobs == 0
    assert rss_after - rss < 48 * MIB, f"the server grew by {(rss_after - rss) / MIB:.0f} MiB"

