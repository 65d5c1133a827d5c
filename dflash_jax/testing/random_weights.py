"""Random weights in any GGUF block format, generated on the device (for kernel tests and benchmarks at 27B sizes).

Quant bytes are uniform random bits and float fields small random normals, so every code path sees real data
(never zeros) and no scale is NaN or inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes

from dflash_jax.quant import FORMATS, QTensor


def random_qtensor(key: jax.Array, fmt: str, shape: tuple[int, int], scale: float = 0.01) -> QTensor:
    """A QTensor of the given format and [out, in] shape with random fields, built on the default device."""
    spec = FORMATS[fmt]
    n, k = shape
    if spec.dense:
        w = jax.random.normal(key, shape, jnp.float32) * scale
        return QTensor({"w": w.astype(spec.fields[0][1])}, fmt, shape)
    nb = k // spec.block_size
    data = {}
    for (name, dtype, count), sub in zip(spec.fields, jax.random.split(key, len(spec.fields))):
        if dtype.kind == "f" or dtype == ml_dtypes.bfloat16:
            data[name] = (jax.random.normal(sub, (n, nb, count), jnp.float32) * scale).astype(dtype)
        else:
            bits = jax.random.bits(sub, (n, nb, count), jnp.uint8)
            data[name] = jax.lax.bitcast_convert_type(bits, dtype) if dtype != jnp.uint8 else bits
    return QTensor(data, fmt, shape)
