"""The ASGI app: routes, JSON bodies, errors in each API's shape, SSE streams that stop generating on disconnect.

Input errors are answered with their message and a 4xx status. Anything else is a bug: its traceback goes to the log
under a request id, and the client gets a 500 (or, mid-stream, an error event) that names only that id. Every answer
of a generation endpoint carries its id in the `x-request-id` header, and a sampled one its seed in `x-dflash-seed`."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dflash_jax.errors import InputError
from dflash_jax.server import anthropic_api, openai_api, responses_api
from dflash_jax.server.request import BadRequest, GenRequest, Settings, choices
from dflash_jax.server.wire import anthropic_error, internal_error, new_id, now, openai_error, sse
from dflash_jax.server.worker import GenerationFailed, Job, QueueFull, Worker

LOG = logging.getLogger(__name__)
MAX_BODY = 16 << 20  # bytes: a longer body is refused as soon as that many have arrived, before it is parsed
CLIENT_GONE = 499  # nginx's status for a client that left before its answer: nobody reads it, nothing is logged
# a \uD800-\uDFFF escape: half of a UTF-16 pair, which JSON decoding lets through even when it is alone
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class EventStream(StreamingResponse):
    """Server-sent events whose job is cancelled when the response ends for any reason (done, or client gone)."""

    def __init__(self, events: AsyncIterator[str], job: Job):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


def _error(api: str, status: int, message: str, param: str | None = None) -> JSONResponse:
    body = anthropic_error(status, message) if api == "anthropic" else openai_error(status, message, param)
    return JSONResponse(body, status, headers={"Retry-After": "1"} if status == 429 else None)


def _error_event(api: str, status: int, message: str) -> str:
    """An error that ends a stream, in the API's streaming shape."""
    if api == "anthropic":
        return sse(anthropic_error(status, message), "error")
    return sse(openai_error(status, message)) + sse("[DONE]")


def _answer(e: Exception, request_id: str) -> tuple[int, str, str | None]:
    """(status, message, param) of what a request raised: an input error's own; anything else logged, and hidden."""
    if isinstance(e, BadRequest):
        return e.status, str(e), e.param
    if isinstance(e, InputError):
        return 400, str(e), None
    if isinstance(e, QueueFull):
        return 429, str(e), None
    if isinstance(e, GenerationFailed):  # the worker logged an internal one and left only the request id
        return 400 if e.bad_input else 500, str(e), None
    LOG.error("request %s failed", request_id, exc_info=e)
    return 500, internal_error(request_id), None


def _guarded(api: str, serve: Callable[[Request, str], Awaitable[Response]]
             ) -> Callable[[Request], Awaitable[Response]]:
    """A route that gives each request an id (the `x-request-id` header) and answers what it raises (`_answer`)."""

    async def handle(request: Request) -> Response:
        request_id = new_id("req_")
        try:
            response = await serve(request, request_id)
        except ClientDisconnect:  # it left while sending its body
            response = Response(status_code=CLIENT_GONE)
        except Exception as e:
            response = _error(api, *_answer(e, request_id))
        response.headers["x-request-id"] = request_id
        return response

    return handle


async def _guarded_events(api: str, events: AsyncIterable[str], request_id: str) -> AsyncIterator[str]:
    """A stream's events, ended by an error event if the stream raises (`_answer`): the stream's own `failed` event
    where it has one (the Responses API's response.failed), else the API's error event."""
    try:
        async for event in events:
            yield event
    except Exception as e:
        status, message, _ = _answer(e, request_id)
        failed = getattr(events, "failed", None)
        yield failed(status, message) if failed else _error_event(api, status, message)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) as soon as more than `limit` bytes are declared or have arrived."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"the request body is over the limit of {limit} bytes", status=413)
    body = bytearray()
    async for chunk in request.stream():  # a chunked body has no declared length: it is counted as it comes
        body += chunk
        if len(body) > limit:
            raise BadRequest(f"the request body is over the limit of {limit} bytes", status=413)
    return bytes(body)


def _is_text(s: str) -> bool:
    """Whether a string is Unicode text (JSON's \\u escapes can also make lone surrogates)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def _lone_surrogate(body: dict[str, Any]) -> tuple[str, str | None] | None:
    """(where, top-level field) of the first string or key in a parsed body that holds a lone UTF-16 surrogate."""
    if not all(_is_text(key) for key in body):
        return "a key of the body", None
    stack = [(key, key, body[key]) for key in reversed(list(body))]
    while stack:  # not recursive: the body may nest as deep as the parser allows
        path, field, item = stack.pop()
        if isinstance(item, str) and not _is_text(item):
            return path, field
        if isinstance(item, dict):
            if not all(_is_text(key) for key in item):
                return f"a key of {path}", field
            stack.extend((f"{path}.{key}", field, item[key]) for key in reversed(list(item)))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", field, item[i]) for i in reversed(range(len(item))))
    return None


def _parse_json(raw: bytes) -> dict[str, Any]:
    """A JSON object of Unicode text, else a 400 that says why."""
    try:
        text = raw.decode("utf-8-sig")  # JSON's own encoding; a byte order mark is let through, as json.loads does
        body = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("the request body is not valid JSON: it nests arrays or objects too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    bad = _lone_surrogate(body) if _SURROGATE_ESCAPE.search(text) else None
    if bad is not None:
        raise BadRequest(f"the request body is not Unicode text: {bad[0]} holds a lone UTF-16 surrogate (a "
                         "\\ud800-\\udfff escape without its pair)", bad[1])
    return body


async def _json_body(request: Request) -> dict[str, Any]:
    return _parse_json(await _read_body(request, MAX_BODY))


async def _disconnected(request: Request) -> None:
    """Return when the client has disconnected (its body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(job: Job, request: Request) -> str | None:
    """The whole text of a job, or None when the client disconnects first: the job is then cancelled, and the
    handler does not wait for the worker to reach it."""

    async def text() -> str:
        return "".join([piece async for piece in job.pieces()])

    reading, watching = asyncio.ensure_future(text()), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([reading, watching], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not reading.done():
            job.cancel()
            reading.cancel()
    return reading.result() if reading.done() else None


async def _run_choices(worker: Worker, gen_request: GenRequest, request: Request, request_id: str
                       ) -> tuple[list[Job], list[str]] | None:
    """The jobs of a request's choices and their texts, one after another; None when the client leaves first."""
    jobs, texts = [], []
    for choice in choices(gen_request):
        job = worker.submit(choice, asyncio.get_running_loop(), request_id)
        text = await _collect(job, request)
        if text is None or job.outcome.finish == "cancelled":
            return None
        jobs.append(job)
        texts.append(text)
    return jobs, texts


def _seed_header(response: Response, gen_request: GenRequest) -> Response:
    """The seed of a sampled request (its first choice's) in the `x-dflash-seed` header."""
    if not gen_request.sampling.greedy:
        response.headers["x-dflash-seed"] = str(gen_request.sampling.seed)
    return response


def build_app(worker: Worker, settings: Settings) -> Starlette:
    """The server's routes over one worker."""

    def endpoint(api: str, parse: Callable[[dict, Settings], GenRequest],
                 respond: Callable[[Sequence[Job], Sequence[str], Settings], dict],
                 stream: Callable[[Job, Settings], AsyncIterable[str]]):
        async def serve(request: Request, request_id: str) -> Response:
            gen_request = parse(await _json_body(request), settings)
            if gen_request.stream:  # one choice (request.count refuses n > 1 with stream)
                job = worker.submit(gen_request, asyncio.get_running_loop(), request_id)
                events = EventStream(_guarded_events(api, stream(job, settings), request_id), job)
                return _seed_header(events, gen_request)
            done = await _run_choices(worker, gen_request, request, request_id)
            if done is None:  # the client left; nobody reads this
                return Response(status_code=CLIENT_GONE)
            return _seed_header(JSONResponse(respond(*done, settings)), gen_request)

        return _guarded(api, serve)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": settings.model, "waiting": worker.waiting})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": settings.model, "object": "model", "created": now(),
                                                         "owned_by": "dflash-jax"}]})

    async def count_tokens(request: Request, request_id: str) -> Response:
        return JSONResponse({"input_tokens": len(anthropic_api.prompt_ids(await _json_body(request), settings))})

    async def http_error(request: Request, exc: HTTPException) -> Response:
        api = "anthropic" if request.url.path.startswith("/v1/messages") else "openai"
        return _error(api, exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    return Starlette(routes=[
        Route("/", health), Route("/health", health), Route("/v1/models", models),
        Route("/v1/chat/completions", endpoint("openai", openai_api.parse_chat, openai_api.chat_response,
                                               openai_api.chat_stream), methods=["POST"]),
        Route("/v1/completions", endpoint("openai", openai_api.parse_completion, openai_api.completion_response,
                                          openai_api.completion_stream), methods=["POST"]),
        Route("/v1/responses", endpoint("openai", responses_api.parse_responses, responses_api.response_object,
                                        responses_api.ResponseStream), methods=["POST"]),
        Route("/v1/messages", endpoint("anthropic", anthropic_api.parse_messages, anthropic_api.message_response,
                                       anthropic_api.message_stream), methods=["POST"]),
        Route("/v1/messages/count_tokens", _guarded("anthropic", count_tokens), methods=["POST"]),
    ], exception_handlers={HTTPException: http_error})
