"""The generation loop: prefill, then jitted steps, dispatching step k+1 before reading step k's tokens."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.config import MAX_TREE_NODES, SINGLE_DEVICE, EngineConfig, KernelConfig, ParallelConfig, TargetConfig
from dflash_jax.engine.prefill import InputError, SplitTarget, check_tokens, prefill_chunks, split_weights
from dflash_jax.engine.sampling import GREEDY, Sampling, SamplingParams, gumbel_noise, sample
from dflash_jax.engine.state import DecodeState, Mark, Snapshot, restore, take_mark, take_snapshot, tree_bytes
from dflash_jax.engine.step import MAX_STOP_IDS, DFlashDrafter, Drafter, emit_width, make_step
from dflash_jax.kernels import REFERENCE
from dflash_jax.models import draft as draft_model
from dflash_jax.models.target import Target
from dflash_jax.parallel import split_target


@functools.lru_cache(maxsize=None)
def extend_function(drafter: Drafter, graph: nnx.GraphDef) -> Callable:
    """The jitted `drafter.extend` of params of this graph: (weights, state, taps, n_valid) -> state."""
    # the drafter's state is donated: each prompt chunk writes its context cache in place
    return jax.jit(lambda weights, state, taps, n: drafter.extend(nnx.merge(graph, weights), state, taps, n),
                   donate_argnums=(1,))


AHEAD_THREAD = "compile the step ahead"


def _compile_quietly(lowered: Any) -> None:
    """lowered.compile(), its executable then found by the step's first call; a compile that fails here is left to
    that call, which compiles again and raises where the caller sees it."""
    try:
        lowered.compile()
    except Exception:  # noqa: BLE001
        pass


@jax.jit
def _first_token(logits: jax.Array, position: jax.Array, sampling: Sampling | None) -> jax.Array:
    """The token a prompt's last logits [V] draw at absolute `position` (the step's rule, for one row)."""
    noise = None if sampling is None else gumbel_noise(sampling.seed, position[None], logits.shape[-1])
    return sample(logits[None], noise, sampling)[0]


@dataclasses.dataclass
class Generation:
    """Generated tokens and how the run went."""

    tokens: list[int]
    accept_lengths: list[int]  # tokens emitted per step (accepted draft tokens + the bonus)
    off_spine_steps: int  # steps whose accepted path left the draft's top-1 tokens (a tree branch paid off)
    prefill_s: float
    decode_s: float
    stopped: bool  # ended at a stop token (else at n_gen)
    first_step_s: float = 0.0  # decode time until the first step's tokens were read (compiles the step once)
    state: DecodeState | None = None  # the final state: pass it as `after` to continue the same conversation
    halted: bool = False  # on_tokens asked to stop: state is None, as the device had already run the next step
    mark: Mark | None = None  # with `mark_at`: the state after that many prompt ids, to `rewind` the final one to
    snapshots: tuple[Snapshot, ...] = ()  # with `snapshot_at`: the state after each of those many prompt ids

    @property
    def steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def mean_accept_length(self) -> float:
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decoded = sum(self.accept_lengths)
        return decoded / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def steady_tokens_per_s(self) -> float:
        """Decode rate after the first step (which includes compiling the step function on a fresh engine)."""
        later, seconds = sum(self.accept_lengths[1:]), self.decode_s - self.first_step_s
        return later / seconds if later and seconds > 0 else 0.0

    def histogram(self, width: int) -> list[int]:
        """How many steps emitted 1, 2, ..., width tokens."""
        return np.bincount(np.asarray(self.accept_lengths, int), minlength=width + 1)[1:width + 1].tolist()


class Engine:
    """A target, an optional drafter, an EngineConfig and the KernelConfig the target's weights were laid out for,
    with the compiled functions they need.

    The target module and the drafter's params (a Draft module, or whatever its Drafter takes) are split once
    (`prefill.split_weights`): the jitted functions take their weights (`tweights`, `dweights`, dicts of arrays) and
    close over their graphs, so no step merges, flattens or hashes a module.

    With `parallel` over several devices the target is split over them (dflash_jax.parallel.ShardedTarget: its
    matrices must then be in the layout they load in), or comes split (a ShardedTarget, as `parallel.load_sharded`
    loads one), the drafter replicated."""

    def __init__(self, tcfg: TargetConfig, tparams: Target | SplitTarget, ecfg: EngineConfig,
                 drafter: Drafter | None = None, dparams: Any = None, kcfg: KernelConfig = REFERENCE,
                 parallel: ParallelConfig = SINGLE_DEVICE):
        if ecfg.mode != "ar" and drafter is None:
            raise ValueError(f"mode {ecfg.mode!r} needs a drafter")
        self.tcfg, self.ecfg = tcfg, ecfg
        self.tsplit = split_target(tparams, kcfg, parallel)
        self.parallel = self.tsplit.parallel
        self.tgraph, self.tweights = self.tsplit.graph, self.tsplit.weights
        self.drafter = drafter if ecfg.mode != "ar" else None
        self.block_size = drafter.block_size if self.drafter else 1
        self.width = emit_width(ecfg, self.block_size)
        self.kcfg = kcfg
        self._ahead: threading.Thread | None = None  # the step's compile begun ahead of its first call
        self._ahead_done: set = set()  # the step signatures (sampling's tree) compiled or being compiled ahead
        self.dparams = dparams

    @property
    def step(self) -> Callable:
        """The jitted step, (tweights, dweights, state, stop ids, sampling params) -> (state, StepOut); a compile of
        it begun ahead (`_compile_ahead`) is waited for first, so that the call finds its executable."""
        self._join_ahead()
        return self._step

    def _join_ahead(self) -> None:
        """Wait for the step's compile begun ahead, if one is running."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.join()

    def _compile_ahead(self, stops: jax.Array, params: Any) -> None:
        """With EngineConfig.compile_ahead: trace and lower the step for a fresh generation's state here, then
        compile it on a thread while the prompt is prefilled, so that a cold start's two largest compiles, the
        prefill chunk's and the step's, run side by side. Once per sampling kind (greedy or sampled); on one device
        only (a mesh's state is laid out by the prefill, and its step compiles at its first call as before)."""
        key = jax.tree.structure(params)
        if self.parallel is not None or key in self._ahead_done:
            return
        self._ahead_done.add(key)
        tstate, dstate = jax.eval_shape(self._empty_states)
        scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)  # noqa: E731
        state = DecodeState(target=tstate, draft=dstate, root=scalar(jnp.int32), remaining=scalar(jnp.int32),
                            done=scalar(jnp.bool_))
        lowered = self._step.lower(self.tweights, self.dweights, state, stops, params)
        self._join_ahead()  # one compile ahead at a time
        # not a daemon: a process that ends before its first step (a reply that is one stop token) waits for the
        # compile rather than tearing XLA down under it
        self._ahead = threading.Thread(target=_compile_quietly, args=(lowered,), name=AHEAD_THREAD)
        self._ahead.start()

    @property
    def dparams(self) -> Any:
        """The drafter's params (the step runs the split of them)."""
        return nnx.merge(self.dgraph, self.dweights)

    @dparams.setter
    def dparams(self, dparams: Any) -> None:
        # new params of the same graph (an oracle's sequence) reuse the compiled functions
        self.dgraph, self.dweights = split_weights(dparams)
        self.dweights = self.tsplit.replicated(self.dweights)
        self._step = make_step(self.tcfg, self.drafter, self.ecfg.step_config(), self.tgraph, self.dgraph, self.kcfg,
                               self.parallel)
        self.extend = extend_function(self.drafter, self.dgraph) if self.drafter else None

    @classmethod
    def from_loaded(cls, target, draft, ecfg: EngineConfig, parallel: ParallelConfig = SINGLE_DEVICE,
                    kcfg: KernelConfig | None = None) -> "Engine":
        """An engine from `load_target` (or `parallel.load_split`) / `load_draft` results (draft may be None in ar
        mode); `kcfg` (default: the target's) is the shards' layout when `parallel` splits a target loaded in the
        reference layout."""
        kcfg = target.kcfg if kcfg is None else kcfg
        if draft is None:
            return cls(target.config, target, ecfg, kcfg=kcfg, parallel=parallel)
        dcfg = draft.config
        draft_model.check_pair(dcfg, target.config)
        return cls(target.config, target, ecfg, DFlashDrafter(dcfg, kcfg.drafter), draft, kcfg=kcfg,
                   parallel=parallel)

    def _empty_states(self):
        """A fresh generation's (target state, drafter state or None). The target's has slack for the largest tree
        in every mode: one cache shape per max_ctx, so switching mode or budget does not compile the prefill again."""
        kv_types, max_ctx = self.ecfg.kv_types, self.ecfg.max_ctx
        draft = self.drafter.init_state(max_ctx, kv_types, self.ecfg.draft_ctx) if self.drafter else None
        return self.tsplit.init_state(self.tcfg, max_ctx + MAX_TREE_NODES, *kv_types), self.tsplit.replicated(draft)

    def state_bytes(self, per_device: bool = False) -> int:
        """Bytes of the caches a generation allocates (`_empty_states`), from their shapes alone: nothing is
        allocated. per_device: the bytes each of `devices` holds (a sharded target's share of its caches, the
        drafter's whole), which is all of them on one device."""
        tstate, dstate = jax.eval_shape(self._empty_states)
        return (self.tsplit.state_device_bytes(tstate) if per_device else tree_bytes(tstate)) + tree_bytes(dstate)

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The devices the engine's weights and state live on (a sharded target's mesh, else JAX's first)."""
        return self.tsplit.devices

    def start(self, prompt_ids: Sequence[int] | np.ndarray, n_gen: int, stop_ids: Sequence[int] = (),
              after: DecodeState | None = None, keep_pending: bool = True,
              sampling: SamplingParams = GREEDY) -> tuple[DecodeState, int]:
        """Prefill a prompt: the decode state and the first generated token (already counted against n_gen).

        With `after` (a finished generation's state, which this consumes), the prompt continues that context: only
        the previous reply's last token, still pending, and the new ids are prefilled; with keep_pending False that
        last token is dropped (a chat replaces the stop token that ended a reply by its template's own)."""
        state, first, _, _ = self._start(prompt_ids, n_gen, stop_ids, after, keep_pending, sampling=sampling)
        return state, first

    def snapshot(self, state: DecodeState) -> Snapshot:
        """A copy of a finished generation's state at its committed length (its pending token left out), to
        `restore` later; the state itself stays usable."""
        return take_snapshot(state.target, state.draft, int(state.target.length))

    def restore(self, snapshot: Snapshot) -> DecodeState:
        """A fresh state (this engine's context) holding what `snapshot` holds: continue it with `after=` and
        `keep_pending=False`, which prefills only the ids past the snapshot's."""
        return restore(snapshot, *self._empty_states())

    def _prefill(self, tstate, dstate, ids: np.ndarray):
        """Commit checked ids to the target's and the drafter's states: (last logits, target state, drafter state)."""
        taps = self.drafter.taps if self.drafter else ()
        chunks = prefill_chunks(self.tsplit, self.tcfg, tstate, ids, chunk=self.ecfg.prefill_chunk, taps=taps,
                                kcfg=self.kcfg, program_cache=self.ecfg.program_cache)
        for n, logits, tapped, tstate in chunks:
            if self.drafter:
                dstate = self.extend(self.dweights, dstate, tapped, jnp.int32(n))
        return logits, tstate, dstate

    def _start(self, prompt_ids: Sequence[int] | np.ndarray, n_gen: int, stop_ids: Sequence[int],
               after: DecodeState | None, keep_pending: bool, mark_at: int = 0,
               sampling: SamplingParams = GREEDY, snapshot_at: Sequence[int] = ()
               ) -> tuple[DecodeState, int, Mark | None, tuple[Snapshot, ...]]:
        """`start`, and with mark_at > 0 a Mark of the state after the first mark_at prompt ids, with snapshot_at a
        Snapshot after each of those many (the prompt is then prefilled in parts, split there)."""
        ids = check_tokens(self.tcfg, prompt_ids)
        if n_gen < 1:
            raise InputError(f"n_gen must be at least 1, got {n_gen}")
        for name, at in [("mark_at", mark_at)] + [("snapshot_at", at) for at in snapshot_at]:
            if not 0 <= at <= len(ids):
                raise ValueError(f"{name} {at} is outside the prompt of {len(ids)} ids")
        committed = int(after.target.length) if after is not None else 0
        shift = 1 if after is not None and keep_pending else 0  # the pending token goes first
        if shift:
            ids = np.concatenate([np.asarray([int(after.root)], np.int32), ids])
        if committed + len(ids) + n_gen > self.ecfg.max_ctx:
            before = f"{committed} committed tokens + " if after is not None else ""
            raise InputError(f"{before}prompt of {len(ids)} tokens + {n_gen} to generate exceeds the context of "
                             f"{self.ecfg.max_ctx} tokens (raise max_ctx)")
        tstate, dstate = (after.target, after.draft) if after is not None else self._empty_states()
        if self.ecfg.compile_ahead and n_gen > 1:  # a single token needs no step
            self._compile_ahead(self.stop_array(stop_ids), self.tsplit.replicated(sampling.device()))
        mark, snapshots = None, []
        kept = {at + shift for at in (mark_at, *snapshot_at) if at}  # where a copy is taken, in ids
        cuts = sorted(kept | {0, len(ids)})
        for begin, end in zip(cuts, cuts[1:]):
            logits, tstate, dstate = self._prefill(tstate, dstate, ids[begin:end])
            if end in kept:
                here = take_mark(tstate)
                mark = here if end - shift == mark_at else mark
                if end - shift in snapshot_at:
                    snapshots.append(take_snapshot(tstate, dstate, committed + end, here))
        first = int(_first_token(logits, jnp.int32(committed + len(ids)), sampling.device()))
        done = first in stop_ids or n_gen == 1
        # placed as the step's outputs are (replicated over a mesh): an argument placed otherwise compiles the step
        # again, once for the first step and once for the rest
        root, remaining, done = self.tsplit.replicated((jnp.int32(first), jnp.int32(n_gen - 1), jnp.bool_(done)))
        state = DecodeState(target=tstate, draft=dstate, root=root, remaining=remaining, done=done)
        return state, first, mark, tuple(snapshots)

    def stop_array(self, stop_ids: Sequence[int]) -> jax.Array:
        """The step's stop ids argument, padded with -1, on the devices the step runs on (a copy made per step
        otherwise: over a mesh, each step would copy an array on one device to the others before it starts)."""
        if len(stop_ids) > MAX_STOP_IDS:
            raise InputError(f"at most {MAX_STOP_IDS} stop tokens are supported, got {len(stop_ids)}")
        return self.tsplit.replicated(jnp.asarray(list(stop_ids) + [-1] * (MAX_STOP_IDS - len(stop_ids)), jnp.int32))

    def generate(self, prompt_ids: Sequence[int] | np.ndarray, n_gen: int, stop_ids: Sequence[int] = (),
                 on_tokens: Callable[[list[int]], None] | None = None, after: DecodeState | None = None,
                 keep_pending: bool = True, mark_at: int = 0, sampling: SamplingParams = GREEDY,
                 snapshot_at: Sequence[int] = ()) -> Generation:
        """Generation of up to n_gen tokens (greedy, or sampled as `sampling` says), ending after a stop token;
        on_tokens streams them.

        on_tokens may return True to end the generation there (a stop string, a client gone); the result then has
        no state to continue from. `after` continues from a previous Generation's `state` (see `start`). mark_at > 0
        also gives the result a `mark` after that many prompt ids, which `state.rewind` sets the final state (or a
        later one of the same context) back to; snapshot_at gives it a Snapshot after each of those many prompt ids,
        which `restore` makes a new state of (they are taken even when the generation halts)."""
        self.stop_array(stop_ids)  # checked before any compute
        t0 = time.perf_counter()
        state, first, mark, snapshots = self._start(prompt_ids, n_gen, stop_ids, after, keep_pending, mark_at,
                                                    sampling, snapshot_at)
        jax.block_until_ready(state)
        gen = self.decode(state, first, n_gen, stop_ids, on_tokens, prefill_s=time.perf_counter() - t0,
                          sampling=sampling)
        return dataclasses.replace(gen, mark=mark, snapshots=snapshots)

    def decode(self, state: DecodeState, first: int, n_gen: int, stop_ids: Sequence[int] = (),
               on_tokens: Callable[[list[int]], None] | None = None, prefill_s: float = 0.0,
               sampling: SamplingParams = GREEDY) -> Generation:
        """The step loop of `generate` from a prefilled state whose pending token `first` is already emitted
        (state.remaining counts the rest of n_gen); consumes the state. `sampling` must be what `start` used."""
        stops = self.stop_array(stop_ids)
        params = self.tsplit.replicated(sampling.device())
        t1 = time.perf_counter()
        tokens, lengths, off_spine, first_step_s = [first], [], 0, 0.0
        halted = bool(on_tokens and on_tokens([first]))
        stopped = first in stop_ids
        finished = stopped or n_gen == 1 or halted
        if not finished:
            step = self.step  # once: it may wait for the step's compile begun ahead
            state, current = step(self.tweights, self.dweights, state, stops, params)
        while not finished:
            state, following = step(self.tweights, self.dweights, state, stops, params)  # queued before the read
            count = int(current.count)
            if not lengths:
                first_step_s = time.perf_counter() - t1
            new = np.asarray(current.tokens)[:count].tolist()
            if count == 0:  # the device had already finished
                break
            lengths.append(count)
            off_spine += bool(current.off_spine)
            for i, tok in enumerate(new):
                if tok in stop_ids:
                    new, stopped = new[:i + 1], True
                    break
            new = new[:n_gen - len(tokens)]
            tokens.extend(new)
            halted = bool(on_tokens and new and on_tokens(new))
            finished = stopped or len(tokens) >= n_gen or halted
            current = following
        jax.block_until_ready(state)
        return Generation(tokens=tokens, accept_lengths=lengths, off_spine_steps=off_spine, prefill_s=prefill_s,
                          decode_s=time.perf_counter() - t1, stopped=stopped, first_step_s=first_step_s,
                          state=None if halted else state, halted=halted)
