"""One thread owns the engine and serves queued requests one at a time, streaming text back to the event loop; it
keeps the last request's state to continue and, with a prefix cache, snapshots of earlier ones."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable

from dflash_jax.engine.state import DecodeState, Mark, rewind
from dflash_jax.errors import InputError
from dflash_jax.server import budget
from dflash_jax.server.prefix_cache import PrefixCache
from dflash_jax.server.request import GenRequest
from dflash_jax.server.stops import StopMatcher
from dflash_jax.server.wire import internal_error
from dflash_jax.tokenizer import Tokenizer

LOG = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """Every queue slot is taken (HTTP 429)."""


class GenerationFailed(RuntimeError):
    """The engine raised while serving a request: the message for the client, and `bad_input` when the request
    itself was at fault (else the message only names the request id under which the traceback was logged)."""

    def __init__(self, message: str, bad_input: bool = False):
        super().__init__(message)
        self.bad_input = bad_input


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a generation ended: `stop_token`, `stop_sequence` (which one in `matched`), `length` or `cancelled`."""

    finish: str
    completion_tokens: int
    cached_tokens: int  # prompt tokens not prefilled again: the last request's state or a snapshot held them
    matched: str | None = None
    error: GenerationFailed | None = None


class Job:
    """A request in flight: the worker thread sends text and the outcome; the event loop reads them."""

    def __init__(self, request: GenRequest, loop: asyncio.AbstractEventLoop, request_id: str):
        self.request, self._loop, self.request_id = request, loop, request_id
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self.outcome: Outcome | None = None

    def cancel(self) -> None:
        """Stop generating (the client is gone): the worker drops the job (its outcome is then `cancelled`) or halts
        it after the current step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def put(self, item: str | Outcome) -> None:
        """From the worker thread: a piece of text, or the outcome that ends the job."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the event loop has closed (the server is shutting down): nobody is listening
            self.cancel()

    async def pieces(self) -> AsyncIterator[str]:
        """The generated text as it commits; then `outcome` is set (GenerationFailed if the engine failed)."""
        while True:
            item = await self._events.get()
            if isinstance(item, Outcome):
                self.outcome = item
                if item.error is not None:
                    raise item.error
                return
            yield item


@dataclasses.dataclass(frozen=True)
class Context:
    """What the worker keeps of the last request for the next: the ids its state holds (the last one still pending),
    that state, a mark of it after its first `marked` ids, where the conversation's next turn will part from it, and
    whether that turn may extend all of its ids (not when the template renders the reply otherwise in the history)."""

    ids: list[int]
    state: DecodeState
    marked: int = 0
    mark: Mark | None = None
    resumable: bool = True


def _extends(ids: list[int], prefix: list[int]) -> bool:
    return len(ids) > len(prefix) and ids[:len(prefix)] == prefix


class Worker:
    """The engine's only user: a bounded queue of jobs, the state of the last conversation, and a prefix cache of
    `prefix_cache_bytes` (0: none; only the last state is reused)."""

    def __init__(self, engine, tokenizer: Tokenizer, max_queue: int, log: Callable[[str], None] = lambda _: None,
                 prefix_cache_bytes: int = 0):
        self.engine, self.tokenizer, self.log = engine, tokenizer, log
        self._queue: queue.Queue = queue.Queue(max_queue)
        self._context: Context | None = None
        self.cache = PrefixCache(prefix_cache_bytes)
        self._thread = threading.Thread(target=self._serve, name="dflash-worker", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def submit(self, request: GenRequest, loop: asyncio.AbstractEventLoop, request_id: str) -> Job:
        """Queue a request; QueueFull when every slot is taken."""
        job = Job(request, loop, request_id)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"the server is busy: {self._queue.maxsize} requests are already waiting") from None
        return job

    def close(self, timeout: float = 5.0) -> None:
        """Let the thread finish its current job and stop."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _serve(self) -> None:
        while self._serve_one(self._queue.get()):  # no frame holds a finished job while the next is awaited
            pass

    def _serve_one(self, job: Job | None) -> bool:
        """Run a job and send its outcome; False for the None that stops the thread."""
        if job is None:
            return False
        if job.cancelled:  # its client left while it waited: dropped, but every job gets an outcome
            job.put(Outcome("cancelled", 0, 0))
            return True
        try:
            outcome = self._run(job)
        except Exception as e:  # the thread must outlive any request
            self._context = None  # nothing a failed request left is trusted: the next one starts afresh
            if isinstance(e, InputError):
                failed = GenerationFailed(str(e), bad_input=True)
                self.log(f"request {job.request_id} refused: {e}")
            else:
                LOG.exception("request %s failed", job.request_id)
                failed = GenerationFailed(internal_error(job.request_id))
            outcome = Outcome("error", 0, 0, error=failed)
        job.put(outcome)
        return True

    def _reuse(self, ids: list[int]) -> tuple[DecodeState | None, int, bool, Context | None]:
        """Where this prompt starts: (the state to continue, None for a fresh one; how many leading ids it holds;
        whether its pending token is kept; the context it goes on from, whose mark then still holds). Whichever
        holds more of the prompt: the last request's state (whole, else set back to its mark), free, or a snapshot
        of the cache, copied. The last context is taken either way: continued, or kept as a snapshot (with a
        cache) and freed before a snapshot's state is made."""
        ctx, self._context = self._context, None
        whole = ctx is not None and _extends(ids, ctx.ids)
        marked = ctx is not None and ctx.mark is not None and _extends(ids, ctx.ids[:ctx.marked])
        held = len(ctx.ids) - 1 if whole else ctx.marked if marked else 0  # the pending token is prefilled again
        snapshot = self.cache.lookup(ids, longer_than=held)
        if whole and snapshot is None:
            return ctx.state, len(ctx.ids), True, ctx
        if marked and snapshot is None:
            return rewind(ctx.state, ctx.mark), ctx.marked, False, ctx
        if ctx is not None and not (whole or marked) and ctx.resumable and self.cache.enabled \
                and ctx.ids[:-1] not in self.cache:  # another conversation: keep where this one's reply ended
            self.cache.add(ctx.ids[:-1], self.engine.snapshot(ctx.state))
        ctx = None  # its caches are freed before the snapshot's are copied in
        if snapshot is not None:
            return self.engine.restore(snapshot), snapshot.length, False, None
        return None, 0, True, None

    def _snapshot_points(self, request: GenRequest, start: int) -> list[int]:
        """Where to snapshot this prompt, counted from `start`: where another conversation with the same system
        messages parts from it, and where its own next turn does, past `start` and not in the cache already."""
        if not self.cache.enabled:
            return []
        points = {p for p in (request.shared, request.history) if start < p <= len(request.ids)}
        return sorted(p - start for p in points if request.ids[:p] not in self.cache)

    @staticmethod
    def _next_context(request: GenRequest, gen, previous: Context | None) -> Context:
        """The context a finished generation leaves: marked where its conversation's next turn will part from it,
        else where the previous mark was (the state went on from that context, so the mark still holds)."""
        ids = request.ids + gen.tokens
        resumable = not 0 < request.history < len(request.ids)  # else the next turn parts inside the prompt
        if gen.mark is not None:
            return Context(ids, gen.state, request.history, gen.mark, resumable)
        if previous is not None:
            return Context(ids, gen.state, previous.marked, previous.mark, resumable)
        return Context(ids, gen.state, resumable=resumable)

    def _run(self, job: Job) -> Outcome:
        request, tok = job.request, self.tokenizer
        t0 = time.perf_counter()
        after, start, whole, ctx = self._reuse(request.ids)  # a snapshot copied in counts as prefill time
        reused = start - 1 if after is not None and whole else start  # a whole state's pending token is prefilled
        decoder, matcher = tok.stream(skip_stops=True), StopMatcher(request.stops)

        def on_tokens(new: list[int]) -> bool:
            if job.cancelled:
                return True
            text = matcher.push(decoder.push(new))
            if text:
                job.put(text)
            return matcher.matched is not None

        t1 = time.perf_counter()
        gen = budget.generate(self.engine, tok, request.reasoning_budget, request.ids[start:], request.max_tokens,
                              on_tokens, after=after, keep_pending=whole, mark_at=max(request.history - start, 0),
                              sampling=request.sampling, snapshot_at=self._snapshot_points(request, start))
        for snapshot in gen.snapshots:
            self.cache.add(request.ids[:snapshot.length], snapshot)
        if not gen.halted:
            tail = matcher.push(decoder.flush()) + matcher.flush()
            if tail:
                job.put(tail)
        if gen.state is not None:
            self._context = self._next_context(request, gen, ctx)
        finish = ("cancelled" if job.cancelled else "stop_sequence" if matcher.matched is not None
                  else "stop_token" if gen.stopped else "length")
        prefill_s = t1 - t0 + gen.prefill_s
        decode_s = time.perf_counter() - t0 - prefill_s
        self.log(f"{len(request.ids)} prompt tokens ({reused} reused, {len(request.ids) - reused} prefilled in "
                 f"{prefill_s:.2f} s) + {len(gen.tokens)} generated in {decode_s:.2f} s, acceptance length "
                 f"{gen.mean_accept_length:.2f}, {gen.decode_tokens_per_s:.1f} tok/s, {request.sampling.describe()}; "
                 f"{finish}" + (f"; prefix cache {len(self.cache)} snapshots, {self.cache.nbytes / 2**20:.1f} MiB"
                                 if self.cache.enabled else ""))
        return Outcome(finish, len(gen.tokens), reused, matcher.matched)
