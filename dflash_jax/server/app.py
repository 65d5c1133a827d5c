"""The ASGI app: routes, JSON bodies, errors in each API's shape, SSE streams that stop generating on disconnect."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dflash_jax.server import anthropic_api, openai_api
from dflash_jax.server.request import BadRequest, GenRequest, Settings
from dflash_jax.server.wire import anthropic_error, now, openai_error
from dflash_jax.server.worker import GenerationFailed, Job, QueueFull, Worker

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
        async def handle(request: Request) -> Response:
            try:
                gen_request = parse(await _json_body(request), settings)
                job = worker.submit(gen_request, asyncio.get_running_loop())
            except BadRequest as e:
                return _error(api, e.status, str(e), e.param)
            except QueueFull as e:
                return _error(api, 429, str(e))
            if gen_request.stream:
                return EventStream(stream(job, settings), job)
            try:
                text = await _collect(job, request)
            except GenerationFailed as e:
                return _error(api, 400 if e.bad_input else 500, str(e))
            if job.outcome.finish == "cancelled":  # the client left; nobody reads this
                return Response(status_code=499)
            return JSONResponse(respond(job, text, settings))

        return handle

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": settings.model, "waiting": worker.waiting})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": settings.model, "object": "model", "created": now(),
                                                         "owned_by": "dflash-jax"}]})

    async def count_tokens(request: Request) -> Response:
        try:
            return JSONResponse({"input_tokens": len(anthropic_api.prompt_ids(await _json_body(request), settings))})
        except BadRequest as e:
            return _error("anthropic", e.status, str(e))

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
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ], exception_handlers={HTTPException: http_error})
