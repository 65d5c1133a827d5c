"""Drafters that know the answer: they propose a given continuation, with errors injected at a controlled rate.

`OracleDrafter` tests losslessness where random drafters would accept nothing; `ForcedDrafter` forces an acceptance
length in benchmarks while running a real drafter's forward for its cost. Their logits put the true token first,
except at an "error" position (chosen by a hash of the position), where one or two wrong tokens are put above it,
so the true token sits at rank 2 or 3: a chain stops there, a DDTree with top-K >= 3 can still take it through a
sibling branch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


def oracle_logits(sequence: jax.Array, position: jax.Array, depth: int, vocab_size: int, error_rate: jax.Array,
                  seed: int) -> jax.Array:
    """Logits [depth, V] for positions position+1..position+depth: sequence[pos] first, or at rank 2/3 on an error.

    sequence: int32 [S], the token at each absolute position (clipped at its ends); error_rate may be traced.
    """
    pos = position + jnp.arange(1, depth + 1)
    true = sequence[jnp.clip(pos, 0, sequence.shape[0] - 1)]
    keys = jax.vmap(lambda p: jax.random.fold_in(jax.random.PRNGKey(seed), p))(pos)

    def draws(key):
        k1, k2, k3 = jax.random.split(key, 3)
        return (jax.random.normal(k1, (vocab_size,)), jax.random.randint(k2, (2,), 0, vocab_size),
                jax.random.uniform(k3, (2,)))

    noise, wrong, u = jax.vmap(draws)(keys)
    rows = jnp.arange(depth)
    logits = noise.at[rows, true].add(12.0)
    # An error puts one wrong token above the true one, or (half of the errors) two: rank 2 or rank 3.
    wrong1 = jnp.where(wrong[:, 0] == true, (true + 1) % vocab_size, wrong[:, 0])
    wrong2 = jnp.where((wrong[:, 1] == true) | (wrong[:, 1] == wrong1), (true + 2) % vocab_size, wrong[:, 1])
    error = u[:, 0] < error_rate
    logits = logits.at[rows, wrong1].add(jnp.where(error, 14.0, 0.0))
    return logits.at[rows, wrong2].add(jnp.where(error & (u[:, 1] < 0.5), 13.0, 0.0))


@dataclasses.dataclass(frozen=True)
class OracleDrafter:
    """Drafter protocol (engine/step.py) over params {"sequence": int32 [S]}: the token at each position."""

    block_size: int
    vocab_size: int
    error_rate: float
    seed: int = 0
    taps: tuple[int, ...] = ()

    def propose(self, params, state, target_params, root, position, depth):
        return oracle_logits(params["sequence"], position, depth, self.vocab_size, self.error_rate, self.seed)

    def extend(self, params, state, taps, n_valid):
        return state

    def init_state(self, slots, kv_types, context):
        return None


@dataclasses.dataclass(frozen=True)
class ForcedDrafter:
    """A real drafter run for its cost, whose proposals are replaced by the oracle's (benchmarks).

    Params: {"real": the real drafter's params, "sequence": int32 [S], "error_rate": float32 []}; the error rate is
    an argument, so calibrating it does not recompile the step. The real logits enter the result scaled by 1e-3 (far
    below the oracle's gaps of 1 or more), so the compiler keeps the real forward.
    """

    real: Any  # a Drafter (engine/step.py)
    vocab_size: int
    seed: int = 0

    @property
    def block_size(self) -> int:
        return self.real.block_size

    @property
    def taps(self) -> tuple[int, ...]:
        return self.real.taps

    def propose(self, params, state, target_params, root, position, depth):
        real = self.real.propose(params["real"], state, target_params, root, position, depth)
        forced = oracle_logits(params["sequence"], position, depth, self.vocab_size, params["error_rate"], self.seed)
        return forced + 1e-3 * real.astype(jnp.float32)

    def extend(self, params, state, taps, n_valid):
        return self.real.extend(params["real"], state, taps, n_valid)

    def init_state(self, slots, kv_types, context):
        return self.real.init_state(slots, kv_types, context)
