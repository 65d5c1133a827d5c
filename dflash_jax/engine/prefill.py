"""Host-side prompt prefill: checks the tokens, then commits them in fixed-size chunks with one compiled function."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.config import PREFILL_BLOCK, KernelConfig, TargetConfig, check_prefill_chunk
from dflash_jax.engine import programs
from dflash_jax.errors import InputError
from dflash_jax.kernels import REFERENCE
from dflash_jax.models import target
from dflash_jax.engine.state import tree_bytes
from dflash_jax.models.target import Target, TargetState, init_state

DEFAULT_CHUNK = PREFILL_BLOCK  # the delta rule's block: one compilation covers every prompt length


def split_weights(model: Any) -> tuple[nnx.GraphDef, dict]:
    """nnx.split, with the weights as a plain dict of arrays: a jitted call flattens its arguments at every call, and
    a dict flattens fifty times faster than an nnx.State of Variables (0.14 ms against 7 ms for the 27B target's 851
    arrays on a CPU). `nnx.merge(graph, weights)` takes either."""
    graph, state = nnx.split(model)
    return graph, nnx.to_pure_dict(state)


@functools.lru_cache(maxsize=None)
def chunk_function(graph: nnx.GraphDef) -> Callable:
    """The jitted `target.prefill_chunk` of a Target graph, a function of (weights, cfg, state, tokens, n_valid,
    taps, all_logits, kcfg=) with the modules merged at trace time. The graph is closed over, not a static argument:
    hashing the 27B's graph takes 18 ms, which a static argument would pay at every chunk."""

    def chunk(weights: dict, cfg: TargetConfig, state: TargetState, tokens: jax.Array, n_valid: jax.Array,
              taps: tuple[int, ...], all_logits: bool, kcfg: KernelConfig = REFERENCE):
        return target.prefill_chunk(nnx.merge(graph, weights), cfg, state, tokens, n_valid, taps, all_logits, kcfg)

    # the state is donated: each chunk writes the caches in place (without, each chunk held a second copy of them)
    return jax.jit(chunk, static_argnums=(1, 5, 6), static_argnames=("kcfg",), donate_argnums=(2,))


@functools.lru_cache(maxsize=None)
def _bound_chunk(chunk: Callable, digest: str, cfg: TargetConfig, taps: tuple[int, ...], all_logits: bool,
                 kcfg: KernelConfig, folder: str) -> Callable:
    def run(weights, state, tokens, n_valid):
        return chunk(weights, cfg, state, tokens, n_valid, taps, all_logits, kcfg=kcfg)

    describe = f"prefill chunk {cfg!r} taps={taps} all_logits={all_logits} {kcfg!r} graph {digest}"
    return programs.stored(run, describe, folder, donate=(1,), weights=(0,))


@dataclasses.dataclass(frozen=True)
class SplitTarget:
    """A Target split once: its graph, its weights (`split_weights`) and its jitted prefill chunk; a sharded one's
    (dflash_jax/parallel.py) also its TargetParallel."""

    graph: nnx.GraphDef
    weights: dict
    chunk: Callable
    parallel: Any = None  # dflash_jax.parallel.TargetParallel of a sharded target; None on one device

    @classmethod
    def of(cls, model: Target) -> "SplitTarget":
        graph, weights = split_weights(model)
        return cls(graph, weights, chunk_function(graph))

    @functools.cached_property
    def digest(self) -> str:
        """A digest of the graph (its modules' static attributes), for the keys of kept programs."""
        return programs.graph_digest(self.graph)

    def chunk_program(self, cfg: TargetConfig, taps: tuple[int, ...], all_logits: bool, kcfg: KernelConfig,
                      folder: str) -> Callable:
        """`chunk` with its static arguments bound, (weights, state, tokens, n_valid) -> its result, its lowered
        program kept in `folder` (programs.stored; one device only, "" keeps none)."""
        folder = folder if self.parallel is None else ""
        return _bound_chunk(self.chunk, self.digest if folder else "", cfg, taps, all_logits, kcfg, folder)

    def init_state(self, cfg: TargetConfig, slots: int, kv_type: str = "f32", v_type: str | None = None
                   ) -> TargetState:
        """An empty state for this target (`target.init_state`; a sharded target's is laid out over its mesh)."""
        return init_state(cfg, slots, kv_type, v_type)

    def replicated(self, tree: Any) -> Any:
        """A pytree the jitted functions read whole (the drafter's weights and state) placed for them: as it is on
        one device (a sharded target copies it to every device of its mesh)."""
        return tree

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The devices the target's weights and state live on: JAX's first on one device."""
        return (jax.devices()[0],)

    def state_device_bytes(self, state: TargetState) -> int:
        """Bytes of a target state (or its shapes) that each of `devices` holds: all of it on one device."""
        return tree_bytes(state)


def check_tokens(cfg: TargetConfig, ids: np.ndarray | list[int]) -> np.ndarray:
    """The ids as a 1-D int32 array, after checking that they are a non-empty sequence inside the vocabulary."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0:
        raise InputError(f"expected a non-empty 1-D sequence of token ids, got shape {list(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"token ids must be integers, got {arr.dtype}")
    bad = np.flatnonzero((arr < 0) | (arr >= cfg.vocab_size))
    if bad.size:
        raise InputError(f"token id {int(arr[bad[0]])} at position {int(bad[0])} is outside the vocabulary "
                         f"(0..{cfg.vocab_size - 1}); {bad.size} such id(s)")
    return arr.astype(np.int32)


def check_room(state: TargetState, n: int) -> None:
    """Raise InputError unless n more tokens fit the cache after the committed ones."""
    length = int(state.length)
    if length + n > state.slots:
        raise InputError(f"{n} tokens after {length} committed need {length + n} cache slots; the context was "
                         f"allocated with {state.slots} (raise the context size)")


def prefill_chunks(model: Target | SplitTarget, cfg: TargetConfig, state: TargetState, ids: np.ndarray | list[int], *,
                   chunk: int = DEFAULT_CHUNK, taps: tuple[int, ...] = (), all_logits: bool = False,
                   kcfg: KernelConfig = REFERENCE, program_cache: str = ""
                   ) -> Iterator[tuple[int, jax.Array, jax.Array, TargetState]]:
    """Commit a prompt chunk by chunk, yielding (real tokens n, logits, taps [chunk, n_taps, H], state) per chunk;
    consumes `state` (each chunk's state is donated to the next).

    The model is a Target, or a SplitTarget (an engine splits its target once). Logits are the
    chunk's last real token's [V], or with all_logits every real token's [n, V]. Taps keep the chunk's padding rows
    (fixed shape for a jitted consumer such as the drafter); the first n are real. Everything is checked before the
    first chunk runs, so a bad prompt leaves the state as it was. The chunk is a multiple of PREFILL_BLOCK (one
    compiled shape per size; the gated delta rule runs blockwise past one block: kernels.gdn_chunked).
    `program_cache`: a folder that keeps the chunk's lowered program between processes (EngineConfig.program_cache).
    """
    check_prefill_chunk(chunk)
    ids = check_tokens(cfg, ids)
    check_room(state, len(ids))
    split = model if isinstance(model, SplitTarget) else SplitTarget.of(model)
    run = split.chunk_program(cfg, taps, all_logits, kcfg, program_cache)
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        n = len(part)
        tokens = jnp.asarray(np.pad(part, (0, chunk - n)))
        logits, tapped, state = run(split.weights, state, tokens, jnp.int32(n))
        yield n, (logits[:n] if all_logits else logits), tapped, state


def prefill(model: Target | SplitTarget, cfg: TargetConfig, state: TargetState, ids: np.ndarray | list[int], *,
            chunk: int = DEFAULT_CHUNK, taps: tuple[int, ...] = (), kcfg: KernelConfig = REFERENCE
            ) -> tuple[jax.Array, jax.Array, TargetState]:
    """Commit a prompt: the last token's logits [V], the taps of every prompt token [n, n_taps, H], the state."""
    tapped = []
    for n, logits, t, state in prefill_chunks(model, cfg, state, ids, chunk=chunk, taps=taps, kcfg=kcfg):
        tapped.append(t[:n])
    return logits, jnp.concatenate(tapped), state
