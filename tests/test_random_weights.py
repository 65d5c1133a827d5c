"""Random weights for kernel tests and benchmarks (testing/random_weights.py): every GGUF format's fields in their
layout, random bits in the integer fields, normals in the float ones, seeded by the key."""

import jax
import numpy as np
import pytest

from dflash_jax.quant import FORMATS, dequantize
from dflash_jax.testing.random_weights import random_normal, random_qtensor, random_uniform


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_fields_have_the_format_layout_and_follow_the_key(fmt):
    spec, shape = FORMATS[fmt], (40, 512)
    qt = random_qtensor(jax.random.key(1), fmt, shape, scale=0.5)
    for name, dtype, count in spec.fields:
        want = shape if spec.dense else (40, 512 // spec.block_size, count)
        assert qt.data[name].dtype == dtype and qt.data[name].shape == want, name
    assert np.isfinite(np.asarray(dequantize(qt))).all()
    again, other = (random_qtensor(jax.random.key(s), fmt, shape, scale=0.5) for s in (1, 2))
    for name in qt.data:
        assert np.array_equal(np.asarray(qt.data[name]), np.asarray(again.data[name]))
        assert not np.array_equal(np.asarray(qt.data[name]), np.asarray(other.data[name]))


def test_integer_fields_are_uniform_bits_and_float_fields_scaled_normals():
    qt = random_qtensor(jax.random.key(3), "Q4_K", (256, 1024), scale=0.5)
    quants = np.asarray(qt.data["qs"]).ravel()
    assert np.unique(quants).size == 256 and abs(quants.mean() - 127.5) < 1.0
    d = np.asarray(qt.data["d"], np.float32).ravel()
    assert abs(d.mean()) < 0.05 and abs(d.std() - 0.5) < 0.05


def test_normal_and_uniform_values():
    x = np.asarray(random_normal(jax.random.key(0), (300, 400), 1.0, 0.1))
    assert x.shape == (300, 400) and abs(x.mean() - 1.0) < 1e-3 and abs(x.std() - 0.1) < 1e-3
    u = np.asarray(random_uniform(jax.random.key(1), (5000,), -1.0, 1.5))
    assert u.min() >= -1.0 and u.max() < 1.5 and abs(u.mean() - 0.25) < 0.03
    assert not np.array_equal(x, np.asarray(random_normal(jax.random.key(2), (300, 400), 1.0, 0.1)))
