"""GGUF K-quant block helpers the kernels' packing needs (ggml-common.h; specs/qwen35_gguf.md §4.2).

dflash_jax.quant builds its dequantizers on these; the kernels import nothing from dflash_jax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QK_K = 256  # super-block size of the K-quants


def nibbles(qs: jax.Array) -> jax.Array:
    """[..., n] bytes -> [..., 2, n]: low nibbles, then high nibbles."""
    return jnp.stack([qs & 0xF, qs >> 4], axis=-2)


def k_scale_min(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Unpack the 12-byte Q4_K/Q5_K scale field [..., 12] into 6-bit scales and mins, each [..., 8]."""
    lo, hi, mix = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = jnp.concatenate([lo & 63, (mix & 0xF) | ((lo >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([hi & 63, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return sc, mn


def q6_k_quants(ql: jax.Array, qh: jax.Array) -> jax.Array:
    """Q6_K's 6-bit quants (0..63, before the offset of 32) [..., 256] uint8 in column order, from its ql [..., 128]
    and qh [..., 64] bytes."""
    lead = ql.shape[:-1]
    low = nibbles(ql.reshape(*lead, 2, 64)).reshape(*lead, 2, 4, 32)  # group 2s + c of half h: ql[64h+32c+l] >> 4s
    high = (qh.reshape(*lead, 2, 1, 32) >> jnp.array([0, 2, 4, 6], jnp.uint8)[:, None]) & 3  # [..., 2, 4, 32]
    return (low | (high << 4)).reshape(*lead, QK_K)
