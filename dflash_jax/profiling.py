"""jit profiling: compile time per jitted function (from JAX's monitoring events) and profiler traces of decode
steps (jax.profiler, viewable in Perfetto or TensorBoard). Used by `generate --profile` and scripts/bench.py."""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from typing import Callable

import jax

# JAX's duration events for the three stages of making an executable; each carries the function's name.
STAGES = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}
# JAX's events for a compile that looked in the persistent cache, and for one that found its program there
CACHE_REQUEST, CACHE_HIT = "/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits"


class CompileLog:
    """Records, while active (a context manager), the seconds each jitted function spent tracing, lowering and
    compiling, and how many times it was compiled. A hit in the persistent cache shows up as a short compile, and is
    counted in `cache_hits` (of `cache_requests`: the compiles that looked in a persistent cache)."""

    def __init__(self) -> None:
        self.seconds: dict[str, dict[str, float]] = collections.defaultdict(lambda: dict.fromkeys(STAGES.values(),
                                                                                                   0.0))
        self.compiles: collections.Counter = collections.Counter()
        self.threads: dict[str, list[str]] = collections.defaultdict(list)  # the thread of each compile, by function
        self.cache_hits = self.cache_requests = 0

    def _listen(self, event: str, secs: float, **kwargs) -> None:
        stage = STAGES.get(event)
        if stage is None:
            return
        name = str(kwargs.get("fun_name", "?"))
        if stage == "trace" and not name.startswith("jit("):  # tracing is reported under the bare name
            name = f"jit({name})"
        self.seconds[name][stage] += secs
        if stage == "compile":
            self.compiles[name] += 1
            self.threads[name].append(threading.current_thread().name)

    def _count(self, event: str, **kwargs) -> None:
        self.cache_hits += event == CACHE_HIT
        self.cache_requests += event == CACHE_REQUEST

    def __enter__(self) -> "CompileLog":
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        jax.monitoring.register_event_listener(self._count)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)
        jax.monitoring.unregister_event_listener(self._count)

    def totals(self) -> dict:
        """Everything recorded so far: compiles, trace_s, lower_s, compile_s (all functions), cache_hits,
        cache_requests; the difference of two totals is what happened between them."""
        return dict(compiles=sum(self.compiles.values()),
                    **{f"{k}_s": sum(s[k] for s in self.seconds.values()) for k in STAGES.values()},
                    cache_hits=self.cache_hits, cache_requests=self.cache_requests)

    def rows(self) -> list[dict]:
        """One dict per compiled function (name, compiles, trace_s, lower_s, compile_s), slowest first."""
        out = [dict(name=name, compiles=self.compiles[name], **{f"{k}_s": v for k, v in s.items()})
               for name, s in self.seconds.items() if self.compiles[name]]
        return sorted(out, key=lambda r: -(r["trace_s"] + r["lower_s"] + r["compile_s"]))

    def table(self, min_seconds: float = 0.0) -> str:
        """The rows as an aligned text table (functions that took at least min_seconds in all)."""
        lines = [f"{'jitted function':<40} {'n':>3} {'trace s':>8} {'lower s':>8} {'compile s':>9}"]
        for r in self.rows():
            if r["trace_s"] + r["lower_s"] + r["compile_s"] < min_seconds:
                continue
            lines.append(f"{r['name'][:40]:<40} {r['compiles']:>3} {r['trace_s']:>8.2f} {r['lower_s']:>8.2f} "
                         f"{r['compile_s']:>9.2f}")
        return "\n".join(lines)


@dataclasses.dataclass
class StepTrace:
    """An `on_tokens` wrapper that records a jax.profiler trace of `steps` decode steps into `directory`, starting
    after `skip` steps (the first step compiles); the trace stops when the steps are done or at `close()`."""

    directory: str
    steps: int
    skip: int = 1
    inner: Callable[[list[int]], object] | None = None
    _seen: int = 0
    _active: bool = False
    _done: bool = False

    def __call__(self, tokens: list[int]):
        # on_tokens is first called with the prefill's token, then once per step
        if self._seen == self.skip and not self._done:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory)
            self._active = True
        self._seen += 1
        if self._active and self._seen > self.skip + self.steps:
            self.close()
        return self.inner(tokens) if self.inner else None

    def close(self) -> None:
        """Stop the trace if it is running."""
        if self._active:
            jax.profiler.stop_trace()
            self._active, self._done = False, True

    @property
    def traced_steps(self) -> int:
        return max(0, min(self._seen - 1 - self.skip, self.steps))
