"""Random weights in any GGUF block format, generated on the device (for kernel tests and benchmarks at 27B sizes).

Quant bytes are uniform random bits and float fields small random normals, so every code path sees real data
(never zeros) and no scale is NaN or inf.

The values are cut from draws (random 32-bit words for the integer fields, normals for the float ones) whose sizes
are rounded up to powers of two: jax compiles its random-bit generator once per distinct shape (about half a second
each on a CPU), and the rounding keeps the distinct shapes to a handful where every field of every matrix shape
would otherwise need its own.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dflash_jax.quant import FORMATS, QTensor

_MIN_WORDS = 1 << 14


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype == ml_dtypes.bfloat16


def _words_for(dtype: np.dtype, count: int) -> int:
    """Random words an integer field of `count` elements takes: its bytes, rounded up."""
    return -(-count * dtype.itemsize // 4)


def _bucket(count: int) -> int:
    return max(_MIN_WORDS, 1 << (count - 1).bit_length())


@functools.partial(jax.jit, static_argnums=1)
def _random_words(key: jax.Array, count: int) -> jax.Array:
    return jax.random.bits(key, (count,), jnp.uint32)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _random_floats(key: jax.Array, count: int, kind: str = "normal") -> jax.Array:
    words = jax.random.bits(key, (count,), jnp.uint32)
    return _normal(words) if kind == "normal" else _uniform(words)


def _uniform(words: jax.Array) -> jax.Array:
    """uint32 words -> float32 uniform in [0, 1) (their top 23 bits as a mantissa)."""
    return jax.lax.bitcast_convert_type((words >> 9) | np.uint32(0x3F800000), jnp.float32) - 1.0


def _normal(words: jax.Array) -> jax.Array:
    """uint32 words -> standard normal float32 (the inverse error function of a uniform in (-1, 1), as
    jax.random.normal makes them)."""
    lo = np.nextafter(np.float32(-1.0), np.float32(0.0))
    return np.float32(math.sqrt(2.0)) * jax.lax.erf_inv(jnp.maximum(lo, 2.0 * _uniform(words) - 1.0))


def _bytes_as(words: jax.Array, dtype: np.dtype, shape: tuple[int, ...]) -> jax.Array:
    """An integer field of `shape` from the bytes of `words`."""
    count = math.prod(shape)
    data = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)[:count * dtype.itemsize]
    if dtype.itemsize > 1:
        data = data.reshape(count, dtype.itemsize)
    return jax.lax.bitcast_convert_type(data, dtype).reshape(shape)


def _field_shapes(fmt: str, shape: tuple[int, int]) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of each field of a QTensor of `fmt` and [out, in] `shape`, in storage order."""
    spec, (n, k) = FORMATS[fmt], shape
    if spec.dense:
        return [(name, dtype, (n, k)) for name, dtype, _ in spec.fields]
    return [(name, dtype, (n, k // spec.block_size, count)) for name, dtype, count in spec.fields]


@functools.partial(jax.jit, static_argnames=("fmt", "shape"))
def _fields(words: jax.Array, normals: jax.Array, scale: jax.Array, *, fmt: str,
            shape: tuple[int, int]) -> dict[str, jax.Array]:
    """A QTensor's fields cut from random words (integers) and normals (floats, times `scale`)."""
    data, at, af = {}, 0, 0
    for name, dtype, field_shape in _field_shapes(fmt, shape):
        size = math.prod(field_shape)
        if _is_float(dtype):
            data[name] = (normals[af:af + size] * scale).astype(dtype).reshape(field_shape)
            af += size
        else:
            used = _words_for(dtype, size)
            data[name] = _bytes_as(words[at:at + used], dtype, field_shape)
            at += used
    return data


def random_qtensor(key: jax.Array, fmt: str, shape: tuple[int, int], scale: float = 0.01) -> QTensor:
    """A QTensor of the given format and [out, in] shape with random fields, built on the default device."""
    shape = tuple(shape)
    fields = [(dtype, math.prod(field_shape)) for _, dtype, field_shape in _field_shapes(fmt, shape)]
    words = sum(_words_for(d, c) for d, c in fields if not _is_float(d))
    floats = sum(c for d, c in fields if _is_float(d))
    int_key, float_key = jax.random.split(key)
    data = _fields(_random_words(int_key, _bucket(words)), _random_floats(float_key, _bucket(floats)),
                   jnp.float32(scale), fmt=fmt, shape=shape)
    return QTensor(data, fmt, shape)


def random_normal(key: jax.Array, shape: tuple[int, ...], mean: float = 0.0, std: float = 1.0) -> jax.Array:
    """Normal float32 values of `shape` (as jax.random.normal makes them, cut from a power-of-two draw)."""
    return _affine(_random_floats(key, _bucket(math.prod(shape))), jnp.float32(mean), jnp.float32(std),
                   shape=tuple(shape))


def random_uniform(key: jax.Array, shape: tuple[int, ...], low: float = 0.0, high: float = 1.0) -> jax.Array:
    """Float32 values uniform in [low, high) of `shape` (cut from a power-of-two draw)."""
    return _affine(_random_floats(key, _bucket(math.prod(shape)), "uniform"), jnp.float32(low),
                   jnp.float32(high - low), shape=tuple(shape))


@functools.partial(jax.jit, static_argnames="shape")
def _affine(values: jax.Array, offset: jax.Array, scale: jax.Array, *, shape: tuple[int, ...]) -> jax.Array:
    return offset + scale * values[:math.prod(shape)].reshape(shape)
