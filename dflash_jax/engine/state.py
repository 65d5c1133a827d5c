"""The decode state: everything that carries from step to step, one pytree donated through every step (DESIGN.md
"State"). The target's caches are `models.target.TargetState`, the drafter's its own (`models.draft.DraftState` for
DFlash). A Mark (the recurrent part) or a Snapshot (the whole context, copied) keeps a point of a state's past to go
back to."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.models.target import TargetState


def tree_bytes(tree: Any) -> int:
    """Bytes of every array (or shape) in a pytree as laid out on a device: parameters or a decode state (int4, the
    Mosaic GPU layout's quants, two to a byte)."""
    bits = lambda dtype: 4 if dtype in (jnp.int4, jnp.uint4) else 8 * dtype.itemsize  # noqa: E731
    return sum(x.size * bits(x.dtype) // 8 for x in jax.tree.leaves(tree))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything that carries from step to step."""

    target: TargetState
    draft: Any  # the drafter's state (DraftState for DFlash; None in ar mode)
    root: jax.Array  # [] int32: pending token, emitted but not yet run through the target
    remaining: jax.Array  # [] int32: tokens still to emit
    done: jax.Array  # [] bool: a stop token was emitted or nothing remains; further steps do nothing


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mark:
    """The recurrent part of a target state after its first `length` committed tokens, kept to go back there later.

    The attention caches (the target's and the drafter's) need no copy: nothing is written below the committed
    length, so a later state of the same context still holds them, and only its lengths are set back (`rewind`). A
    drafter's ring is the exception: it overwrites its oldest positions, and keeps showing only those it still holds
    (models/draft.py, `DraftState.rewound`): the drafter may then see less context, never other keys."""

    conv: jax.Array  # [gdn_layers, conv_kernel - 1, conv_dim]
    ssm: jax.Array  # [gdn_layers, value_heads, key_head_dim, value_head_dim]
    length: jax.Array  # [] int32


def take_mark(target: TargetState) -> Mark:
    """A copy of the state's recurrent part (the state itself goes on, donated, to the next chunk or step)."""
    return Mark(conv=jnp.copy(target.conv), ssm=jnp.copy(target.ssm), length=jnp.copy(target.length))


def rewind(state: DecodeState, mark: Mark) -> DecodeState:
    """A later state of the context `mark` was taken in, set back to the mark (consumes `state`; the mark stays
    usable). Nothing is pending: continue it with `keep_pending=False`."""
    target = dataclasses.replace(state.target, conv=jnp.copy(mark.conv), ssm=jnp.copy(mark.ssm),
                                 length=jnp.copy(mark.length))
    draft = None if state.draft is None else state.draft.rewound(mark.length)
    return DecodeState(target=target, draft=draft, root=state.root, remaining=jnp.int32(0), done=jnp.bool_(True))


PAGE = 256  # a snapshot copies the attention caches' rows in pages of this many slots: one compiled copy per cache
# shape serves every length, where a copy of exactly the used rows would compile once per length


Caches = tuple[Any, ...]  # the attention caches: each an array [layers, slots, kv_heads, head_dim] or a KVBlocks
# (dflash_jax/kv_quant.py) whose every field is [layers, slots, kv_heads, head_dim / 32, count]: slots on axis 1


@jax.jit
def _take_page(caches: Caches, start: jax.Array, length: jax.Array) -> Caches:
    """Slots start..start+PAGE of each cache (of each field of a block cache; all of a cache of fewer slots, a
    drafter's ring), those from `length` on (or past the cache's end) zero."""
    def take(c: jax.Array) -> jax.Array:
        rows = start + jnp.arange(min(PAGE, c.shape[1]))
        return jnp.take(c, jnp.where(rows < length, rows, c.shape[1]), axis=1, mode="fill", fill_value=0)

    return jax.tree.map(take, caches)


@functools.partial(jax.jit, donate_argnums=(0,))
def _put_page(caches: Caches, page: Caches, start: jax.Array) -> Caches:
    """The caches with a page written at slots start.. (slots past a cache's end dropped); in place."""
    return jax.tree.map(lambda c, p: c.at[:, start + jnp.arange(p.shape[1])].set(p, mode="drop"), caches, page)


def _attention_caches(target: TargetState, draft: Any) -> Caches:
    return (target.k, target.v) + (() if draft is None else (*draft.k, *draft.v))


def _paged(caches: Caches, length: int, start: int) -> tuple[int, ...]:
    """Which caches a page from slot `start` copies for a state of `length` committed tokens: those whose used slots
    (below the length, and below the cache's size: a drafter's ring holds its window in fewer) reach the page."""
    return tuple(i for i, c in enumerate(caches) if start < min(length, c.shape[1]))


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A decode state after its first `length` committed tokens, copied apart from it to resume there later (the
    state itself goes on): its recurrent part (a Mark), the attention caches' rows of those tokens, the target's
    and the drafter's, in pages of PAGE slots (the last one zero past the length; a drafter's ring only up to its
    size), and the drafter's ring starts."""

    length: int
    mark: Mark
    pages: tuple[Caches, ...]  # per page: the caches `_paged` names (target k, v, drafter k, v per group), PAGE slots
    # each (a cache's all where it has fewer)
    draft_start: jax.Array | None = None  # [groups] int32: DraftState.start (None without a drafter)

    @property
    def nbytes(self) -> int:
        """Device bytes the snapshot holds (its mark's included; every field of a block cache's pages)."""
        return sum(x.nbytes for x in jax.tree.leaves((self.mark, self.pages, self.draft_start)))


def take_snapshot(target: TargetState, draft: Any, length: int, mark: Mark | None = None) -> Snapshot:
    """A Snapshot of a state whose committed length is `length` (given by the host, which knows it: reading the
    device's would wait for the prefill in flight); `mark`, if given, is a Mark of that same state."""
    caches = _attention_caches(target, draft)
    pages = []
    for start in range(0, length, PAGE):
        paged = _paged(caches, length, start)
        pages.append(_take_page(tuple(caches[i] for i in paged), jnp.int32(start), jnp.int32(length)))
    return Snapshot(length, take_mark(target) if mark is None else mark, tuple(pages),
                    None if draft is None else jnp.copy(draft.start))


def restore(snapshot: Snapshot, target: TargetState, draft: Any) -> DecodeState:
    """A state holding what `snapshot` holds, written into empty states (consumed); the snapshot stays usable.
    Nothing is pending: continue it with `keep_pending=False`."""
    linear = [target.k] + ([] if draft is None else [c for c, ring in zip(draft.k, draft.rings) if not ring])
    slots = min(c.shape[1] for c in linear)  # a ring holds any length
    if snapshot.length > slots:
        raise ValueError(f"a snapshot of {snapshot.length} tokens does not fit caches of {slots} slots")
    caches = list(_attention_caches(target, draft))
    for i, page in enumerate(snapshot.pages):
        paged = _paged(caches, snapshot.length, i * PAGE)
        written = _put_page(tuple(caches[c] for c in paged), page, jnp.int32(i * PAGE))
        for c, cache in zip(paged, written):
            caches[c] = cache
    mark = snapshot.mark
    target = dataclasses.replace(target, k=caches[0], v=caches[1], conv=jnp.copy(mark.conv), ssm=jnp.copy(mark.ssm),
                                 length=jnp.copy(mark.length))
    if draft is not None:
        groups = len(draft.k)
        draft = dataclasses.replace(draft, k=tuple(caches[2:2 + groups]), v=tuple(caches[2 + groups:]),
                                    length=jnp.copy(mark.length), start=jnp.copy(snapshot.draft_start))
    return DecodeState(target=target, draft=draft, root=jnp.int32(0), remaining=jnp.int32(0), done=jnp.bool_(True))
