"""Building blocks shared by the target and the drafter: RMSNorm, NeoX RoPE, SwiGLU, cache row writes."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax import kv_quant as kvq
from dflash_jax.config import KernelConfig
from dflash_jax.kernels import linear
from dflash_jax.quant import QTensor


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) * w over the last axis, in float32 (GGUF norms already include Qwen3.5's +1)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(jnp.float32)


def rope(x: jax.Array, pos: jax.Array, rope_dim: int, theta: float) -> jax.Array:
    """NeoX rotate-half RoPE on the first rope_dim dims of each head: x [N, H, D], pos [N]."""
    half = rope_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim))
    angle = pos.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [N, half]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:rope_dim], x[..., rope_dim:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def swiglu(x: jax.Array, w_gate: QTensor, w_up: QTensor, w_down: QTensor, kcfg: KernelConfig) -> jax.Array:
    """down(silu(gate x) * up x)."""
    return linear(jax.nn.silu(linear(x, w_gate, kcfg)) * linear(x, w_up, kcfg), w_down, kcfg)


def write_rows(cache: jax.Array | kvq.KVBlocks, rows: jax.Array | kvq.KVBlocks, start: jax.Array,
               layer: int | None = None) -> jax.Array | kvq.KVBlocks:
    """A stacked cache [layers, slots, ...] with rows written at slots start..: rows [n, ...] into one layer, or
    [layers, n, ...] into every layer, in the cache's KV type (float rows are cast or quantized: kv_quant.stored).
    Rows past the end are dropped (a padded last chunk) rather than shifting the write back over committed slots, as
    dynamic_update_slice would. Writing one layer of the stacked cache (not a slice of it, then a stack) lets a
    jitted function update a donated cache in place."""
    rows = kvq.stored(rows, cache)
    slots = start + jnp.arange(rows.shape[0 if layer is not None else 1])
    idx = (layer, slots) if layer is not None else (slice(None), slots)
    return jax.tree.map(lambda c, r: c.at[idx].set(r, mode="drop"), cache, rows)
