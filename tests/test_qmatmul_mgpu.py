"""The Mosaic GPU Q4_K kernel (pallas_kernels/qmatmul_mgpu.py): its layout and reference on a CPU, that it lowers
for CUDA with no GPU, and (-m gpu) the compiled kernel against its reference at the 27B's Q4_K shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.quant import dequantize
from dflash_jax.testing.synthetic import random_matrix
from pallas_kernels import qmatmul as qm
from pallas_kernels import qmatmul_mgpu as mg


def rel(a, b) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def q4k(n: int, k: int, seed: int = 0):
    return random_matrix(jax.random.key(seed), "Q4_K", (n, k))


@pytest.mark.parametrize("order", mg.ORDERS)
def test_layout_holds_the_gguf_values_exactly(order):
    qt = q4k(128, 768)
    w = mg.pack(qt, order)
    assert w.order == order
    assert w.q.dtype == jnp.int4 and w.scales.dtype == jnp.uint32 and w.scales.shape == (3 * 5, 128)
    np.testing.assert_array_equal(np.asarray(mg.dequantize(w)), np.asarray(dequantize(qt)))
    assert w.nbytes == 128 * 768 // 256 * (128 + 16 + 4)  # 148 bytes a super-block: the GGUF's 144 + 2.8 %


def f16_words(word: np.ndarray) -> np.ndarray:
    """uint32 words -> their two float16 halves, low first, as float32 [..., 2]."""
    return np.ascontiguousarray(word, "<u4").view("<f2").reshape(*np.shape(word), 2).astype(np.float32)


def test_wgmma_order_gives_each_lane_its_wgmma_registers():
    """An emulation of `_f16_tile_wgmma` on a 32-column group: lane c of a row takes stored positions 8c..8c+7 as
    one word (WGMMA_UPCAST_4X, nibble p = position 8c + p); its register t, made by the kernel's lop3 and sub from
    the word (shifted right by 8 for t = 2, 3), holds the quants of columns 8t + 2c and 8t + 2c + 1 (WGMMA layout)."""
    qt = q4k(64, 256, seed=7)
    natural, stored = (np.asarray(mg.pack(qt, o).q.astype(jnp.int32)) for o in ("natural", "wgmma"))
    q = natural + 8
    assert sorted(mg.WGMMA_PERM) == list(range(32))
    for c in range(4):
        word = sum((stored[:, 8 * c + p: 256: 32].astype(np.uint32) & 0xF) << (4 * p) for p in range(8))
        for t in range(4):
            shifted = word >> (8 * (t // 2))
            mask, xor, magic = mg.NIBBLE_FIELDS[t % 2]
            got = f16_words((shifted & mask) ^ (xor * 0x10001)) - f16_words(np.array([magic], np.uint32))[0, 0]
            np.testing.assert_array_equal(got[..., 0], q[:, 8 * t + 2 * c: 256: 32])
            np.testing.assert_array_equal(got[..., 1], q[:, 8 * t + 2 * c + 1: 256: 32])


def test_subnormal_form_emulated_is_the_reference_weights():
    """An emulation of `_f16_tile_wgmma(..., subnormal=True)` on the packed words, lane by lane, in exact float64
    arithmetic (the lop3 that leaves a nibble pair as float16 subnormals, `_scaled_dd`'s products by
    `subnormal_gains`, the scale pairs, the multiply by SUBNORMAL_PAIR, one fma rounded once) gives `f16_weights`'
    every weight bit for bit."""
    w = mg.pack(q4k(64, 512, seed=5), nibbles="subnormal")
    halves = lambda word: f16_words(np.asarray(word, np.uint32)).astype(np.float64)  # noqa: E731
    stored = np.asarray(w.q.astype(jnp.int32) & 0xF).astype(np.uint32)
    words = np.asarray(w.scales).T.reshape(64, 2, mg.SCALE_WORDS)
    want = np.asarray(mg.f16_weights(w)).astype(np.float64)
    dd = halves(words[..., -1])
    for gain in mg.subnormal_gains(w.gain):
        dd = (dd * halves([gain])[0]).astype(np.float16).astype(np.float64)
    for sb, j, c in np.ndindex(2, mg.SUB_BLOCKS, 4):
        biased = ((words[:, sb, j // 2] >> np.uint32(8 * (j % 2))) & 0x00FF00FF) | 0x64006400
        pair = ((halves(biased) - 1024) * dd[:, sb]).astype(np.float16).astype(np.float64)  # (S, NM'')
        low = (pair * halves([mg.SUBNORMAL_PAIR])[0]).astype(np.float16).astype(np.float64)  # (S16, NM)
        col0 = 256 * sb + 32 * j
        lane = sum(stored[:, col0 + 8 * c + p] << np.uint32(4 * p) for p in range(8))
        for t in range(4):
            mask, xor, _ = mg.NIBBLE_FIELDS[t % 2]
            u = ((lane >> np.uint32(8 * (t // 2))) & mask) ^ ((xor & 0xFF) * 0x10001)
            got = (halves(u) * (low if t % 2 else pair)[:, :1] + low[:, 1:]).astype(np.float16).astype(np.float64)
            np.testing.assert_array_equal(got, want[:, col0 + 8 * t + 2 * c: col0 + 8 * t + 2 * c + 2])


def test_subnormal_form_is_as_close_as_the_magic_one():
    """The "subnormal" weights (a gain per matrix, the smallest weights float16 subnormals) land as close to the
    float32 product as the "magic" ones, and the layout's values are the GGUF's exactly."""
    qt = q4k(256, 1024, seed=1)
    w, magic = mg.pack(qt, nibbles="subnormal"), mg.pack(qt)
    assert w.nibbles == "subnormal" and -24 <= w.gain <= 6 and magic.gain == qm.F16_SHIFT
    np.testing.assert_array_equal(np.asarray(mg.dequantize(w)), np.asarray(dequantize(qt)))
    x = jax.random.normal(jax.random.key(2), (23, 1024), jnp.float32)
    exact = jnp.einsum("mk,nk->mn", x, dequantize(qt), precision=jax.lax.Precision.HIGHEST)
    assert rel(mg.reference(x, w), exact) < 1.05 * rel(mg.reference(x, magic), exact) < 6e-4
    text = jax.jit(mg.qmatmul).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_reference_is_the_float16_product():
    """The kernel's arithmetic (float16 weights and x, float32 sums) lands as close to the float32 product as
    qmatmul's f16x2 tiles, and 6x closer than bf16 tiles."""
    qt = q4k(256, 1024, seed=1)
    w, pw = mg.pack(qt), qm.pack(qt)
    x = jax.random.normal(jax.random.key(2), (23, 1024), jnp.float32)
    exact = jnp.einsum("mk,nk->mn", x, dequantize(qt), precision=jax.lax.Precision.HIGHEST)
    err = rel(mg.reference(x, w), exact)
    assert err < 6e-4
    assert err < rel(qm.qmatmul_reference(x, pw, "f32"), exact) / 3
    assert rel(mg.reference(x, w), qm.qmatmul_reference(x, pw, "f16x2")) < 6e-4


def test_refuses_what_it_cannot_take():
    with pytest.raises(NotImplementedError, match="Q4_K"):
        mg.pack(random_matrix(jax.random.key(0), "Q6_K", (64, 256)))
    with pytest.raises(ValueError, match="multiple of 64 rows"):
        mg.pack(q4k(48, 256))
    loud = random_matrix(jax.random.key(0), "Q4_K", (64, 256))
    loud = type(loud)({**loud.data, "d": jnp.full_like(loud.data["d"], 60.0)}, loud.fmt, loud.shape)
    with pytest.raises(ValueError, match="float16"):
        mg.pack(loud)
    w = mg.pack(q4k(64, 512))
    with pytest.raises(ValueError, match="1 to 64 rows"):
        mg.qmatmul(jnp.zeros((65, 512)), w)
    with pytest.raises(ValueError, match="columns"):
        mg.qmatmul(jnp.zeros((4, 256)), w)
    with pytest.raises(ValueError, match="split 4 ways"):
        mg.qmatmul(jnp.zeros((4, 512)), w, splits=4)
    with pytest.raises(ValueError, match="rows per program"):
        mg.qmatmul(jnp.zeros((4, 512)), w, rows=128)  # 64 rows
    with pytest.raises(ValueError, match="order is one of"):
        mg.pack(q4k(64, 256), "rows")
    with pytest.raises(ValueError, match="nibbles is one of"):
        mg.pack(q4k(64, 256), nibbles="bf16")
    with pytest.raises(ValueError, match="wgmma"):
        mg.pack(q4k(64, 256), "natural", nibbles="subnormal")


@pytest.mark.parametrize("m,order", [(1, "wgmma"), (23, "wgmma"), (64, "wgmma"), (23, "natural")])
def test_lowers_for_cuda_on_a_cpu(m, order):
    """Tracing and Mosaic GPU's lowering (layouts, transforms, TMA shapes, the inline PTX's operands) run without a
    GPU."""
    w = mg.pack(q4k(128, 1024), order)
    x = jnp.zeros((m, 1024), jnp.float32)
    text = mg.qmatmul.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("cols,nibbles", [(64, "magic"), (64, "subnormal"), (128, "magic")])
def test_lowers_for_cuda_with_several_sub_blocks_a_wgmma(cols, nibbles):
    """A wgmma call over 2 or 4 sub-blocks (each converted with its own scale word and part) lowers for CUDA; the
    natural order, a width that is no whole number of sub-blocks and a whole super-block (NaN on an H100) are
    refused."""
    w = mg.pack(q4k(128, 1024), nibbles=nibbles)
    x = jnp.zeros((23, 1024), jnp.float32)
    assert "mosaic_gpu" in mg.qmatmul.trace(x, w, cols=cols).lower(lowering_platforms=("cuda",)).as_text()
    for bad, order in ((64, "natural"), (48, "wgmma"), (256, "wgmma")):
        with pytest.raises(ValueError, match="wgmma call"):
            mg.qmatmul(x, mg.pack(q4k(128, 1024), order), cols=bad)


def test_split_sums_by_tma_lower_for_cuda_on_a_cpu():
    """The K splits added by TMA reduce-stores into one zeroed buffer (split_sum="tma_add") lower for CUDA, with no
    [splits, N, tokens] output; an unknown way is refused."""
    w = mg.pack(q4k(128, 1024))
    x = jnp.zeros((23, 1024), jnp.float32)
    text = mg.qmatmul.trace(x, w, split_sum="tma_add").lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "tensor<4x128x24xf32>" not in text
    assert "tensor<4x128x24xf32>" in mg.qmatmul.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ValueError, match="split_sum"):
        mg.qmatmul(x, w, split_sum="atomic")


def test_weights_are_rounded_once_to_float16():
    """The kernel's weights (q s - dmin m, the scale and min in float16) are the exact weights rounded once to
    float16, within float16's rounding of their scale and min, in either order."""
    qt = q4k(128, 512, seed=4)
    w = mg.pack(qt, "natural")
    exact = mg.dequantize(w) * 2.0 ** qm.F16_SHIFT
    assert rel(mg.f16_weights(w).astype(jnp.float32), exact) < 5e-4
    np.testing.assert_array_equal(np.asarray(mg.f16_weights(mg.pack(qt, "wgmma"))), np.asarray(mg.f16_weights(w)))


def test_scale_pairs_emulated_are_the_reference_scales():
    """An emulation of `_scale_pairs` and `_scaled_dd` on the packed words (the lop3 that masks a sub-block's two
    codes and sets float16's exponent of 1024 above them, a sub, an f16x2 multiply by (d, -dmin) 2**F16_SHIFT)
    gives the float16 scale and negated min that `f16_weights` applies, bit for bit."""
    w = mg.pack(q4k(64, 512, seed=9))
    words = np.asarray(w.scales).T.reshape(64, 2, mg.SCALE_WORDS)
    gain = np.array([mg.GAIN_PAIR], np.uint32).view(np.float16).astype(np.float32)  # (2**F16_SHIFT, -2**F16_SHIFT)
    dd = (words[..., -1:].view(np.float16).astype(np.float32) * gain).astype(np.float16).astype(np.float32)
    scale, neg_min = (np.asarray(jnp.asarray(a * 2.0 ** qm.F16_SHIFT, jnp.float16)) for a in mg._scales(w))
    for j in range(mg.SUB_BLOCKS):
        word = words[..., j // 2]
        biased = ((word >> (8 * (j % 2))) & 0x00FF00FF) | 0x64006400  # the lop3: 1024 + scale code, 1024 + min code
        biased = np.ascontiguousarray(biased, np.uint32).view(np.float16).reshape(64, 2, 2).astype(np.float32)
        both = ((biased - 1024) * dd).astype(np.float16)  # the sub (exact) and the multiply, rounded once
        np.testing.assert_array_equal(both[..., 0], scale[:, j::mg.SUB_BLOCKS].reshape(64, 2))
        np.testing.assert_array_equal(both[..., 1], neg_min[:, j::mg.SUB_BLOCKS].reshape(64, 2))


def test_default_splits_divide_the_super_blocks():
    assert mg.default_splits(17408, 5120) == 4  # 20 super-blocks, 272 row tiles
    assert mg.default_splits(5120, 17408) == 4  # 68 super-blocks
    assert mg.default_splits(5120, 256 * 6) == 2
    assert mg.default_splits(5120, 256 * 7) == 1
    assert mg.default_splits(64 * 2048, 5120) == 1  # 2048 row tiles: enough programs already


@pytest.fixture
def mgpu_layout(monkeypatch):
    monkeypatch.setattr(qm, "MGPU_LAYOUT", True)


def test_pack_adds_the_layout_where_the_kernel_takes_the_weight(mgpu_layout):
    assert isinstance(qm.pack(q4k(128, 512)).mgpu, mg.MgpuQ4K)
    assert qm.pack(q4k(48, 512)).mgpu is None  # rows not a multiple of 64: the Triton kernels only
    assert qm.pack(random_matrix(jax.random.key(0), "Q5_K", (128, 512))).mgpu is None  # no Mosaic kernel for Q5_K


def test_qmatmul_takes_the_mosaic_kernel_for_two_rows_or_more(mgpu_layout):
    """Lowered for CUDA, a product of 2+ rows with the layout is the Mosaic GPU kernel and one row the GEMV (Triton);
    in interpret mode (CPU) the Triton kernel runs and gives what it gives without the layout."""
    pw = qm.pack(q4k(128, 1024))
    lower = lambda x, **o: jax.jit(lambda x, pw: qm.qmatmul(x, pw, **o)).trace(x, pw).lower(  # noqa: E731
        lowering_platforms=("cuda",)).as_text()
    x = jax.random.normal(jax.random.key(1), (3, 1024), jnp.float32)
    assert "mosaic_gpu" in lower(x) and "triton" not in lower(x)
    assert "mosaic_gpu" not in lower(x, mgpu=False) and "triton" in lower(x, mgpu=False)
    assert "mosaic_gpu" not in lower(x[:1])
    plain = qm.PackedWeight(pw.data, pw.fmt, pw.shape, pw.f16_ok)
    np.testing.assert_array_equal(np.asarray(qm.qmatmul(x, pw, interpret=True)),
                                  np.asarray(qm.qmatmul(x, plain, interpret=True)))


@pytest.fixture
def mgpu_only(monkeypatch):
    monkeypatch.setattr(qm, "MGPU_LAYOUT", "only")


def test_the_mosaic_layout_alone_replaces_the_q4k_fields(mgpu_only):
    """MGPU_LAYOUT "only": the Mosaic layout is the weight's only copy (its bytes, its values), weights the kernel
    cannot take keep the Triton layout, every product of it is the Mosaic kernel (one token too), and where that
    cannot run (interpret mode, mgpu=False) qmatmul says so."""
    qt = q4k(128, 512)
    pw = qm.pack(qt)
    assert pw.mgpu_only and pw.data == {} and pw.nbytes == pw.mgpu.nbytes == mg.pack(qt).nbytes
    np.testing.assert_array_equal(np.asarray(qm.dequantize_packed(pw)), np.asarray(dequantize(qt)))
    assert not qm.pack(q4k(48, 512)).mgpu_only and qm.pack(q4k(48, 512)).data
    for m in (1, 23):
        x = jnp.zeros((m, 512), jnp.float32)
        text = jax.jit(qm.qmatmul).trace(x, pw).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text and "triton" not in text, m
    with pytest.raises(ValueError, match="Mosaic GPU kernel alone"):
        qm.qmatmul(jnp.zeros((2, 512)), pw, interpret=True)
    with pytest.raises(ValueError, match="Mosaic GPU kernel alone"):
        qm.qmatmul(jnp.zeros((2, 512)), pw, mgpu=False)


def test_mgpu_layout_values_are_checked(monkeypatch):
    monkeypatch.setattr(qm, "MGPU_LAYOUT", "both")
    with pytest.raises(ValueError, match="MGPU_LAYOUT is one of"):
        qm.pack(q4k(64, 256))


Q4K_27B = [(17408, 5120), (5120, 17408), (10240, 5120), (6144, 5120), (5120, 6144), (12288, 5120)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", Q4K_27B)
@pytest.mark.parametrize("m,order", [(m, "wgmma") for m in (2, 16, 23, 32, 64)] + [(2, "natural"), (23, "natural")]
                         + [(m, "subnormal") for m in (2, 23, 64)])
def test_kernel_at_27b_shapes(n, k, m, order):
    nibbles = "subnormal" if order == "subnormal" else "magic"  # the "subnormal" form (in the "wgmma" order)
    w = mg.pack(q4k(n, k, seed=m), "wgmma" if order == "subnormal" else order, nibbles)
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
    got = mg.qmatmul(x, w)
    assert got.shape == (m, n) and bool(jnp.all(jnp.isfinite(got)))
    assert rel(got, mg.reference(x, w)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["wgmma", "natural", "subnormal"])
def test_kernel_multiplies_the_reference_float16_weights(order):
    """x one-hot at 64 columns (a 2**F16_SHIFT, exact in float16) reads 64 of the kernel's weights out exactly:
    every row's float16 weight at each column is `f16_weights`', bit for bit (times the output's 2**(F16_SHIFT -
    gain), a power of two)."""
    w = mg.pack(q4k(512, 2048, seed=11), "wgmma" if order == "subnormal" else order,
                "subnormal" if order == "subnormal" else "magic")
    cols = np.random.default_rng(0).permutation(2048)[:64]
    x = jnp.zeros((64, 2048), jnp.float32).at[np.arange(64), cols].set(2.0 ** qm.F16_SHIFT)
    np.testing.assert_array_equal(np.asarray(mg.qmatmul(x, w)),
                                  np.asarray(mg.f16_weights(w)[:, cols].T.astype(jnp.float32)
                                             * 2.0 ** (qm.F16_SHIFT - w.gain)))


@pytest.mark.gpu
@pytest.mark.parametrize("splits,stages,rows", [(1, 2, 64), (2, 4, 128), (4, 3, 256)])
@pytest.mark.parametrize("order", mg.ORDERS)
def test_kernel_options(splits, stages, rows, order):
    w = mg.pack(q4k(1024, 5120, seed=3), order)
    for m in (5, 40):
        x = jax.random.normal(jax.random.key(m), (m, 5120), jnp.float32)
        assert rel(mg.qmatmul(x, w, splits=splits, stages=stages, rows=rows), mg.reference(x, w)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("cols", mg.WGMMA_COLS[1:])
@pytest.mark.parametrize("nibbles", mg.NIBBLES)
def test_kernel_with_several_sub_blocks_a_wgmma(cols, nibbles):
    w = mg.pack(q4k(1024, 5120, seed=3), nibbles=nibbles)
    for m in (5, 23, 40):
        x = jax.random.normal(jax.random.key(m), (m, 5120), jnp.float32)
        assert rel(mg.qmatmul(x, w, cols=cols), mg.reference(x, w)) < 1e-4


@pytest.mark.gpu
def test_split_sums_by_tma_at_a_27b_shape():
    """split_sum="tma_add" at ffn_gate's shape: the reference's product, within float32 rounding of the order in
    which the four splits land."""
    w = mg.pack(q4k(17408, 5120, seed=7))
    for m in (5, 23):
        x = jax.random.normal(jax.random.key(m), (m, 5120), jnp.float32)
        got = mg.qmatmul(x, w, split_sum="tma_add")
        assert rel(got, mg.reference(x, w)) < 1e-4 and rel(got, mg.qmatmul(x, w)) < 1e-6


@pytest.mark.gpu
def test_qmatmul_with_the_layout_at_27b_shapes(mgpu_layout):
    pw = qm.pack(q4k(17408, 5120, seed=5))
    x = jax.random.normal(jax.random.key(5), (23, 5120), jnp.float32)
    assert rel(qm.qmatmul(x, pw), mg.reference(x, pw.mgpu)) < 1e-4
    triton = qm.qmatmul(x, pw, mgpu=False)
    assert rel(triton, qm.qmatmul_reference(x, pw, "f16x2")) < 4e-3  # BF16_TILES of test_qmatmul.py


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 23])
def test_the_mosaic_layout_alone_at_27b_shapes(mgpu_only, m):
    pw = qm.pack(q4k(17408, 5120, seed=6))
    x = jax.random.normal(jax.random.key(6), (m, 5120), jnp.float32)
    assert pw.mgpu_only and rel(qm.qmatmul(x, pw), mg.reference(x, pw.mgpu)) < 1e-4
