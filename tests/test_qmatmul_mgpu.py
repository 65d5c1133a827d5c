"""The Mosaic GPU Q4_K kernel (pallas_kernels/qmatmul_mgpu.py): its layout and reference on a CPU, that it lowers
for CUDA with no GPU, how qmatmul routes to it, and (-m gpu) the compiled kernel against its reference at the 27B's
Q4_K shapes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import kernels
from dflash_jax.config import KernelConfig
from dflash_jax.quant import dequantize
from dflash_jax.testing.synthetic import random_matrix
from pallas_kernels import ggml, qmatmul_triton
from pallas_kernels import qmatmul as qm
from pallas_kernels import qmatmul_mgpu as mg
from pallas_kernels.qcommon import F16_SHIFT


def rel(a, b) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def q4k(n: int, k: int, seed: int = 0):
    return random_matrix(jax.random.key(seed), "Q4_K", (n, k))


def mgpu_pack(qt):
    return mg.pack(qt.fmt, qt.shape, qt.data)


def test_layout_holds_the_gguf_values_exactly():
    qt = q4k(128, 768)
    w = mgpu_pack(qt)
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
    q = np.asarray(ggml.nibbles(qt.data["qs"].reshape(64, 1, 4, 32))).reshape(64, 256)  # column 64p + 32nib + l
    stored = np.asarray(mgpu_pack(qt).q.astype(jnp.int32))
    assert sorted(mg.WGMMA_PERM) == list(range(32))
    for c in range(4):
        word = sum((stored[:, 8 * c + p: 256: 32].astype(np.uint32) & 0xF) << (4 * p) for p in range(8))
        for t in range(4):
            shifted = word >> (8 * (t // 2))
            mask, xor, magic = mg.NIBBLE_FIELDS[t % 2]
            got = f16_words((shifted & mask) ^ (xor * 0x10001)) - f16_words(np.array([magic], np.uint32))[0, 0]
            np.testing.assert_array_equal(got[..., 0], q[:, 8 * t + 2 * c: 256: 32])
            np.testing.assert_array_equal(got[..., 1], q[:, 8 * t + 2 * c + 1: 256: 32])


def test_reference_is_the_float16_product():
    """The kernel's arithmetic (float16 weights and x, float32 sums) lands 6x closer to the float32 product than bf16
    weights and x, and its weights are the f16x2 tiles' of the Triton kernel bit for bit: the two kernels share
    qmatmul's reference."""
    qt = q4k(256, 1024, seed=1)
    w, pw = mgpu_pack(qt), qm.pack(qt.fmt, qt.shape, qt.data)
    x = jax.random.normal(jax.random.key(2), (23, 1024), jnp.float32)
    exact = jnp.einsum("mk,nk->mn", x, dequantize(qt), precision=jax.lax.Precision.HIGHEST)
    bf16 = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    err = rel(mg.reference(x, w), exact)
    assert err < 6e-4
    assert err < rel(jnp.einsum("mk,nk->mn", bf16(x), bf16(dequantize(qt)), precision="highest"), exact) / 3
    np.testing.assert_array_equal(np.asarray(mg.f16_weights(w).astype(jnp.float32) / 2.0 ** F16_SHIFT),
                                  np.asarray(qmatmul_triton.mma_weights(pw)))
    assert rel(mg.reference(x, w), qm.qmatmul_reference(x, pw)) < 1e-6


def test_refuses_what_it_cannot_take():
    q6k = random_matrix(jax.random.key(0), "Q6_K", (64, 256))
    with pytest.raises(NotImplementedError, match="Q4_K"):
        mgpu_pack(q6k)
    with pytest.raises(ValueError, match="multiple of 64 rows"):
        mgpu_pack(q4k(48, 256))
    loud = random_matrix(jax.random.key(0), "Q4_K", (64, 256))
    loud = type(loud)({**loud.data, "d": jnp.full_like(loud.data["d"], 60.0)}, loud.fmt, loud.shape)
    with pytest.raises(ValueError, match="float16"):
        mgpu_pack(loud)
    w = mgpu_pack(q4k(64, 512))
    with pytest.raises(ValueError, match="1 to 64 rows"):
        mg.qmatmul(jnp.zeros((65, 512)), w)
    with pytest.raises(ValueError, match="columns"):
        mg.qmatmul(jnp.zeros((4, 256)), w)
    with pytest.raises(ValueError, match="split 4 ways"):
        mg.qmatmul(jnp.zeros((4, 512)), w, splits=4)


@pytest.mark.parametrize("m", [1, 23, 64])
def test_lowers_for_cuda_on_a_cpu(m):
    """Tracing and Mosaic GPU's lowering (layouts, transforms, TMA shapes, the inline PTX's operands) run without a
    GPU; the K splits' partial products come out [splits, tokens, N] for XLA to add."""
    w = mgpu_pack(q4k(128, 1024))
    x = jnp.zeros((m, 1024), jnp.float32)
    text = mg.qmatmul.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    t = -(-m // 8) * 8
    assert "mosaic_gpu" in text and f"tensor<4x{t}x128xf32>" in text


def test_weights_are_rounded_once_to_float16():
    """The kernel's weights (q s - dmin m, the scale and min in float16) are the exact weights rounded once to
    float16, within float16's rounding of their scale and min."""
    w = mgpu_pack(q4k(128, 512, seed=4))
    exact = mg.dequantize(w) * 2.0 ** F16_SHIFT
    assert 0 < rel(mg.f16_weights(w).astype(jnp.float32), exact) < 5e-4


def test_scale_pairs_emulated_are_the_reference_scales():
    """An emulation of `_scale_pairs` and `_scaled_dd` on the packed words (the lop3 that masks a sub-block's two
    codes and sets float16's exponent of 1024 above them, a sub, an f16x2 multiply by (d, -dmin) 2**F16_SHIFT)
    gives the float16 scale and negated min that `f16_weights` applies, bit for bit."""
    w = mgpu_pack(q4k(64, 512, seed=9))
    words = np.asarray(w.scales).T.reshape(64, 2, mg.SCALE_WORDS)
    gain = np.array([mg.GAIN_PAIR], np.uint32).view(np.float16).astype(np.float32)  # (2**F16_SHIFT, -2**F16_SHIFT)
    dd = (words[..., -1:].view(np.float16).astype(np.float32) * gain).astype(np.float16).astype(np.float32)
    scale, neg_min = (np.asarray(jnp.asarray(a * 2.0 ** F16_SHIFT, jnp.float16)) for a in mg._scales(w))
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


def test_pack_adds_the_layout_where_the_kernel_takes_the_weight():
    """mgpu="beside": the Mosaic layout beside the Triton one where the kernel takes the weight, else silently the
    Triton layout alone (rows not a multiple of 64; no Mosaic kernel for Q5_K)."""
    pw = qm.pack("Q4_K", (128, 512), q4k(128, 512).data, mgpu="beside")
    assert isinstance(pw.mgpu, mg.MgpuQ4K) and pw.data and not pw.mgpu_only
    assert qm.pack("Q4_K", (48, 512), q4k(48, 512).data, mgpu="beside").mgpu is None
    q5k = random_matrix(jax.random.key(0), "Q5_K", (128, 512))
    assert qm.pack(q5k.fmt, q5k.shape, q5k.data, mgpu="only").mgpu is None
    assert qm.pack("Q4_K", (128, 512), q4k(128, 512).data).mgpu is None


def lowered(x, pw) -> str:
    return jax.jit(qm.qmatmul).trace(x, pw).lower(lowering_platforms=("cuda",)).as_text()


def test_qmatmul_takes_the_mosaic_kernel_for_two_rows_or_more():
    """Lowered for CUDA, a product of 2+ rows with the layout beside is the Mosaic GPU kernel and one row the float
    GEMV (Triton); in interpret mode (CPU) the Triton kernel runs and gives what it gives without the layout."""
    qt = q4k(128, 1024)
    pw, plain = (qm.pack(qt.fmt, qt.shape, qt.data, mgpu=mgpu) for mgpu in ("beside", "off"))
    x = jax.random.normal(jax.random.key(1), (3, 1024), jnp.float32)
    assert "mosaic_gpu" in lowered(x, pw) and "triton" not in lowered(x, pw)
    assert "mosaic_gpu" not in lowered(x, plain) and "triton" in lowered(x, plain)
    assert "mosaic_gpu" not in lowered(x[:1], pw) and "gemv_q4_k" in lowered(x[:1], pw)
    got = qm.qmatmul(x, pw, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(qm.qmatmul(x, plain, interpret=True)))
    assert rel(got, qm.qmatmul_reference(x, pw)) < 1e-5
    with pytest.raises(ValueError, match="take `splits` only"):
        qm.qmatmul(x, pw, block_n=32)


def test_the_mosaic_layout_alone_replaces_the_q4k_fields():
    """mgpu="only": the Mosaic layout is the weight's only copy (its bytes, its values), weights the kernel cannot
    take keep the Triton layout, every product of it is the Mosaic kernel (one token too), its reference is the
    kernel's, and in interpret mode qmatmul says it cannot run."""
    qt = q4k(128, 512)
    pw = qm.pack(qt.fmt, qt.shape, qt.data, mgpu="only")
    assert pw.mgpu_only and pw.data == {} and pw.nbytes == pw.mgpu.nbytes == mgpu_pack(qt).nbytes
    np.testing.assert_array_equal(np.asarray(qm.dequantize(pw)), np.asarray(dequantize(qt)))
    small = qm.pack("Q4_K", (48, 512), q4k(48, 512).data, mgpu="only")
    assert not small.mgpu_only and small.data
    for m in (1, 23):
        x = jax.random.normal(jax.random.key(m), (m, 512), jnp.float32)
        text = lowered(x, pw)
        assert "mosaic_gpu" in text and "triton" not in text, m
        np.testing.assert_array_equal(np.asarray(qm.qmatmul_reference(x, pw)), np.asarray(mg.reference(x, pw.mgpu)))
    with pytest.raises(ValueError, match="Mosaic GPU kernel alone"):
        qm.qmatmul(jnp.ones((2, 512)), pw, interpret=True)


def launches(fn, *args) -> list[str]:
    """The custom calls of fn(*args) lowered for CUDA: its kernels' launches, where no two are the same function
    (the lowering calls one function for launches of one kernel and shapes)."""
    return re.findall(r"custom_call @(\w+)", jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text())


def test_weights_of_one_key_share_a_launch():
    """qmatmul_many: weights of one format and K in the Mosaic layout alone are one launch whose output holds their
    rows side by side (one float32 [splits, tokens, N1 + N2]); weights of another format or K, or with another
    layout, take their own launches; mismatched K or K splits are refused."""
    gate, up = (qm.pack("Q4_K", (128, 1024), q4k(128, 1024, seed=s).data, mgpu="only") for s in (1, 2))
    other = qm.pack("Q4_K", (192, 1024), q4k(192, 1024, seed=3).data, mgpu="only")
    q6 = random_matrix(jax.random.key(4), "Q6_K", (64, 1024))
    q6 = qm.pack(q6.fmt, q6.shape, q6.data, mgpu="only")
    x = jnp.zeros((3, 1024), jnp.float32)
    assert qm.launch_key(gate) == qm.launch_key(other) == ("Q4_K", 1024, 4) != qm.launch_key(q6)
    assert launches(qm.qmatmul_many, x, (gate, up, other)) == ["mosaic_gpu_v2"]
    text = jax.jit(qm.qmatmul_many).trace(x, (gate, up, other)).lower(lowering_platforms=("cuda",)).as_text()
    assert "tensor<4x8x448xf32>" in text
    assert launches(qm.qmatmul_many, x, (gate, q6)) == ["mosaic_gpu_v2"] * 2
    beside = qm.pack("Q4_K", (192, 1024), q4k(192, 1024, seed=1).data, mgpu="beside")
    assert qm.launch_key(beside) is None and len(launches(qm.qmatmul_many, x, (gate, beside))) == 2
    shapes = [o.shape for o in jax.eval_shape(qm.qmatmul_many, x, (gate, up, other))]
    assert shapes == [(3, 128), (3, 128), (3, 192)]
    with pytest.raises(ValueError, match="share K"):
        mg.qmatmul_many(x, (gate.mgpu, mgpu_pack(q4k(64, 512))))
    # 1100 row tiles take 1 split of 6 super-blocks (`default_splits`' 2048 programs), 1 tile takes 2
    tall, short = (mg.MgpuQ4K(jax.ShapeDtypeStruct((n, 1536), jnp.int4), jax.ShapeDtypeStruct((30, n), jnp.uint32),
                              (n, 1536)) for n in (64 * 1100, 64))
    with pytest.raises(ValueError, match="different default K splits"):
        mg.qmatmul_many.trace(jnp.zeros((3, 1536)), (tall, short))
    mg.qmatmul_many.trace(jnp.zeros((3, 1536)), (tall, short), splits=2)


def test_linears_group_the_weights_of_one_launch():
    """kernels.linears lowered for CUDA as `generate` runs a tree on Hopper: a GDN layer's qkv (Q6_K here), z
    (Q4_K), and a dense b beside an MLP-like pair make one launch for the Q4_K pair, one for the Q6_K weight, an XLA
    product for the dense one; on the reference path it is each weight's `linear`, bit for bit."""
    mosaic = KernelConfig(impl="pallas", mgpu="only")
    qts = [q4k(128, 1024, seed=1), q4k(64, 1024, seed=2), random_matrix(jax.random.key(3), "Q6_K", (128, 1024))]
    pws = [kernels.prepare_matrix(qt, mosaic) for qt in qts] + [jnp.ones((48, 1024), jnp.float32)]
    x = jax.random.normal(jax.random.key(5), (70, 1024), jnp.float32)  # two calls of at most 64 rows
    calls = launches(lambda x, ws: kernels.linears(x, ws, mosaic), x, pws)
    assert calls == ["mosaic_gpu_v2"] * 4  # (Q4_K pair, Q6_K) per 64-row call
    shapes = [o.shape for o in jax.eval_shape(lambda x, ws: kernels.linears(x, ws, mosaic), x, pws)]
    assert shapes == [(70, 128), (70, 64), (70, 128), (70, 48)]
    dense = qts + [pws[-1]]
    for got, w in zip(kernels.linears(x, dense, kernels.REFERENCE), dense):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(kernels.linear(x, w, kernels.REFERENCE)))


Q4K_27B = [(17408, 5120), (5120, 17408), (10240, 5120), (6144, 5120), (5120, 6144), (12288, 5120)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", Q4K_27B)
@pytest.mark.parametrize("m", [2, 16, 23, 32, 64])
def test_kernel_at_27b_shapes(n, k, m):
    w = mgpu_pack(q4k(n, k, seed=m))
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
    got = mg.qmatmul(x, w)
    assert got.shape == (m, n) and bool(jnp.all(jnp.isfinite(got)))
    assert rel(got, mg.reference(x, w)) < 1e-4


@pytest.mark.gpu
def test_kernel_multiplies_the_reference_float16_weights():
    """x one-hot at 64 columns (a 2**F16_SHIFT, exact in float16) reads 64 of the kernel's weights out exactly:
    every row's float16 weight at each column is `f16_weights`', bit for bit."""
    w = mgpu_pack(q4k(512, 2048, seed=11))
    cols = np.random.default_rng(0).permutation(2048)[:64]
    x = jnp.zeros((64, 2048), jnp.float32).at[np.arange(64), cols].set(2.0 ** F16_SHIFT)
    np.testing.assert_array_equal(np.asarray(mg.qmatmul(x, w)),
                                  np.asarray(mg.f16_weights(w)[:, cols].T.astype(jnp.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("splits,stages", [(1, 2), (2, 4), (4, 3)])
def test_kernel_options(splits, stages):
    w = mgpu_pack(q4k(1024, 5120, seed=3))
    for m in (5, 40):
        x = jax.random.normal(jax.random.key(m), (m, 5120), jnp.float32)
        assert rel(mg.qmatmul(x, w, splits=splits, stages=stages), mg.reference(x, w)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 23])
def test_qmatmul_with_the_layout_beside_at_27b_shapes(m):
    """mgpu="beside": 2+ tokens on the Mosaic kernel, one on the float GEMV, each against qmatmul's reference."""
    qt = q4k(17408, 5120, seed=5)
    pw = qm.pack(qt.fmt, qt.shape, qt.data, mgpu="beside")
    x = jax.random.normal(jax.random.key(m), (m, 5120), jnp.float32)
    assert pw.mgpu is not None and rel(qm.qmatmul(x, pw), qm.qmatmul_reference(x, pw)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 23])
def test_the_mosaic_layout_alone_at_27b_shapes(m):
    qt = q4k(17408, 5120, seed=6)
    pw = qm.pack(qt.fmt, qt.shape, qt.data, mgpu="only")
    x = jax.random.normal(jax.random.key(6), (m, 5120), jnp.float32)
    assert pw.mgpu_only and rel(qm.qmatmul(x, pw), qm.qmatmul_reference(x, pw)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 23, 64])
@pytest.mark.parametrize("rows", [(17408, 17408), (10240, 6144), (12288, 1024, 1024)])
def test_one_launch_is_each_weights_own_product(rows, m):
    """At the 27B's groups (an MLP's gate and up, a GDN layer's qkv and z, an attention's q, k and v), each product
    of the shared launch equals the weight's own launch bit for bit."""
    ws = [mgpu_pack(q4k(n, 5120, seed=i)) for i, n in enumerate(rows)]
    x = jax.random.normal(jax.random.key(m), (m, 5120), jnp.float32)
    for got, w in zip(mg.qmatmul_many(x, tuple(ws)), ws):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(mg.qmatmul(x, w)))
