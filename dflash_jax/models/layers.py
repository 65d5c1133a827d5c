"""Building blocks shared by the target and the drafter: RMSNorm, NeoX RoPE, cache row writes, and the Flax NNX
modules that hold weights (`Linear`, `RMSNorm`, `Embedding`, `MLP`).

A module is a thin holder of `nnx.Param`s whose values are the arrays the kernels take (a QTensor, a PackedWeight
or a float array, docs/architecture.md "Modules"); its call runs the same pure function as before modules
(`kernels.linear`, `rms_norm`). Caches and recurrent state never live in a module: they go in and out as arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax import kv_quant as kvq
from dflash_jax.config import KernelConfig
from dflash_jax.kernels import linear, linears
from dflash_jax.quant import QTensor, dequantize, take_rows


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) * w over the last axis, in float32 (GGUF norms already include Qwen3.5's +1)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(jnp.float32)


# RoPE angles as exact turns: a float32 product pos * inv_freq is off by up to half an ulp of the angle (0.008 rad
# at position 262,143 for inv_freq 1), and so are HF's and llama.cpp's, each differently. The position is split into
# 12-bit chunks and each chunk's share of the turn, (chunk * 2^shift * inv_freq / 2pi) mod 1, is summed from products
# that are exact in float32 (a 12-bit chunk times a 12-bit fixed-point part of a float64 constant), so the angle is
# the float64 one to within 1e-6 of a turn at any int32 position (tests/test_long_context.py).
_CHUNK_BITS = 12


def _split_turns(c: np.ndarray) -> list[np.ndarray]:
    """Float64 fractions c [half] in [0, 1) as three float32 parts: two of 12 fixed-point bits each (multiples of
    2^-12 and 2^-24, whose product with a 12-bit integer is exact) and the rest."""
    one = 2.0 ** _CHUNK_BITS
    hi = np.floor(c * one) / one
    mid = np.floor((c - hi) * one * one) / (one * one)
    return [p.astype(np.float32) for p in (hi, mid, c - hi - mid)]


def rope_turns(pos: jax.Array, rope_dim: int, theta: float) -> jax.Array:
    """pos [N] int * inv_freq / 2pi mod 1, in [-0.5, 0.5): float32 [N, rope_dim / 2], exact to a few float32 ulps."""
    inv_freq = 1.0 / (float(theta) ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))
    pos = pos.astype(jnp.int32)
    mask = (1 << _CHUNK_BITS) - 1
    turns = jnp.zeros((pos.shape[0], rope_dim // 2), jnp.float32)
    for shift in range(0, 32, _CHUNK_BITS):  # 3 chunks cover int32
        chunk = ((pos >> shift) & mask).astype(jnp.float32)[:, None]
        for part in _split_turns(np.mod(inv_freq / (2 * np.pi) * 2.0 ** shift, 1.0)):
            x = chunk * part[None, :]
            turns = turns + (x - jnp.floor(x))
    return turns - jnp.round(turns)


def rope(x: jax.Array, pos: jax.Array, rope_dim: int, theta: float) -> jax.Array:
    """NeoX rotate-half RoPE on the first rope_dim dims of each head: x [N, H, D], pos [N]."""
    half = rope_dim // 2
    angle = rope_turns(pos, rope_dim, theta) * np.float32(2 * np.pi)  # [N, half]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:rope_dim], x[..., rope_dim:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def write_slots(cache: jax.Array | kvq.KVBlocks, rows: jax.Array | kvq.KVBlocks, slots: jax.Array,
                layer: int) -> jax.Array | kvq.KVBlocks:
    """A stacked cache [layers, slots, ...] with rows [n, ...] written into one layer at slots [n], in the cache's KV
    type (float rows are cast or quantized: kv_quant.stored); a slot past the cache's end drops its row. Writing one
    layer of the stacked cache (not a slice of it, then a stack) lets a jitted function update a donated cache in
    place."""
    rows = kvq.stored(rows, cache)
    return jax.tree.map(lambda c, r: c.at[layer, slots].set(r, mode="drop"), cache, rows)


def write_rows(cache: jax.Array | kvq.KVBlocks, rows: jax.Array | kvq.KVBlocks, start: jax.Array,
               layer: int | None = None) -> jax.Array | kvq.KVBlocks:
    """A stacked cache [layers, slots, ...] with rows written at slots start..: rows [n, ...] into one layer, or
    [layers, n, ...] into every layer, in the cache's KV type (as `write_slots`). Rows past the end are dropped (a
    padded last chunk) rather than shifting the write back over committed slots, as dynamic_update_slice would."""
    slots = start + jnp.arange(rows.shape[0 if layer is not None else 1])
    if layer is not None:
        return write_slots(cache, rows, slots, layer)
    rows = kvq.stored(rows, cache)
    return jax.tree.map(lambda c, r: c.at[:, slots].set(r, mode="drop"), cache, rows)


# ---------------------------------------------------------------------------------------------------------------
# Modules

class Linear(nnx.Module):
    """x @ weight.T for a weight [out, in] in any stored layout (`kernels.linear` dispatches on it); given a
    variable, the Linear shares it (a head tied to the embedding)."""

    def __init__(self, weight: Any):
        self.weight = weight if isinstance(weight, nnx.Variable) else nnx.Param(weight)

    def __call__(self, x: jax.Array, kcfg: KernelConfig) -> jax.Array:
        return linear(x, self.weight.get_value(), kcfg)


def products(x: jax.Array, modules: Sequence[Linear], kcfg: KernelConfig) -> list[jax.Array]:
    """[m(x, kcfg) for m in modules], bit for bit, in as few launches as their weights allow (`kernels.linears`)."""
    return linears(x, [m.weight.get_value() for m in modules], kcfg)


class GatheredLinear(Linear):
    """A Linear holding a shard's rows of a matrix split over a mesh axis (inside a shard_map): its products are
    gathered along the last axis, every shard's rows in order, so each shard sees the whole product."""

    def __init__(self, weight: Any, axis: str):
        super().__init__(weight)
        self.axis = axis

    def __call__(self, x: jax.Array, kcfg: KernelConfig) -> jax.Array:
        y = super().__call__(x, kcfg)
        return jax.lax.all_gather(y, self.axis, axis=y.ndim - 1, tiled=True)


class RMSNorm(nnx.Module):
    """`rms_norm` with its weight [dim] (GGUF norms have Qwen's +1 folded in) and epsilon."""

    def __init__(self, weight: jax.Array, eps: float):
        self.weight = nnx.Param(weight)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight.get_value(), self.eps)


class Embedding(nnx.Module):
    """Token embedding rows [N, H] float32 from a table [V, H] (a QTensor is read by row, never dequantized whole)."""

    def __init__(self, weight: Any):
        self.weight = nnx.Param(weight)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        table = self.weight.get_value()
        return dequantize(take_rows(table, tokens)) if isinstance(table, QTensor) else table[tokens]


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, gate_proj: Any, up_proj: Any, down_proj: Any):
        self.gate_proj, self.up_proj, self.down_proj = Linear(gate_proj), Linear(up_proj), Linear(down_proj)

    def __call__(self, x: jax.Array, kcfg: KernelConfig) -> jax.Array:
        gate, up = products(x, (self.gate_proj, self.up_proj), kcfg)
        return self.down_proj(jax.nn.silu(gate) * up, kcfg)


class AttentionWeights(nnx.Module):
    """The weights of a Qwen3-style attention: q/k/v/o projections and per-head q/k RMSNorms (the target's
    GatedAttention and the drafter's DraftAttention add their forward)."""

    def __init__(self, q_proj: Any, k_proj: Any, v_proj: Any, o_proj: Any, q_norm: jax.Array, k_norm: jax.Array,
                 eps: float):
        self.q_proj, self.k_proj, self.v_proj = Linear(q_proj), Linear(k_proj), Linear(v_proj)
        self.o_proj = Linear(o_proj)
        self.q_norm, self.k_norm = RMSNorm(q_norm, eps), RMSNorm(k_norm, eps)


def weight_at(module: nnx.Module, path: str) -> Any:
    """The value of the variable at a dotted path below a module (`layers.3.self_attn.q_proj.weight`)."""
    node: Any = module
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node.get_value()
