"""The decode state: everything that carries from step to step, one pytree donated through every step (DESIGN.md
"State"). The target's caches are `models.target.TargetState`, the drafter's its own (`models.draft.DraftState` for
DFlash)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.models.target import TargetState


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
    length, so a later state of the same context still holds them, and only its lengths are set back (`rewind`)."""

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
    draft = None if state.draft is None else dataclasses.replace(state.draft, length=jnp.copy(mark.length))
    return DecodeState(target=target, draft=draft, root=state.root, remaining=jnp.int32(0), done=jnp.bool_(True))
