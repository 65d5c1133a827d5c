"""What the frozen target gives the drafter's training: tap features and its greedy next token at every position."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.config import TargetConfig
from dflash_jax.engine.prefill import DEFAULT_CHUNK
from dflash_jax.models.target import init_state, prefill_chunk


def sequence_logits(params: dict, cfg: TargetConfig, tokens: jax.Array) -> jax.Array:
    """Logits [S, V] of every position of one sequence [S] (S a multiple of the prefill chunk) from an empty state:
    the forward the engine's prefill runs (reference kernels), in chunks, differentiable (the target's own training
    uses it)."""
    return _chunks(params, cfg, tokens, (), lambda logits: logits)[0]


def _chunks(params, cfg, tokens, taps, head):
    """(head(logits) of every position, taps [S, n_taps, H]) of the chunked prefill of a whole sequence; head maps
    a chunk's logits [chunk, V] to what is kept of them."""
    s = tokens.shape[0]
    if s % DEFAULT_CHUNK:
        raise ValueError(f"sequence length {s} is not a multiple of the prefill chunk {DEFAULT_CHUNK}")

    def chunk(state, ids):
        logits, tapped, state = prefill_chunk(params, cfg, state, ids, jnp.int32(DEFAULT_CHUNK), taps,
                                              all_logits=True)
        return state, (head(logits), tapped)

    _, (out, tapped) = jax.lax.scan(chunk, init_state(cfg, s), tokens.reshape(-1, DEFAULT_CHUNK))
    return out.reshape(s, *out.shape[2:]), tapped.reshape(s, len(taps), cfg.hidden_size)


def target_features(params: dict, cfg: TargetConfig, tokens: jax.Array, taps: tuple[int, ...]
                    ) -> tuple[jax.Array, jax.Array]:
    """One sequence [S] (S a multiple of the prefill chunk) from an empty state: taps [S, n_taps, H] and the
    target's argmax after each position [S] (greedy[p] is what the target says comes at p + 1)."""
    greedy, tapped = _chunks(params, cfg, tokens, taps, lambda logits: jnp.argmax(logits, -1).astype(jnp.int32))
    return tapped, greedy
