"""The int8-activation GEMV (dp4a): x's quantization, dp4a's arithmetic, the kernel (interpret mode on CPU,
compiled with -m gpu) against its jnp reference, and that qmatmul takes it for one token of Q4_K/Q6_K under the
"fast" numerics (exact=False) only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.testing.random_weights import random_qtensor
from pallas_kernels import gemv_int8 as g8
from pallas_kernels import qmatmul as qm

ON_GPU = jax.default_backend() == "gpu"


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def packed(fmt, n, k, seed=0):
    qt = random_qtensor(jax.random.key(seed), fmt, (n, k), scale=0.5)
    return qm.pack(qt.fmt, qt.shape, qt.data)


def test_dp4a_in_jnp_is_the_byte_dot_product():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(-2**31, 2**31, 64, dtype=np.int64).astype(np.int32)
    want = (a.view(np.uint8).reshape(64, 4).astype(np.int64) * b.view(np.int8).reshape(64, 4)).sum(1)
    np.testing.assert_array_equal(np.asarray(g8._dp4a(jnp.asarray(a), jnp.asarray(b))), want)


@pytest.mark.parametrize("fmt,group", [("Q4_K", 32), ("Q6_K", 16)])
def test_x_quantizes_per_weight_group(fmt, group):
    """Each group's quants are x (bf16) over its scale, rounded, within +-127 (the largest at +-127); the words hold
    them 4 to a word, the first in the lowest byte; a group of zeros quantizes to zeros (no division by a zero
    scale)."""
    x = jax.random.normal(jax.random.key(1), (512,), jnp.float32).at[:group].set(0.0)
    q, scale = (np.asarray(a) for a in g8._quantized_groups(fmt, x))
    g = np.asarray(g8._groups(fmt, x.astype(jnp.bfloat16).astype(jnp.float32)))
    assert q.shape == g.shape and scale.shape == g.shape[:-1]
    np.testing.assert_allclose(scale, np.abs(g).max(-1) / 127, rtol=1e-6)
    assert np.abs(q).max() == 127
    assert np.all(np.abs(q - g / np.where(scale > 0, scale, 1)[..., None]) <= 0.5 + 1e-4)  # rounded to the nearest
    # (x times 127 / max here, x over max / 127 above: their last bits may differ at a tie)
    words = np.asarray(jax.lax.bitcast_convert_type(g8.pack_words(jnp.asarray(q)), jnp.int8))
    np.testing.assert_array_equal(words.reshape(q.shape), q)
    xh = np.asarray(g8.dequantized_x(fmt, x))
    assert np.all(xh[:group] == 0) and np.abs(xh - np.asarray(x)).max() > 0
    assert np.all(np.abs(xh - np.asarray(x)) <= np.asarray(g8._ungroup(fmt, jnp.broadcast_to(
        jnp.asarray(scale)[..., None], g.shape))) * 0.5 + 4e-3 * np.abs(np.asarray(x)))  # + bf16's rounding of x


# ragged N (not a multiple of the 16-row tile), K split (K steps prefetched past a split's end are masked off)
CASES = [("Q4_K", 6, 512, {}), ("Q4_K", 40, 1024, dict(columns=256, splits=2)),
         ("Q6_K", 17, 1024, dict(columns=256)), ("Q6_K", 24, 512, dict(columns=256, block_n=8, splits=2))]


@pytest.mark.parametrize("fmt,n,k,opts", CASES)
def test_kernel_matches_reference(fmt, n, k, opts):
    """Against the quantized x's product to float32 rounding, and against x's own product to int8's rounding."""
    pw = packed(fmt, n, k, seed=n)
    x = jax.random.normal(jax.random.key(k), (1, k), jnp.float32)
    got = g8.gemv_int8(x, pw, interpret=not ON_GPU, **opts)
    assert got.shape == (1, n) and bool(jnp.all(jnp.isfinite(got)))
    assert rel(got, g8.gemv_int8_reference(x, pw)) < 1e-5
    xb = x.astype(jnp.bfloat16).astype(jnp.float32)
    assert 1e-4 < rel(got, jnp.einsum("mk,nk->mn", xb, qm.dequantize(pw), precision="highest")) < 3e-2


def test_qmatmul_takes_it_for_one_token_of_q4_k_or_q6_k():
    """With exact=False one token of a Q4_K/Q6_K weight takes it (the same product), exact numerics the float
    GEMV; Q5_K keeps the float GEMV either way; it refuses other formats and more than one row."""
    x = jax.random.normal(jax.random.key(3), (2, 512), jnp.float32)
    for fmt in g8.FORMATS:
        pw = packed(fmt, 16, 512)
        int8 = np.asarray(g8.gemv_int8(x[:1], pw, interpret=True))
        np.testing.assert_array_equal(np.asarray(qm.qmatmul(x[:1], pw, interpret=True, exact=False)), int8)
        assert rel(qm.qmatmul(x[:1], pw, interpret=True), int8) > 1e-4
    pw = packed("Q5_K", 16, 512)
    for exact in (True, False):
        got = qm.qmatmul(x[:1], pw, interpret=True, exact=exact)
        assert rel(got, qm.qmatmul_reference(x[:1], pw, exact=exact)) < 1e-5
    with pytest.raises(ValueError, match="no int8-activation GEMV for Q5_K"):
        g8.gemv_int8(x[:1], pw, interpret=True)
    with pytest.raises(ValueError, match="one row of x"):
        g8.gemv_int8(x, packed("Q4_K", 16, 512), interpret=True)


@pytest.mark.parametrize("fmt", g8.FORMATS)
def test_inline_ptx_lowers_to_triton(fmt):
    """The dp4a PTX runs only on a GPU; lowering it for CUDA needs none, so a missing lowering fails here."""
    pw = packed(fmt, 64, 1024)
    for opts in ({}, dict(columns=256, splits=2)):
        run = jax.jit(lambda x, w: g8.gemv_int8(x, w, **opts))
        hlo = run.trace(jnp.ones((1, 1024), jnp.bfloat16), pw).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in hlo and f"gemv_int8_{fmt.lower()}" in hlo, opts


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,n,k", [("Q4_K", 17408, 5120), ("Q6_K", 5120, 17408), ("Q4_K", 5120, 6144)])
@pytest.mark.parametrize("opts", [{}, dict(block_n=32, splits=1)])
def test_dp4a_at_27b_shapes(fmt, n, k, opts):
    """The compiled dp4a PTX against the reference at the 27B's shapes."""
    pw = packed(fmt, n, k, seed=k)
    x = jax.random.normal(jax.random.key(n), (1, k), jnp.float32)
    assert rel(g8.gemv_int8(x, pw, **opts), g8.gemv_int8_reference(x, pw)) < 1e-5
