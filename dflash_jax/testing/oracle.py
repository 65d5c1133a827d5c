"""A drafter that knows the answer: it proposes a given continuation, with errors injected at a controlled rate.

Used to test losslessness where random drafters would accept nothing, and (issue: benchmarks) to force an
acceptance length. Its parameters are the reference sequence by absolute position; its logits put the true token
first, except at an "error" position (chosen by a hash of the position), where one or two wrong tokens are put
above it, so the true token sits at rank 2 or 3: a chain stops there, a DDTree with top-K >= 3 can still take it
through a sibling branch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class OracleDrafter:
    """Drafter protocol (engine/step.py) over params {"sequence": int32 [S]}: the token at each position."""

    block_size: int
    vocab_size: int
    error_rate: float
    seed: int = 0
    taps: tuple[int, ...] = ()

    def propose(self, params, state, target_params, root, position, depth):
        depth = jnp.arange(1, depth + 1)
        pos = position + depth
        seq = params["sequence"]
        true = seq[jnp.clip(pos, 0, seq.shape[0] - 1)]
        keys = jax.vmap(lambda p: jax.random.fold_in(jax.random.PRNGKey(self.seed), p))(pos)
        noise, wrong, u = jax.vmap(self._draws)(keys)
        logits = noise.at[jnp.arange(depth.shape[0]), true].add(12.0)
        rows = jnp.arange(depth.shape[0])
        # An error puts one wrong token above the true one, or (half of the errors) two: rank 2 or rank 3.
        wrong1 = jnp.where(wrong[:, 0] == true, (true + 1) % self.vocab_size, wrong[:, 0])
        wrong2 = jnp.where((wrong[:, 1] == true) | (wrong[:, 1] == wrong1), (true + 2) % self.vocab_size,
                           wrong[:, 1])
        error = u[:, 0] < self.error_rate
        logits = logits.at[rows, wrong1].add(jnp.where(error, 14.0, 0.0))
        logits = logits.at[rows, wrong2].add(jnp.where(error & (u[:, 1] < 0.5), 13.0, 0.0))
        return logits

    def _draws(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        return (jax.random.normal(k1, (self.vocab_size,)), jax.random.randint(k2, (2,), 0, self.vocab_size),
                jax.random.uniform(k3, (2,)))

    def extend(self, params, state, taps, n_valid):
        return state

    def init_state(self, slots, kv_dtype):
        return None
