"""The int8 tensor-core product (pallas_kernels/mma_int8.py): x's quantization, the kernel in interpret mode (and
compiled, with -m gpu) against its jnp reference, and how qmatmul dispatches to it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.testing.random_weights import random_qtensor
from pallas_kernels import mma_int8 as mi
from pallas_kernels import qmatmul as qm

ON_GPU = jax.default_backend() == "gpu"


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def packed(n, k, seed=0, fmt="Q4_K"):
    return qm.pack(random_qtensor(jax.random.key(seed), fmt, (n, k), scale=0.5))


def test_rows_quantize_per_super_block():
    """Each row's super-block maps its largest |x| (bf16) to +-127, rounds the rest to its scale, sums each 32-column
    sub-block's quants; a super-block of zeros gives zeros (no division by a zero scale)."""
    x = jax.random.normal(jax.random.key(1), (3, 768), jnp.float32).at[1, 256:512].set(0.0)
    xq = mi.quantize_rows(x)
    q = np.asarray(xq["q"], np.int64)
    g = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)).reshape(3, 3, 256)
    scale = np.asarray(xq["scale"])
    np.testing.assert_allclose(scale, np.abs(g).max(-1) / 127, rtol=1e-6)
    assert np.all(np.abs(q) <= 127) and np.all(np.abs(q.reshape(3, 3, 256)).max(-1)[scale > 0] == 127)
    assert np.all(q[1, 256:512] == 0) and scale[1, 1] == 0
    assert np.all(np.abs(q.reshape(3, 3, 256) * scale[..., None] - g) <= scale[..., None] / 2 + 1e-6)
    np.testing.assert_array_equal(np.asarray(xq["qsum"]), q.reshape(3, 24, 32).sum(-1))


# (N, K, M, options): ragged N against the row tile, M from 2 to 64 (padded to 16, 32, 64), K split 2 and 4 ways,
# super-blocks loaded 1 and 3 ahead (past the last one: masked)
CASES = [(40, 512, 2, dict(block_n=16, prefetch=3)), (70, 1024, 23, dict(block_n=32, splits=2, prefetch=1)),
         (20, 1024, 64, dict(block_n=16, splits=4))]


@pytest.mark.parametrize("n,k,m,opts", CASES)
def test_kernel_matches_reference(n, k, m, opts):
    """Against the quantized x's product to float32 rounding, and against x's own product to int8's rounding."""
    pw = packed(n, k, seed=n)
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
    got = mi.mma_int8(x, pw, interpret=True, **opts)
    assert got.shape == (m, n) and bool(jnp.all(jnp.isfinite(got)))
    assert rel(got, mi.mma_int8_reference(x, pw)) < 1e-5
    assert 1e-4 < rel(got, qm.qmatmul_reference(x, pw)) < 2e-2


def test_qmatmul_takes_it_for_two_or_more_rows_of_q4_k():
    """int8_mma: Q4_K at M >= 2 runs it; one token keeps the GEMV, other formats the bf16 tensor-core kernel; bad
    arguments are refused."""
    x = jax.random.normal(jax.random.key(3), (5, 512), jnp.float32)
    pw = packed(48, 512)
    bn = qm.MMA_INT8_TILES[0]
    want = mi.mma_int8(x, pw, block_n=bn, splits=qm.default_splits(48, 2, bn), interpret=True)
    assert rel(qm.qmatmul(x, pw, int8_mma=True, interpret=True), want) == 0
    assert rel(qm.qmatmul(x[:1], pw, int8_mma=True, interpret=True), qm.qmatmul(x[:1], pw, interpret=True)) == 0
    q6 = packed(48, 512, fmt="Q6_K")
    assert rel(qm.qmatmul(x, q6, int8_mma=True, interpret=True), qm.qmatmul(x, q6, interpret=True)) == 0
    with pytest.raises(ValueError, match="no int8 tensor-core product for Q6_K"):
        mi.mma_int8(x, q6, interpret=True)
    with pytest.raises(ValueError, match="do not split 3 ways"):
        mi.mma_int8(x, pw, splits=3, interpret=True)
    with pytest.raises(ValueError, match="inline PTX"):
        mi.mma_int8(x, pw, asm=True, interpret=True)
    with pytest.raises(ValueError, match="prefetch must be >= 0"):
        qm.qmatmul(x, pw, int8_mma=True, prefetch=-1, interpret=True)


def test_lowers_to_triton():
    """The nibble PTX runs only on a GPU; lowering the kernel for CUDA needs none, so a missing lowering fails here."""
    pw = packed(64, 1024)
    for asm in (False, True):
        run = jax.jit(lambda x, w: mi.mma_int8(x, w, asm=asm))
        hlo = run.trace(jnp.ones((23, 1024), jnp.bfloat16), pw).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in hlo, asm


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(17408, 5120), (5120, 17408), (6144, 5120)])
@pytest.mark.parametrize("m", [2, 23, 64])
def test_at_27b_shapes(n, k, m):
    """Compiled at the 27B's Q4_K shapes: the PTX nibbles against jnp's, and the reference (the mins' share is a
    TF32 product: 1e-3)."""
    pw = packed(n, k, seed=m)
    x = jax.random.normal(jax.random.key(n), (m, k), jnp.float32)
    got = qm.qmatmul(x, pw, int8_mma=True)
    assert rel(got, qm.qmatmul(x, pw, int8_mma=True, asm=False)) < 1e-6
    assert rel(got, mi.mma_int8_reference(x, pw)) < 1e-3
