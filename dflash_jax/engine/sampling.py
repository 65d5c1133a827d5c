"""Sampling that speculative decoding reproduces exactly: the coupled Gumbel rule (docs/architecture.md, "Sampling").

The token at absolute position t is argmax over the kept tokens of logits_t / T + g_t, where g_t is Gumbel noise
drawn from fold_in(key(seed), t). That is an exact sample of the filtered softmax at t, and it depends on nothing but
(seed, t, logits_t): a tree node draws the token after it with its own position's noise, the walk follows the child
that equals it, and the first miss emits the drawn token. AR, chain and DDTree then emit the same tokens for a seed.

Filters, in this order, on z = logits / T: top-k keeps the tokens whose z is at least the k-th largest (ties at the
boundary kept); top-p keeps, of those, the tokens whose probability is at least that of the token at which the
descending cumulative probability first reaches top_p (ties kept); min-p keeps the tokens whose probability is at
least min_p times the largest.
"""

from __future__ import annotations

import dataclasses
import math
import secrets

import jax
import jax.numpy as jnp

from dflash_jax.config import DRAFT_RULES
from dflash_jax.errors import InputError

SEED_LIMIT = 1 << 32  # seeds are uint32


class SamplingError(InputError):
    """A sampling parameter out of its range."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampling parameters as device scalars: a dynamic argument of the jitted step, so a new value does not
    compile it again."""

    temperature: jax.Array  # [] float32 > 0
    top_p: jax.Array  # [] float32 in (0, 1]; 1: off
    top_k: jax.Array  # [] int32 >= 0; 0: off
    min_p: jax.Array  # [] float32 in [0, 1); 0: off
    seed: jax.Array  # [] uint32


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What a user asks for: temperature 0 is greedy decoding (the other fields are then unused)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self):
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise SamplingError(message)

        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                 f"{name} must be a finite number, got {value!r}")
        for name in ("top_k", "seed"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an integer, got {value!r}")
        need(self.temperature >= 0, f"temperature must be at least 0 (0: greedy), got {self.temperature}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(self.top_k >= 0, f"top_k must be at least 0 (0: off), got {self.top_k}")
        need(0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p}")
        need(0 <= self.seed < SEED_LIMIT, f"seed must be in [0, 2^32), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def device(self) -> Sampling | None:
        """The step's argument: None for greedy decoding, else the parameters as device scalars."""
        if self.greedy:
            return None
        return Sampling(temperature=jnp.float32(self.temperature), top_p=jnp.float32(self.top_p),
                        top_k=jnp.int32(self.top_k), min_p=jnp.float32(self.min_p), seed=jnp.uint32(self.seed))

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        parts += [f"top_p {self.top_p:g}"] if self.top_p < 1 else []
        parts += [f"top_k {self.top_k}"] if self.top_k else []
        parts += [f"min_p {self.min_p:g}"] if self.min_p else []
        return ", ".join(parts + [f"seed {self.seed}"])


GREEDY = SamplingParams()


def seed_or_drawn(seed: int | None, temperature: float) -> int:
    """The seed asked for, else for sampling one drawn at random (report it: it reproduces the run), else 0."""
    if seed is not None:
        return seed
    return secrets.randbelow(SEED_LIMIT) if temperature > 0 else 0


def gumbel_noise(seed: jax.Array, positions: jax.Array, vocab: int) -> jax.Array:
    """Gumbel noise [N, vocab] for the tokens at absolute positions [N]: row i from fold_in(key(seed), positions[i]),
    so a position's noise is the same whichever rows are drawn with it. The generator is threefry whatever JAX's
    default: the RBG generators' bits under vmap depend on the batch."""
    key = jax.random.key(seed, impl="threefry2x32")
    return jax.vmap(lambda t: jax.random.gumbel(jax.random.fold_in(key, t), (vocab,), jnp.float32))(positions)


def _cut_sorted(z: jax.Array, sp: Sampling) -> jax.Array:
    """The top-k and top-p threshold of each row of z [N, V]: the smallest z a kept token may have."""
    s = jnp.flip(jnp.sort(z, axis=-1), axis=-1)  # descending
    k = jnp.clip(sp.top_k, 1, z.shape[-1])
    kth = jnp.where(sp.top_k > 0, s[:, k - 1], -jnp.inf)  # [N]
    kept = s >= kth[:, None]
    p = jnp.where(kept, jnp.exp(s - s[:, :1]), 0.0)
    cum = jnp.cumsum(p, axis=-1) / jnp.sum(p, axis=-1, keepdims=True)
    # the first token at which the cumulative probability reaches top_p; none (rounding) -> the last kept one
    reach = jnp.argmax(cum >= sp.top_p, axis=-1)
    reach = jnp.where(jnp.any(cum >= sp.top_p, axis=-1), reach, jnp.sum(kept, axis=-1) - 1)
    at_p = jnp.take_along_axis(s, reach[:, None], axis=-1)[:, 0]
    return jnp.maximum(kth, jnp.where(sp.top_p < 1, at_p, -jnp.inf))


def filtered_scores(logits: jax.Array, sp: Sampling) -> jax.Array:
    """logits [N, V] / temperature, with -inf for the tokens the filters drop (module docstring)."""
    z = logits.astype(jnp.float32) / sp.temperature
    cut = jax.lax.cond((sp.top_k > 0) | (sp.top_p < 1), _cut_sorted, lambda z, sp: jnp.full(z.shape[:1], -jnp.inf),
                       z, sp)
    top = jnp.max(z, axis=-1)
    cut = jnp.maximum(cut, jnp.where(sp.min_p > 0, top + jnp.log(jnp.maximum(sp.min_p, 1e-38)), -jnp.inf))
    return jnp.where(z >= cut[:, None], z, -jnp.inf)


def perturbed_scores(logits: jax.Array, noise: jax.Array, sp: Sampling) -> jax.Array:
    """filtered_scores + noise: the drawn token is its argmax (`-inf` where filtered out)."""
    return filtered_scores(logits, sp) + noise


def sample(logits: jax.Array, noise: jax.Array, sp: Sampling | None) -> jax.Array:
    """The token [N] int32 each row of logits [N, V] draws with its position's noise [N, V]; argmax when sp is
    None (greedy)."""
    scores = logits if sp is None else perturbed_scores(logits, noise, sp)
    return jnp.argmax(scores, axis=-1).astype(jnp.int32)


def draft_scores(logits: jax.Array, noise: jax.Array, sp: Sampling, rule: str) -> jax.Array:
    """What the tree is built from when sampling, for draft logits [L, V] and the noise of the positions they
    predict [L, V]: "coupled" the draft's own perturbed scores with the target's noise (its chain is then the draft's
    sample under the same coupling, equal to the target's where the two distributions agree), "tempered"
    logits / T, "plain" the logits."""
    if rule == "coupled":
        return logits.astype(jnp.float32) / sp.temperature + noise
    if rule == "tempered":
        return logits.astype(jnp.float32) / sp.temperature
    if rule == "plain":
        return logits
    raise ValueError(f"draft rule {rule!r} is not one of {', '.join(DRAFT_RULES)}")
