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


def rel(a, b) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def q6k(n: int, k: int, seed: int = 0):
    return random_matrix(jax.random.key(seed), "Q6_K", (n, k))


def test_layout_holds_the_gguf_values_exactly():
    qt = q6k(128, 768)
    w = q6.pack(qt)
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
    w = q6.pack(q6k(64, 512, seed=3))
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
    w = q6.pack(qt)
    x = jax.random.normal(jax.random.key(2), (23, 1024), jnp.float32)
    exact = jnp.einsum("mk,nk->mn", x, dequantize(qt), precision=jax.lax.Precision.HIGHEST)
    assert rel(q6.reference(x, w), exact) < 6e-4
    assert rel(q6.f16_weights(w).astype(jnp.float32), dequantize(qt) * 2.0 ** qm.F16_SHIFT) < 5e-4


def test_refuses_what_it_cannot_take():
    with pytest.raises(NotImplementedError, match="Q6_K"):
        q6.pack(random_matrix(jax.random.key(0), "Q4_K", (64, 256)))
    with pytest.raises(ValueError, match="multiple of 64 rows"):
        q6.pack(q6k(48, 256))
    loud = q6k(64, 256)
    loud = type(loud)({**loud.data, "d": jnp.full_like(loud.data["d"], 60.0)}, loud.fmt, loud.shape)
    with pytest.raises(ValueError, match="float16"):
        q6.pack(loud)
    w = q6.pack(q6k(64, 512))
    with pytest.raises(ValueError, match="1 to 64 rows"):
        q6.qmatmul(jnp.zeros((65, 512)), w)
    with pytest.raises(ValueError, match="columns"):
        q6.qmatmul(jnp.zeros((4, 256)), w)
    with pytest.raises(ValueError, match="split 4 ways"):
        q6.qmatmul(jnp.zeros((4, 512)), w, splits=4)


@pytest.mark.parametrize("m", [1, 23, 64])
def test_lowers_for_cuda_on_a_cpu(m):
    w = q6.pack(q6k(128, 1024))
    text = jax.jit(q6.qmatmul).trace(jnp.zeros((m, 1024), jnp.float32), w).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("cols", [64, 128])
def test_lowers_for_cuda_with_several_groups_a_wgmma(cols):
    w = q6.pack(q6k(128, 1024))
    x = jnp.zeros((23, 1024), jnp.float32)
    assert "mosaic_gpu" in q6.qmatmul.trace(x, w, cols=cols).lower(lowering_platforms=("cuda",)).as_text()
    for bad in (48, 256):
        with pytest.raises(ValueError, match="wgmma call"):
            q6.qmatmul(x, w, cols=bad)


def test_split_sums_by_tma_lower_for_cuda_on_a_cpu():
    w = q6.pack(q6k(128, 1024))
    text = q6.qmatmul.trace(jnp.zeros((23, 1024), jnp.float32), w, split_sum="tma_add").lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


Q6K_27B = [(5120, 17408), (10240, 5120), (1024, 5120)]  # ffn_down, attn_qkv, attn_v where Q4_K_M gives more bits


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", Q6K_27B)
@pytest.mark.parametrize("m", [2, 16, 23, 64])
def test_kernel_at_27b_shapes(n, k, m):
    w = q6.pack(q6k(n, k, seed=m))
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
    got = q6.qmatmul(x, w)
    assert got.shape == (m, n) and bool(jnp.all(jnp.isfinite(got)))
    assert rel(got, q6.reference(x, w)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [64, 128])
def test_kernel_with_several_groups_a_wgmma(cols):
    w = q6.pack(q6k(1024, 5120, seed=3))
    for m in (5, 23, 40):
        x = jax.random.normal(jax.random.key(m), (m, 5120), jnp.float32)
        assert rel(q6.qmatmul(x, w, cols=cols), q6.reference(x, w)) < 1e-4
    x = jnp.zeros((64, 5120), jnp.float32).at[np.arange(64), np.arange(64) * 80].set(2.0 ** qm.F16_SHIFT)
    np.testing.assert_array_equal(np.asarray(q6.qmatmul(x, w, cols=cols)),
                                  np.asarray(q6.f16_weights(w)[:, ::80].T.astype(jnp.float32)))


@pytest.mark.gpu
def test_split_sums_by_tma_at_a_27b_shape():
    w = q6.pack(q6k(5120, 17408, seed=7))
    x = jax.random.normal(jax.random.key(23), (23, 17408), jnp.float32)
    got = q6.qmatmul(x, w, split_sum="tma_add")
    assert rel(got, q6.reference(x, w)) < 1e-4 and rel(got, q6.qmatmul(x, w)) < 1e-6


@pytest.mark.gpu
def test_kernel_on_the_output_head():
    """The 27B's output head (Q6_K, 248320 x 5120) at 23 tokens, the tree verify's logits."""
    w = q6.pack(q6k(248320, 5120, seed=5))
    x = jax.random.normal(jax.random.key(5), (23, 5120), jnp.float32)
    assert rel(q6.qmatmul(x, w), q6.reference(x, w)) < 1e-4


@pytest.mark.gpu
def test_the_q6k_layout_alone_at_a_27b_shape(q6k_layout_only):
    pw = qm.pack(q6k(5120, 17408, seed=6))
    for m in (1, 23):
        x = jax.random.normal(jax.random.key(m), (m, 17408), jnp.float32)
        assert pw.mgpu_only and rel(qm.qmatmul(x, pw), q6.reference(x, pw.mgpu)) < 1e-4


@pytest.mark.gpu
def test_kernel_multiplies_the_reference_float16_weights():
    """x one-hot at 64 columns reads 64 of the kernel's float16 weights out exactly (`f16_weights`', bit for bit)."""
    w = q6.pack(q6k(512, 2048, seed=11))
    cols = np.random.default_rng(0).permutation(2048)[:64]
    x = jnp.zeros((64, 2048), jnp.float32).at[np.arange(64), cols].set(2.0 ** qm.F16_SHIFT)
    np.testing.assert_array_equal(np.asarray(q6.qmatmul(x, w)),
                                  np.asarray(q6.f16_weights(w)[:, cols].T.astype(jnp.float32)))


@pytest.fixture
def q6k_layout_only(monkeypatch):
    monkeypatch.setattr(qm, "MGPU_LAYOUT", "only")


def test_pack_takes_the_q6k_layout_only_where_mgpu_formats_says():
    """Q6_K takes its Mosaic layout by default and stays on the Triton kernels where `MGPU_FORMATS` leaves it out;
    an unknown format there is refused."""
    assert qm.MGPU_FORMATS == ("Q4_K", "Q6_K")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qm, "MGPU_LAYOUT", "only")
        assert isinstance(qm.pack(q6k(128, 512)).mgpu, q6.MgpuQ6K)
        mp.setattr(qm, "MGPU_FORMATS", ("Q4_K",))
        assert qm.pack(q6k(128, 512)).mgpu is None
        mp.setattr(qm, "MGPU_FORMATS", ("Q4_K", "Q5_K"))
        with pytest.raises(ValueError, match="MGPU_FORMATS"):
            qm.pack(q6k(128, 512))
    with pytest.raises(NotImplementedError, match="Q5_K"):
        qm.mgpu_module("Q5_K")


def test_the_q6k_layout_alone_in_qmatmul(q6k_layout_only):
    """With Q6_K in `MGPU_FORMATS`, MGPU_LAYOUT "only" packs a Q6_K weight in this kernel's layout alone: its values
    exactly, its products (one token too) lowered to the Mosaic kernel, and the f16x2 reference its float16
    weights."""
    qt = q6k(128, 512)
    pw = qm.pack(qt)
    assert pw.mgpu_only and isinstance(pw.mgpu, q6.MgpuQ6K) and pw.nbytes == q6.pack(qt).nbytes
    np.testing.assert_array_equal(np.asarray(qm.dequantize_packed(pw)), np.asarray(dequantize(qt)))
    np.testing.assert_array_equal(np.asarray(qm.dequantize_packed(pw, "f16x2")),
                                  np.asarray(q6.f16_weights(pw.mgpu).astype(jnp.float32) / 2.0 ** qm.F16_SHIFT))
    for m in (1, 23):
        x = jnp.zeros((m, 512), jnp.float32)
        text = jax.jit(qm.qmatmul).trace(x, pw).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text and "triton" not in text, m
