"""The fused dequantize + matmul kernel: packed layout exact against the GGUF dequantizers, the Pallas kernel
(interpret mode on CPU, compiled with -m gpu) against its jnp reference, and the model under impl="pallas"."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY
from dflash_jax import kernels, quant
from dflash_jax.engine.prefill import prefill_chunks
from dflash_jax.models.target import init_state
from dflash_jax.load import load_target
from dflash_jax.testing.random_weights import random_qtensor
from pallas_kernels import qmatmul as qm
from pallas_kernels import qmatmul_mgpu
from pallas_kernels.gemv_int8 import gemv_int8_reference

ON_GPU = jax.default_backend() == "gpu"
BF16_TILES = 4e-3  # the tensor-core kernel rounds each dequantized weight to bf16
BF16X2_TILES = 8e-3  # bf16x2 also rounds each sub-block's scale and min to bf16: errors shared by 32 weights


def tiles_tol(fmt: str, tile_math: str | None = None) -> float:
    """How far the tensor-core kernel may be from the float32 reference (x in bf16) for `fmt`, under `tile_math`
    (None: the format's default). f16x2's float16 x and weights are finer than the reference's bf16 x."""
    tile_math = qm.TILE_MATH.get(fmt, "f32") if tile_math is None else tile_math
    return BF16X2_TILES if tile_math == "bf16x2" and fmt in qm.PTX_FORMATS else BF16_TILES


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def weight(fmt, n, k, seed=0, scale=0.5):
    return random_qtensor(jax.random.key(seed), fmt, (n, k), scale=scale)


@pytest.mark.parametrize("fmt", qm.QUANTIZED_FORMATS)
def test_packed_layout_dequantizes_exactly(fmt):
    """Random bits in every field (any scale, any quant): the packed layout holds the same matrix, bit for bit."""
    qt = weight(fmt, 24, 512, seed=3)
    pw = qm.pack(qt)
    np.testing.assert_array_equal(np.asarray(qm.dequantize_packed(pw)), np.asarray(quant.dequantize(qt)))
    packed, gguf = {"Q4_K": (148, 144), "Q5_K": (180, 176)}.get(fmt, (1, 1))  # 6-bit scales unpacked: +2.8%, +2.3%
    assert pw.nbytes * gguf == qt.nbytes * packed


@pytest.mark.parametrize("fmt", ["F32", "F16", "BF16"])
def test_dense_weights_pack_to_bf16(fmt):
    qt = weight(fmt, 8, 48)
    pw = qm.pack(qt)
    assert pw.fmt == "BF16"
    expect = np.asarray(quant.dequantize(qt)).astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(qm.dequantize_packed(pw)), expect)


# (format, N, K, M): ragged N (not a multiple of any tile), M = 1, odd, a full 16, past 16 and past 32 (Q6_K at
# 20 rows: the narrow-matrix tiles of default_tiles, with K split 4 ways)
CASES = [("Q4_K", 6, 256, 1), ("Q4_K", 40, 768, 17), ("Q5_K", 40, 512, 3), ("Q6_K", 17, 256, 5),
         ("Q6_K", 33, 512, 33), ("Q6_K", 40, 1024, 20), ("Q8_0", 33, 96, 2), ("Q8_0", 16, 512, 16), ("BF16", 20, 48, 7),
         ("BF16", 70, 512, 1)]


@pytest.mark.parametrize("fmt,n,k,m", CASES)
def test_kernel_matches_reference(fmt, n, k, m):
    """Unwritten outputs would be NaN (interpret mode fills fresh buffers with NaN), inputs are random. One token of
    Q4_K/Q6_K takes the int8-activation GEMV, checked against its own reference (x rounded to int8 moves the float
    product by up to ~1.5 % on so few outputs; tests/test_gemv_int8.py bounds that)."""
    pw = qm.pack(weight(fmt, n, k, seed=n + k))
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
    got = qm.qmatmul(x, pw, interpret=not ON_GPU)
    assert got.shape == (m, n) and bool(jnp.all(jnp.isfinite(got)))
    if qm.int8_x_mode(qm.INT8_X, m == 1, fmt):
        assert rel(got, gemv_int8_reference(x, pw)) < 1e-5
    else:
        assert rel(got, qm.qmatmul_reference(x, pw)) < tiles_tol(fmt)


@pytest.mark.parametrize("fmt,n,k", [("Q4_K", 6, 512), ("Q5_K", 40, 512), ("Q6_K", 17, 1024), ("Q8_0", 33, 128),
                                     ("BF16", 70, 512)])
def test_one_token_takes_the_float32_gemv(fmt, n, k):
    """M = 1 runs the GEMV, which keeps the dequantized weights in float32 (with x not quantized to int8, the default
    for Q5_K, Q8_0 and bf16): it agrees with the reference to float32 rounding, where the tensor-core kernel (still
    there when asked for) agrees to bf16's."""
    pw = qm.pack(weight(fmt, n, k, seed=n))
    x = jax.random.normal(jax.random.key(n), (1, k), jnp.float32)
    ref = qm.qmatmul_reference(x, pw)
    assert rel(qm.qmatmul(x, pw, int8_x=0, interpret=not ON_GPU), ref) < 1e-5
    assert rel(qm.qmatmul(x, pw, splits=2, columns=64, int8_x=0, interpret=not ON_GPU), ref) < 1e-5
    mma = rel(qm.qmatmul(x, pw, gemv=False, interpret=not ON_GPU), ref)
    assert mma < tiles_tol(fmt) and (fmt == "BF16" or mma > 1e-5)  # bf16 weights lose nothing to the rounding
    with pytest.raises(ValueError, match="one row"):
        qm.qmatmul(jnp.ones((2, k)), pw, gemv=True, interpret=True)


def test_tiles_of_every_width_agree():
    pw = qm.pack(weight("Q4_K", 40, 1024, seed=1))
    x = jax.random.normal(jax.random.key(1), (3, 1024), jnp.float32)
    ref = qm.qmatmul_reference(x, pw)
    for block_n, columns in ((16, 256), (32, 512), (64, 1024)):
        got = qm.qmatmul(x, pw, block_n=block_n, columns=columns, interpret=not ON_GPU)
        assert rel(got, ref) < tiles_tol("Q4_K"), (block_n, columns)


@pytest.mark.parametrize("fmt,n,k,m", [("Q4_K", 70, 512, 23), ("Q6_K", 40, 1024, 5), ("Q5_K", 64, 512, 33),
                                       ("BF16", 20, 48, 7)])
def test_weight_rows_first_is_the_same_product(fmt, n, k, m):
    """wgmma puts the weight tile first in each product (tokens second) and transposes the result once: the same
    product, ragged N included, to float32 rounding."""
    pw = qm.pack(weight(fmt, n, k, seed=n))
    x = jax.random.normal(jax.random.key(k), (m, k), jnp.float32)
    first = qm.qmatmul(x, pw, wgmma=True, interpret=True)
    assert first.shape == (m, n) and rel(first, qm.qmatmul(x, pw, wgmma=False, interpret=True)) < 1e-6
    assert rel(first, qm.qmatmul_reference(x, pw)) < tiles_tol(fmt)


@pytest.mark.parametrize("fmt,m", [("Q4_K", 23), ("Q5_K", 16), ("Q6_K", 5), ("Q8_0", 2), ("BF16", 17)])
def test_x_read_through_a_view_is_the_same_product(fmt, m):
    """The tensor-core kernel reading each plane's columns of x from plane_view's reshape, rows past M masked, gives
    exactly the product from the copy gathered and padded before it; plane_view's planes are plane_columns'."""
    k = 512 if fmt in ("Q4_K", "Q5_K", "Q6_K") else 96
    pw = qm.pack(weight(fmt, 24, k, seed=m))
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
    viewed = qm.qmatmul(x, pw, x_view=True, interpret=True)
    assert viewed.shape == (m, 24)
    assert bool(jnp.array_equal(viewed, qm.qmatmul(x, pw, x_view=False, interpret=True)))
    view, cols = qm.plane_view(fmt, x), qm.plane_columns(fmt, k)
    planes = [view] if qm.N_PLANES[fmt] == 1 else [view[:, :, p].reshape(m, -1) for p in range(qm.N_PLANES[fmt])]
    for plane, c in zip(planes, cols, strict=True):
        assert bool(jnp.array_equal(plane, x[:, c]))


@pytest.mark.parametrize("tile_math", ["bf16x2", "f16x2"])
@pytest.mark.parametrize("fmt,m", [("Q4_K", 23), ("Q6_K", 3), ("Q5_K", 5)])
def test_paired_dequantization(fmt, m, tile_math):
    """bf16x2/f16x2 dequantize Q4_K/Q6_K tiles as q * scale + neg_min with scale and neg_min rounded to the pair
    type: within that type's rounding of the float32 weights (f16x2: 8 times finer), and the kernel (its jnp
    emulation in interpret mode) gives that reference's product; other formats are not affected."""
    k = 512
    pw = qm.pack(weight(fmt, 24, k, seed=m, scale=1e-3))  # scales a model has: f16x2 holds them (`f16_fits`)
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
    got = qm.qmatmul(x, pw, tile_math=tile_math, interpret=True)
    assert rel(got, qm.qmatmul_reference(x, pw)) < tiles_tol(fmt, tile_math)
    w, w2 = qm.dequantize_packed(pw), qm.dequantize_packed(pw, tile_math)
    if fmt in qm.PTX_FORMATS:
        assert rel(got, qm.qmatmul_reference(x, pw, tile_math)) < 1e-5
        assert 0 < rel(w2, w) < (4e-3 if tile_math == "bf16x2" else 5e-4)
    else:
        assert bool(jnp.array_equal(w2, w))
        assert bool(jnp.array_equal(got, qm.qmatmul(x, pw, tile_math="f32", interpret=True)))


def test_f16x2_keeps_x_range_and_refuses_weights_it_cannot_hold(monkeypatch):
    """f16x2 multiplies x in float16 scaled by 2**-8: x of 1e6 (past float16's 65504) still gives the product; a
    weight whose scales float16 cannot hold at 2**8 is marked at pack, falls back to f32 tiles by default and is
    refused when f16x2 is asked for."""
    pw = qm.pack(weight("Q4_K", 16, 256, seed=3, scale=1e-3))
    assert pw.f16_ok and not qm.pack(weight("Q5_K", 16, 256, scale=1e-3)).f16_ok
    x = jax.random.normal(jax.random.key(3), (4, 256), jnp.float32) * 1e6
    got = qm.qmatmul(x, pw, tile_math="f16x2", interpret=True)
    assert rel(got, qm.qmatmul_reference(x, pw, "f16x2")) < 1e-5
    assert rel(got, qm.qmatmul_reference(x, pw)) < BF16_TILES
    big = weight("Q4_K", 16, 256, seed=3, scale=1e-3)
    big = dataclasses.replace(big, data={**big.data, "d": big.data["d"].at[0, 0].set(100.0)})  # one super-block
    pw_big = qm.pack(big)
    assert not pw_big.f16_ok
    monkeypatch.setitem(qm.TILE_MATH, "Q4_K", "f16x2")
    assert qm.resolve_tile_math(None, pw) == "f16x2" and qm.resolve_tile_math(None, pw_big) == "f32"
    with pytest.raises(ValueError, match="does not fit float16"):
        qm.qmatmul(x, pw_big, tile_math="f16x2", interpret=True)
    with pytest.raises(ValueError, match="tile_math is one of"):
        qm.qmatmul(x, pw, tile_math="f8", interpret=True)


def test_k_splits_agree():
    """Partial products of K split over 1, 2 and 4 programs add up to the same product; a split that does not
    divide the K steps is refused."""
    pw = qm.pack(weight("Q6_K", 24, 1024, seed=2))
    x = jax.random.normal(jax.random.key(2), (2, 1024), jnp.float32)
    ref = qm.qmatmul_reference(x, pw)
    for splits in (1, 2, 4):
        assert rel(qm.qmatmul(x, pw, columns=256, splits=splits, interpret=not ON_GPU), ref) < tiles_tol("Q6_K"), splits
    with pytest.raises(ValueError, match="do not split 3 ways"):
        qm.qmatmul(x, pw, columns=256, splits=3, interpret=True)


@pytest.mark.parametrize("fmt,m", [("Q4_K", 1), ("Q6_K", 1), ("Q5_K", 3), ("Q4_K", 17)])
def test_prefetched_k_steps_agree(fmt, m):
    """Loading 1, 2 or more K steps ahead of the one computed (more than there are: the loads past the end are
    masked) gives the product without prefetching, in either kernel and with K split; a negative depth is refused."""
    pw = qm.pack(weight(fmt, 24, 1024, seed=7))
    x = jax.random.normal(jax.random.key(7), (m, 1024), jnp.float32)
    ref = qm.qmatmul_reference(x, pw)
    tol = 1e-5 if m == 1 else tiles_tol(fmt)
    for prefetch, splits in ((0, 1), (1, 1), (2, 2), (5, 1)):  # 4 K steps of 256 columns
        got = qm.qmatmul(x, pw, columns=256, splits=splits, prefetch=prefetch, int8_x=0, interpret=not ON_GPU)
        assert rel(got, ref) < tol, (prefetch, splits)
    with pytest.raises(ValueError, match="prefetch"):
        qm.qmatmul(x, pw, prefetch=-1, interpret=True)


@pytest.mark.parametrize("fmt", qm.PACKED_FORMATS)
def test_gpu_variants_lower_to_triton(fmt):
    """What runs only on a GPU (the inline PTX tiles, prefetching in the compiled kernel) lowers to Triton IR here
    too: lowering for CUDA needs no GPU, so an op the Triton lowering lacks fails on a CPU, not first on the device."""
    pw = qm.pack(weight(fmt, 64, 1024, scale=1e-3))
    for m, prefetch, wgmma, x_view, tile_math in ((1, 0, False, True, "f32"), (1, 2, False, True, "f32"),
                                                  (23, 0, False, True, "f32"), (23, 1, False, True, "f32"),
                                                  (23, 0, True, True, "f32"), (23, 0, False, False, "f32"),
                                                  (23, 0, False, False, "bf16x2"), (23, 1, False, False, "bf16x2"),
                                                  (23, 0, False, False, "f16x2"), (23, 0, False, True, "f16x2")):
        tile_math = tile_math if fmt in qm.PTX_FORMATS else None
        run = jax.jit(lambda x, w: qm.qmatmul(x, w, prefetch=prefetch, asm=fmt in qm.PTX_FORMATS, wgmma=wgmma,
                                              x_view=x_view, tile_math=tile_math))
        hlo = run.trace(jnp.ones((m, 1024), jnp.bfloat16), pw).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in hlo, (m, prefetch)


def test_default_splits_fill_the_gpu_only_when_needed():
    assert qm.default_splits(5120, 68, 32) == 4  # ffn_down at M = 1: 160 row tiles
    assert qm.default_splits(5120, 34, 64) == 2  # ... at M = 32: 34 steps take no 4-way split
    assert qm.default_splits(17408, 20, 32) == 1  # ffn_gate: 544 row tiles are enough
    assert qm.default_splits(48, 10, 32) == 2
    assert qm.default_splits(5120, 34, 8, target=2048) == 2  # the GEMV's 8-row tiles at M = 1
    assert qm.default_splits(17408, 10, 8, target=2048) == 1
    assert qm.default_tiles(32, 5120, "Q6_K") == (64, 256, 8)  # measured faster only for Q6_K's ffn_down
    assert qm.default_tiles(32, 5120, "Q4_K") == qm.default_tiles(32, 17408, "Q6_K") == (64, 512, 4)
    assert qm.default_tiles(32, 10240, "Q5_K") == (64, 256, 8) and qm.default_tiles(64, 10240, "Q5_K") == (64, 256, 4)
    assert qm.default_tiles(16, 17408, "Q4_K") == (64, 512, 4) and qm.default_tiles(16, 17408, "Q6_K") == (32, 256, 4)


def test_default_stages():
    """Two pipeline stages for the Q4_K tensor-core kernel at 16-32 rows and for bf16 weights under wgmma (whose
    three stages overflow shared memory); three elsewhere."""
    assert qm.default_stages(32, "Q4_K", gemv=False) == qm.default_stages(16, "Q4_K", gemv=False) == 2
    assert qm.default_stages(64, "Q4_K", gemv=False) == qm.default_stages(1, "Q4_K", gemv=True) == 3
    assert qm.default_stages(32, "Q6_K", gemv=False) == qm.default_stages(32, "BF16", gemv=False) == 3
    assert qm.default_stages(32, "BF16", gemv=False, wgmma=True) == qm.default_stages(64, "BF16", False, True) == 2


def test_bad_inputs_raise():
    pw = qm.pack(weight("Q8_0", 16, 64))
    with pytest.raises(ValueError, match="columns"):
        qm.qmatmul(jnp.ones((1, 32)), pw, interpret=True)
    with pytest.raises(ValueError, match="at most 64"):
        qm.qmatmul(jnp.ones((65, 64)), pw, interpret=True)
    with pytest.raises(NotImplementedError, match="Q4_0"):
        qm.pack(weight("Q4_0", 4, 64))
    with pytest.raises(ValueError, match="only on a GPU"):
        qm.qmatmul(jnp.ones((2, 64)), pw, asm=True, interpret=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        qm.pack(weight("F32", 4, 40))
    with pytest.raises(ValueError, match="impl"):
        kernels.resolve_impl("triton")


def test_linear_splits_long_inputs_and_keeps_leading_axes():
    qt = weight("Q6_K", 24, 256)
    pw = qm.pack(qt)
    x = jax.random.normal(jax.random.key(5), (2, 35, 256), jnp.float32)  # 70 rows: two calls of <= 64
    got = kernels.linear(x, pw)
    assert got.shape == (2, 35, 24)
    assert rel(got, kernels.linear(x.astype(jnp.bfloat16).astype(jnp.float32), qt)) < tiles_tol("Q6_K")
    assert kernels.prepare_matrix(qt, "reference") is qt


def test_matrices_below_a_row_tile_stay_with_xla():
    """With `pallas`, a quantized matrix of fewer than SMALL_ROWS rows is dequantized to float32 at load (XLA's
    product), one of SMALL_ROWS or more packed for the kernels; `linear` gives the reference product either way."""
    small, large = weight("Q4_K", kernels.SMALL_ROWS - 16, 256), weight("Q4_K", kernels.SMALL_ROWS, 256)
    dense = kernels.prepare_matrix(small, "pallas")
    assert isinstance(dense, jax.Array) and dense.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(dense), np.asarray(quant.dequantize(small)))
    assert isinstance(kernels.prepare_matrix(large, "pallas"), qm.PackedWeight)
    x = jax.random.normal(jax.random.key(6), (5, 256), jnp.float32)
    np.testing.assert_allclose(np.asarray(kernels.linear(x, dense)), np.asarray(kernels.linear(x, small)),
                               rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# The tiny fixture model end to end, and (GPU) the 27B's shapes

REAL = [("Q4_K", 17408, 5120), ("Q5_K", 10240, 5120), ("Q6_K", 5120, 17408), ("Q8_0", 48, 5120),
        ("BF16", 5120, 25600)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,n,k", REAL)
@pytest.mark.parametrize("m", [1, 23, 64])
def test_kernel_at_27b_shapes(fmt, n, k, m):
    pw = qm.pack(weight(fmt, n, k, seed=m))
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
    got = qm.qmatmul(x, pw)
    assert bool(jnp.all(jnp.isfinite(got)))
    if qm.int8_x_mode(qm.INT8_X, m == 1, fmt):  # one token of Q4_K/Q6_K: x quantized to int8 by default
        assert rel(got, gemv_int8_reference(x, pw)) < 1e-5
    else:
        assert rel(got, qm.qmatmul_reference(x, pw)) < tiles_tol(fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,n,k", REAL)
@pytest.mark.parametrize("m", [16, 23])
def test_weight_rows_first_at_27b_shapes(fmt, n, k, m):
    """The tensor-core kernel with the weight rows first (wgmma), compiled, against the reference."""
    pw = qm.pack(weight(fmt, n, k, seed=m))
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
    assert rel(qm.qmatmul(x, pw, wgmma=True), qm.qmatmul_reference(x, pw)) < tiles_tol(fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,n,k", REAL[:3])
@pytest.mark.parametrize("m", [16, 23])
@pytest.mark.parametrize("tile_math", ["bf16x2", "f16x2"])
def test_paired_tiles_at_27b_shapes(fmt, n, k, m, tile_math):
    """The bf16x2/f16x2 inline PTX, compiled, against its jnp reference (same weights to the bit but for fma's
    rounding ties, so the products agree to float32 summation order) and against the float32 reference."""
    pw = qm.pack(weight(fmt, n, k, seed=m, scale=1e-3))
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
    got = qm.qmatmul(x, pw, tile_math=tile_math if fmt in qm.PTX_FORMATS else None)
    if fmt in qm.PTX_FORMATS:
        assert rel(got, qm.qmatmul_reference(x, pw, tile_math)) < 1e-4
    assert rel(got, qm.qmatmul_reference(x, pw)) < tiles_tol(fmt, tile_math)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,n,k", REAL)
def test_x_read_through_a_view_at_27b_shapes(fmt, n, k):
    """The tensor-core kernel reading x through plane_view (rows past M masked), compiled, against the reference."""
    pw = qm.pack(weight(fmt, n, k, seed=23))
    x = jax.random.normal(jax.random.key(23), (23, k), jnp.float32)
    assert rel(qm.qmatmul(x, pw, x_view=True), qm.qmatmul_reference(x, pw)) < tiles_tol(fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,n,k", REAL[:3])
@pytest.mark.parametrize("m,prefetch", [(1, 1), (1, 2), (23, 1), (32, 2)])
def test_prefetch_at_27b_shapes(fmt, n, k, m, prefetch):
    pw = qm.pack(weight(fmt, n, k, seed=m))
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
    got = qm.qmatmul(x, pw, prefetch=prefetch, int8_x=0)
    assert rel(got, qm.qmatmul_reference(x, pw)) < (1e-4 if m == 1 else tiles_tol(fmt))  # GEMV: float32 weights


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", qm.PTX_FORMATS)
@pytest.mark.parametrize("m", [1, 16, 23])
def test_inline_ptx_tiles_match_their_float32_form(fmt, m):
    """The inline PTX that dequantizes Q4_K/Q6_K tiles against plane_tile's jnp (asm=False), both compiled: bf16
    tiles in the tensor-core kernel, float32 ones in the GEMV (M = 1)."""
    pw = qm.pack(weight(fmt, 96, 1024, seed=m))
    x = jax.random.normal(jax.random.key(m), (m, 1024), jnp.float32)
    got, emulated = qm.qmatmul(x, pw, asm=True, int8_x=0), qm.qmatmul(x, pw, asm=False, int8_x=0)
    assert rel(got, emulated) < (1e-5 if m == 1 else 1e-4)  # float32 rounding may differ (before the bf16 one)
    assert rel(got, qm.qmatmul_reference(x, pw)) < (1e-5 if m == 1 else tiles_tol(fmt))


@pytest.mark.parametrize("mgpu_layout", [False, pytest.param(True, marks=pytest.mark.gpu),
                                         pytest.param("only", marks=pytest.mark.gpu)])
def test_fixture_model_with_pallas_matches_hf(tiny_gguf_path, monkeypatch, mgpu_layout):
    """The whole tiny model through the kernel (interpret mode on CPU: 15-25 s) against HF's float32 logits; on a
    Hopper GPU also with the Mosaic GPU kernel's layout beside the Q4_K weights' (True) or alone ("only")."""
    if mgpu_layout and not qmatmul_mgpu.available():
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU")
    monkeypatch.setattr(qm, "MGPU_LAYOUT", mgpu_layout)
    model = load_target(tiny_gguf_path, progress=False, impl="pallas")
    packed = [x for x in jax.tree.leaves(model.params, is_leaf=lambda x: isinstance(x, qm.PackedWeight))
              if isinstance(x, qm.PackedWeight)]
    assert packed and any(p.mgpu is not None for p in packed) == bool(mgpu_layout)
    refs = np.load(TINY / "ref.npz")
    ids = np.load(TINY / "tokens.npy")
    logits = np.concatenate([np.asarray(lg) for _, lg, _, _ in prefill_chunks(
        model.params, model.config, init_state(model.config, 160), ids, all_logits=True, impl=model.impl)])
    # float16 x and tiles (f16x2, the Q4_K/Q6_K default) and bf16 elsewhere against a float32 reference: 3.2e-3
    # measured, 1.0e-2 with the float32-then-bf16 tiles (scripts/results/tile_math_accuracy_cpu.txt)
    assert rel(logits, refs["hf_q_logits"]) < 8e-3
    assert np.mean(logits.argmax(-1) == refs["hf_q_logits"].argmax(-1)) > 0.95
