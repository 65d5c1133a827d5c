"""The decode state: everything that carries from step to step, one pytree donated through every step (DESIGN.md
"State"). The target's caches are `models.target.TargetState`, the drafter's its own (`models.draft.DraftState` for
DFlash)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

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
