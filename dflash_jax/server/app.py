"""The ASGI app: routes, JSON bodies, errors in each API's shape, SSE streams that stop generating on disconnect.

Input errors are answered with their message and a 4xx status. Anything else is a bug: its traceback goes to the log
under a request id, and the client gets a 500 (or, mid-stream, an error event) that names only that id. Every answer
of a generation endpoint carries its id in the `x-request-id` header."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dflash_jax.errors import InputError
from dflash_jax.server import anthropic_api, openai_api
from dflash_jax.server.request import BadRequest, GenRequest, Settings
from dflash_jax.server.wire import anthropic_error, internal_error, new_id, now, openai_error, sse
from dflash_jax.server.worker import GenerationFailed, Job, QueueFull, Worker

LOG = logging.getLogger(__name__)
MAX_BODY = 16 << 20  # bytes: a longer body is refused before it is parsed


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
        except Exception as e:
            response = _error(api, *_answer(e, request_id))
        response.headers["x-request-id"] = request_id
        return response

    return handle


async def _guarded_events(api: str, events: AsyncIterator[str], request_id: str) -> AsyncIterator[str]:
    """A stream's events, ended by an error event if the stream raises (`_answer`)."""
    try:
        async for event in events:
            yield event
    except Exception as e:
        status, message, _ = _answer(e, request_id)
        yield _error_event(api, status, message)


async def _json_body(request: Request) -> dict[str, Any]:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY or len(raw := await request.body()) > MAX_BODY:
        raise BadRequest(f"the request body is over the limit of {MAX_BODY} bytes", status=413)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


async def _collect(job: Job, request: Request) -> str:
    """The whole text of a job; a client that disconnects meanwhile cancels it."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return "".join([piece async for piece in job.pieces()])
    finally:
        watcher.cancel()


def build_app(worker: Worker, settings: Settings) -> Starlette:
    """The server's routes over one worker."""

    def endpoint(api: str, parse: Callable[[dict, Settings], GenRequest], respond: Callable[[Job, str, Settings], dict],
                 stream: Callable[[Job, Settings], AsyncIterator[str]]):
        async def serve(request: Request, request_id: str) -> Response:
            gen_request = parse(await _json_body(request), settings)
            job = worker.submit(gen_request, asyncio.get_running_loop(), request_id)
            if gen_request.stream:
                return EventStream(_guarded_events(api, stream(job, settings), request_id), job)
            text = await _collect(job, request)
            if job.outcome.finish == "cancelled":  # the client left; nobody reads this
                return Response(status_code=499)
            return JSONResponse(respond(job, text, settings))

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
        Route("/v1/messages", endpoint("anthropic", anthropic_api.parse_messages, anthropic_api.message_response,
                                       anthropic_api.message_stream), methods=["POST"]),
        Route("/v1/messages/count_tokens", _guarded("anthropic", count_tokens), methods=["POST"]),
    ], exception_handlers={HTTPException: http_error})
