"""The Mosaic GPU Q6_K kernel (pallas_kernels/qmatmul_mgpu_q6k.py): its layout, its bit operations (emulated in
numpy) and reference on a CPU, that it lowers for CUDA with no GPU, and (-m gpu) the compiled kernel against its
reference at the 27B's Q6_K shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.quant import dequantize
from dflash_jax.testing.synthetic import random_matrix
from pallas_kernels import qmatmul as qm
from pallas_kernels import qmatmul_mgpu as mg
from pallas_kernels import qmatmul_mgpu_q6k as q6
from pallas_kernels import qmatmul_triton
from pallas_kernels.qcommon import F16_SHIFT


def rel(a, b) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def q6k(n: int, k: int, seed: int = 0):
    return random_matrix(jax.random.key(seed), "Q6_K", (n, k))


def mgpu_pack(qt):
    return q6.pack(qt.fmt, qt.shape, qt.data)


def test_layout_holds_the_gguf_values_exactly():
    qt = q6k(128, 768)
    w = mgpu_pack(qt)
    assert w.lo.dtype == jnp.int4 and w.hi.dtype == jnp.int4 and w.scales.dtype == jnp.uint32
    assert w.lo.shape == (128, 768) and w.hi.shape == (128, 384) and w.scales.shape == (3 * 5, 128)
    np.testing.assert_array_equal(np.asarray(q6.dequantize(w)), np.asarray(dequantize(qt)))
    assert w.nbytes == 128 * 768 // 256 * (128 + 64 + 20)  # 212 bytes a super-block: the GGUF's 210 + 1 %


def bits(a: jax.Array) -> np.ndarray:
    """An int4 array's stored bit patterns (0..15) as uint32."""
    return np.asarray(a.astype(jnp.int32) & 0xF).astype(np.uint32)


def halves(word: np.ndarray) -> np.ndarray:
    """uint32 words -> their two float16 halves, low first, as float32 [..., 2]."""
    return np.ascontiguousarray(word, np.uint32).view(np.float16).reshape(*word.shape, 2).astype(np.float32)


def shifted(word: np.ndarray, s: int) -> np.ndarray:
    return ((word << np.uint32(s)) if s > 0 else (word >> np.uint32(-s))) & np.uint32(0xFFFFFFFF)


def test_conversion_emulated_is_the_reference_weights():
    """An emulation of `_f16_tile_q6k` and `_scale_pairs` (bias SCALE_BIAS) on the packed arrays, lane by lane (the
    words a lane loads in WGMMA_UPCAST_4X layout; two lop3, a sub and a multiply per register, as the inline PTX
    does them) gives every float16 weight `f16_weights` says, bit for bit, in WGMMA's register order."""
    w = mgpu_pack(q6k(64, 512, seed=3))
    lo, hi = bits(w.lo), bits(w.hi)
    words = np.asarray(w.scales).T.reshape(64, 2, mg.SCALE_WORDS)
    want = np.asarray(q6.f16_weights(w)).astype(np.float32)
    gain = halves(np.array([q6.GAIN_D], np.uint32))[0]
    d = (halves(words[..., -1]) * gain).astype(np.float16).astype(np.float32)  # `_scaled_dd`: (d, d) 2**8
    nib = lambda plane, col0: sum(plane[:, col0 + p] << np.uint32(4 * p) for p in range(8))  # noqa: E731
    for sb in range(2):
        for chunk in range(4):
            col_chunk = 256 * sb + 64 * chunk
            for c in range(4):
                high = nib(hi, col_chunk // 2 + 8 * c)
                for g in range(2):
                    part = ((words[:, sb, chunk] >> np.uint32(8 * g)) & 0x00FF00FF) ^ (q6.SCALE_BIAS * 0x10001)
                    pair = ((halves(part) - 1152) * d[:, sb]).astype(np.float16).astype(np.float32)
                    word = nib(lo, col_chunk + 32 * g + 8 * c)
                    for t in range(4):
                        mask, xor, _ = mg.NIBBLE_FIELDS[t % 2]
                        u = ((word >> np.uint32(8 * (t // 2))) & mask) ^ (xor * 0x10001)
                        u |= shifted(high, q6.HI_VIEWS[2 * g + t // 2]) & q6.HI_MASKS[t % 2]
                        q = halves(u) - halves(np.array([q6.OFFSETS[t % 2]], np.uint32))[0]
                        got = (q * pair[:, t // 2: t // 2 + 1]).astype(np.float16).astype(np.float32)
                        col = col_chunk + 32 * g + 8 * t + 2 * c
                        np.testing.assert_array_equal(got, want[:, col: col + 2])


def test_reference_is_the_float16_product():
    qt = q6k(256, 1024, seed=1)
    w = mgpu_pack(qt)
    x = jax.random.normal(jax.random.key(2), (23, 1024), jnp.float32)
    exact = jnp.einsum("mk,nk->mn", x, dequantize(qt), precision=jax.lax.Precision.HIGHEST)
    assert rel(q6.reference(x, w), exact) < 6e-4
    assert rel(q6.f16_weights(w).astype(jnp.float32), dequantize(qt) * 2.0 ** F16_SHIFT) < 5e-4
    # the f16x2 tiles' weights of the Triton kernel, bit for bit: the two kernels share qmatmul's reference
    pw = qm.pack(qt.fmt, qt.shape, qt.data)
    np.testing.assert_array_equal(np.asarray(q6.f16_weights(w).astype(jnp.float32) / 2.0 ** F16_SHIFT),
                                  np.asarray(qmatmul_triton.mma_weights(pw)))


def test_refuses_what_it_cannot_take():
    with pytest.raises(NotImplementedError, match="Q6_K"):
        mgpu_pack(random_matrix(jax.random.key(0), "Q4_K", (64, 256)))
    with pytest.raises(ValueError, match="multiple of 64 rows"):
        mgpu_pack(q6k(48, 256))
    loud = q6k(64, 256)
    loud = type(loud)({**loud.data, "d": jnp.full_like(loud.data["d"], 60.0)}, loud.fmt, loud.shape)
    with pytest.raises(ValueError, match="float16"):
        mgpu_pack(loud)
    w = mgpu_pack(q6k(64, 512))
    with pytest.raises(ValueError, match="1 to 64 rows"):
        q6.qmatmul(jnp.zeros((65, 512)), w)
    with pytest.raises(ValueError, match="columns"):
        q6.qmatmul(jnp.zeros((4, 256)), w)
    with pytest.raises(ValueError, match="split 4 ways"):
        q6.qmatmul(jnp.zeros((4, 512)), w, splits=4)


@pytest.mark.parametrize("m", [1, 23, 64])
def test_lowers_for_cuda_on_a_cpu(m):
    w = mgpu_pack(q6k(128, 1024))
    text = jax.jit(q6.qmatmul).trace(jnp.zeros((m, 1024), jnp.float32), w).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


Q6K_27B = [(5120, 17408), (10240, 5120), (1024, 5120)]  # ffn_down, attn_qkv, attn_v where Q4_K_M gives more bits


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", Q6K_27B)
@pytest.mark.parametrize("m", [2, 16, 23, 64])
def test_kernel_at_27b_shapes(n, k, m):
    w = mgpu_pack(q6k(n, k, seed=m))
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
    got = q6.qmatmul(x, w)
    assert got.shape == (m, n) and bool(jnp.all(jnp.isfinite(got)))
    assert rel(got, q6.reference(x, w)) < 1e-4


@pytest.mark.gpu
def test_kernel_on_the_output_head():
    """The 27B's output head (Q6_K, 248320 x 5120) at 23 tokens, the tree verify's logits."""
    w = mgpu_pack(q6k(248320, 5120, seed=5))
    x = jax.random.normal(jax.random.key(5), (23, 5120), jnp.float32)
    assert rel(q6.qmatmul(x, w), q6.reference(x, w)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("mgpu", ["beside", "only"])
def test_qmatmul_with_the_q6k_layout_at_a_27b_shape(mgpu):
    """qmatmul on ffn_down's shape with the Mosaic layout beside the Triton one (one token on the float GEMV) or
    alone (every product on the Mosaic kernel), against qmatmul's reference."""
    qt = q6k(5120, 17408, seed=6)
    pw = qm.pack(qt.fmt, qt.shape, qt.data, mgpu=mgpu)
    assert isinstance(pw.mgpu, q6.MgpuQ6K) and pw.mgpu_only == (mgpu == "only")
    for m in (1, 23):
        x = jax.random.normal(jax.random.key(m), (m, 17408), jnp.float32)
        assert rel(qm.qmatmul(x, pw), qm.qmatmul_reference(x, pw)) < 1e-4, m


@pytest.mark.gpu
def test_kernel_multiplies_the_reference_float16_weights():
    """x one-hot at 64 columns reads 64 of the kernel's float16 weights out exactly (`f16_weights`', bit for bit)."""
    w = mgpu_pack(q6k(512, 2048, seed=11))
    cols = np.random.default_rng(0).permutation(2048)[:64]
    x = jnp.zeros((64, 2048), jnp.float32).at[np.arange(64), cols].set(2.0 ** F16_SHIFT)
    np.testing.assert_array_equal(np.asarray(q6.qmatmul(x, w)),
                                  np.asarray(q6.f16_weights(w)[:, cols].T.astype(jnp.float32)))


def test_pack_gives_q6k_the_mosaic_layout():
    """mgpu "beside" and "only" give Q6_K weights this kernel's layout too, "off" does not; qmatmul has a Mosaic GPU
    kernel for Q4_K and Q6_K only."""
    qt = q6k(128, 512)
    for mgpu in ("beside", "only"):
        assert isinstance(qm.pack(qt.fmt, qt.shape, qt.data, mgpu=mgpu).mgpu, q6.MgpuQ6K)
    assert qm.pack(qt.fmt, qt.shape, qt.data).mgpu is None
    assert set(qm.MGPU_MODULES) == {"Q4_K", "Q6_K"}


def test_the_q6k_layout_alone_in_qmatmul():
    """mgpu="only" packs a Q6_K weight in this kernel's layout alone: its values exactly, its products (one token
    too) lowered to the Mosaic kernel, its reference the kernel's."""
    qt = q6k(128, 512)
    pw = qm.pack(qt.fmt, qt.shape, qt.data, mgpu="only")
    assert pw.mgpu_only and isinstance(pw.mgpu, q6.MgpuQ6K) and pw.nbytes == mgpu_pack(qt).nbytes
    np.testing.assert_array_equal(np.asarray(qm.dequantize(pw)), np.asarray(dequantize(qt)))
    for m in (1, 23):
        x = jax.random.normal(jax.random.key(m), (m, 512), jnp.float32)
        text = jax.jit(qm.qmatmul).trace(x, pw).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text and "triton" not in text, m
        np.testing.assert_array_equal(np.asarray(qm.qmatmul_reference(x, pw)), np.asarray(q6.reference(x, pw.mgpu)))
