"""Tile sizes for the Triton backend, whose block dimensions must be powers of two and whose products need 16+, and
the rounding of a float32 tile to a narrower type inside a kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dot_tile(n: int) -> int:
    """The smallest power of two >= n and >= 16: the padded size of a dimension that enters a product."""
    return max(16, 1 << max(0, (n - 1).bit_length()))


def as_float32(x: jax.Array, interpret: bool) -> jax.Array:
    """A bf16/float16 tile's values in float32, inside a kernel, keeping the rounding that made x. Triton keeps a
    float32 -> bf16 -> float32 round trip; XLA on a CPU (interpret mode) dropped it from a kernel body at some tile
    shapes (the GEMV's, 16 x 32 units), so there the rounding is XLA's reduce_precision, which it keeps."""
    if interpret:
        bits = jnp.finfo(x.dtype)
        return jax.lax.reduce_precision(x.astype(jnp.float32), bits.nexp, bits.nmant)
    return x.astype(jnp.float32)
