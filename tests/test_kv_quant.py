"""KV cache types (dflash_jax/kv_quant.py): every block type's blocks, bytes and values bit for bit against numpy
references of the formats written here, from the layouts in docs/kv_cache.md (and, for Q8_0 and Q4_0, against
gguf-py's quantizers of llama.cpp's types), on random rows and on the edge cases of each rounding rule."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from dflash_jax import kv_quant as kq
from dflash_jax.errors import InputError

F32 = np.float32


def ftz_free(x: np.ndarray) -> np.ndarray:
    """x with no float32 denormals among its inputs or the scales it makes (XLA flushes them; a separate test)."""
    return np.where(np.abs(x) < 1e-30, F32(0), x).astype(F32)


# ---------------------------------------------------------------------------------------------------------------
# numpy references of the formats, block by block: x [blocks, 32] float32 -> bytes [blocks, block_bytes]

def ref_q8_0(x):
    amax = np.abs(x).max(axis=1)
    d = (amax / F32(127)).astype(F32)
    inv = np.array([F32(1) / v if v else F32(0) for v in d], F32)
    v = (x * inv[:, None]).astype(F32)
    q = np.trunc(v.astype(np.float64) + np.copysign(0.5, v))  # C roundf, exact in float64
    return np.concatenate([d.astype(np.float16)[:, None].view(np.uint8), q.astype(np.int8).view(np.uint8)], axis=1)


def ref_q4_0(x):
    out = np.zeros((len(x), 18), np.uint8)
    for i, row in enumerate(x):
        amax, mx = F32(0), F32(0)
        for value in row:  # the C loop: the first of equal magnitudes wins
            if amax < abs(value):
                amax, mx = abs(value), value
        d = F32(mx / F32(-8))
        inv = F32(1) / d if d else F32(0)
        q = [min(15, int(np.trunc(F32(F32(value * inv) + F32(8.5))))) for value in row]
        out[i, :2] = np.array([d], np.float16).view(np.uint8)
        out[i, 2:] = [q[j] | (q[j + 16] << 4) for j in range(16)]
    return out


def ref_signs(n):
    return np.array([-1 if bin((i + 1) * 2654435761 % 2**32).count("1") % 2 else 1 for i in range(n)], F32)


def ref_fwht(x):
    """The in-place butterfly loop, float32, on rows x [rows, n]."""
    x = x.astype(F32).copy()
    n, h = x.shape[1], 1
    while h < n:
        for i in range(0, n, 2 * h):
            for j in range(i, i + h):
                a, b = x[:, j].copy(), x[:, j + h].copy()
                x[:, j], x[:, j + h] = a + b, a - b
        h *= 2
    return x


def ref_shifts(n):
    log = int(np.log2(n))
    e = (log + 1) // 2
    return F32(2.0 ** -e), F32(2.0 ** -(log - e))


REF_LEVELS = np.array([-256, -157, -87, -28, 28, 87, 157, 256], F32) / F32(256)


def ref_rq3_0(rows):
    """rows [r, n] -> bytes [r * n / 32, 14]."""
    n = rows.shape[1]
    y = (ref_fwht(rows * ref_signs(n)) * ref_shifts(n)[0]).reshape(-1, 32)
    out = np.zeros((len(y), 14), np.uint8)
    for i, block in enumerate(y):
        d = np.float16(np.abs(block).max())
        inv = F32(1) / F32(d) if d else F32(0)
        for j, value in enumerate(block):
            t = F32(value * inv)
            dist = np.abs(t.astype(np.float64) - REF_LEVELS.astype(np.float64))
            c = 7 - int(np.argmin(dist[::-1]))  # nearest level, the upper one at a tie
            out[i, 2 + j % 8] |= (c & 3) << (2 * (j // 8))
            out[i, 10 + j % 4] |= (c >> 2) << (j // 4)
        out[i, :2] = np.array([d]).view(np.uint8)
    return out


REF_LEVELS4 = np.array([-237, -189, -151, -118, -89, -62, -37, -12, 12, 37, 62, 89, 118, 151, 189, 237], F32) / 256


def ref_e5m3(byte):
    """An RQ4_0 scale byte e << 3 | j: (1 + j / 8) * 2^(e - 16), 0 for byte 0 (docs/kv_cache.md)."""
    byte = int(byte)
    return F32(0) if byte == 0 else F32((1 + (byte & 7) / 8) * 2.0 ** ((byte >> 3) - 16))


def ref_e5m3_up(m):
    """The least scale byte whose value is >= m, by search (m below float32's denormals is 0)."""
    if m == 0:
        return 0
    return next((b for b in range(1, 256) if ref_e5m3(b) >= m), 255)


def ref_rq4_0(rows):
    """rows [r, n] -> bytes [r * n / 32, 17]."""
    n = rows.shape[1]
    y = (ref_fwht(rows * ref_signs(n)) * ref_shifts(n)[0]).reshape(-1, 32)
    out = np.zeros((len(y), 17), np.uint8)
    for i, block in enumerate(y):
        code = ref_e5m3_up(np.abs(block).max())
        d = ref_e5m3(code)
        inv = F32(1) / d if d else F32(0)
        c = [15 - int(np.argmin(np.abs(np.float64(F32(v * inv)) - REF_LEVELS4.astype(np.float64))[::-1]))
             for v in block]  # nearest level, the upper one at a tie
        out[i, 0] = code
        out[i, 1:] = [c[j] | (c[j + 16] << 4) for j in range(16)]
    return out


def ref_dequant(kind, raw, n):
    """bytes [blocks, block_bytes] of rows of n values -> float32 rows [blocks * 32 / n, n]."""
    if kind == "rq4_0":
        q = np.concatenate([raw[:, 1:] & 15, raw[:, 1:] >> 4], axis=1)
        d = np.array([ref_e5m3(b) for b in raw[:, 0]], F32)
        y = (d[:, None] * REF_LEVELS4[q]).reshape(-1, n)
        return ref_fwht(y) * ref_shifts(n)[1] * ref_signs(n)
    d = raw[:, :2].copy().view(np.float16).astype(F32)
    if kind == "q8_0":
        return (d * raw[:, 2:].view(np.int8).astype(F32)).reshape(-1, n)
    if kind == "q4_0":
        q = np.concatenate([raw[:, 2:] & 15, raw[:, 2:] >> 4], axis=1).astype(F32)
        return (d * (q - F32(8))).reshape(-1, n)
    j = np.arange(32)
    c = ((raw[:, 2 + j % 8] >> (2 * (j // 8))) & 3) | (((raw[:, 10 + j % 4] >> (j // 4)) & 1) << 2)
    y = (d * REF_LEVELS[c]).reshape(-1, n)
    return ref_fwht(y) * ref_shifts(n)[1] * ref_signs(n)


REF = {"q8_0": ref_q8_0, "q4_0": ref_q4_0}


# ---------------------------------------------------------------------------------------------------------------
# inputs

def edge_blocks():
    """Blocks of 32 that exercise each rounding rule."""
    rng = np.random.default_rng(7)
    small = rng.standard_normal(32).astype(F32)
    blocks = [
        np.zeros(32, F32),  # all zeros: d = 0, codes at zero
        np.where(np.arange(32) == 5, F32(1e5), small),  # one huge value among small ones
        np.where(np.arange(32) == 9, F32(-3e4), small),  # a negative max (Q4_0: d > 0)
        np.where(np.arange(32) == 0, F32(2e7), small),  # Q8_0's d = 2e7 / 127 past float16: an infinity
        small * F32(1e-5),  # a scale below float16's normal range (a float16 denormal)
        small * F32(3e-9),  # a scale below float16's smallest denormal: d = 0
        np.r_[np.float32([127, -127]), np.arange(-15, 15) + F32(0.5)].astype(F32),  # Q8_0 ties: d = 1, k + 0.5
        np.r_[np.float32([-8, 8]), np.arange(-15, 15) / F32(2)].astype(F32),  # Q4_0: d = 1; equal magnitudes
        np.r_[np.float32([8]), np.arange(-15, 16) / F32(2)].astype(F32),  # Q4_0 with d = -1: v + 8.5 ties
        np.full(32, F32(-2.5)),  # every value the max
    ]
    return np.stack(blocks)


def random_rows(n, rows=96, seed=0):
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.uniform(-6, 6, (rows, 1)))  # magnitudes 2e-3 .. 4e2
    return (rng.standard_normal((rows, n)) * scale).astype(F32)


def jnp_bytes(kind, rows):
    blocks = jax.jit(lambda r: kq.quantize(r, kind))(rows)
    return blocks, kq.block_bytes(blocks).reshape(-1, kq.TYPES[kind].block_bytes)


def same_bits(a, b):
    return np.array_equal(np.asarray(a, F32).view(np.uint32), np.asarray(b, F32).view(np.uint32))


# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_llama_block_types_match_the_reference_bit_for_bit(kind):
    edge = edge_blocks()
    rows = np.concatenate([edge, random_rows(64).reshape(-1, 32)]).reshape(-1, 64)
    blocks, got = jnp_bytes(kind, rows)
    with np.errstate(over="ignore", invalid="ignore"):  # the scale past float16 (an infinity, as in llama.cpp)
        want = REF[kind](rows.reshape(-1, 32))
        assert np.array_equal(got, want)
        assert np.array_equal(got.reshape(len(rows), -1), gguf.quants.quantize(rows, GT[kind.upper()]))  # gguf-py
        values = np.asarray(jax.jit(kq.dequantize)(blocks))
        assert values.shape == rows.shape and same_bits(values, ref_dequant(kind, want, 64))
        assert same_bits(values, gguf.quants.dequantize(want.reshape(len(rows), -1), GT[kind.upper()]))
    assert np.isinf(want[3, :2].copy().view(np.float16)[0])


def test_rounding_rules_at_their_ties():
    """Q8_0 rounds k + 0.5 away from zero; Q4_0's (int8_t)(v + 8.5f) rounds v = k + 0.5 up (with d = 1 and -1)."""
    ties = edge_blocks()[6:9]
    q8 = jnp_bytes("q8_0", ties[:1])[1][0, 2:].view(np.int8)
    assert q8[2:].tolist() == [int(np.sign(v) * np.floor(abs(v) + 0.5)) for v in ties[0, 2:]]
    q4 = jnp_bytes("q4_0", ties[1:])[1][:, 2:]
    nib = np.concatenate([q4 & 15, q4 >> 4], axis=1).astype(int)
    assert nib[0, 2:].tolist() == [int(np.floor(v + 8.5)) for v in ties[1, 2:]]  # d = 1
    assert nib[1].tolist() == [min(15, int(np.floor(-v + 8.5))) for v in ties[2]]  # d = -1 (max +8)


def test_rotated_type_matches_the_reference_bit_for_bit():
    n = 256
    rng = np.random.default_rng(3)
    rows = np.concatenate([random_rows(n, rows=12), np.zeros((1, n), F32), np.eye(n, dtype=F32)[[17]] * F32(1e6),
                           np.eye(n, dtype=F32)[[3]] * F32(4e6),  # rotated values of 2.5e5: an infinite scale
                           rng.standard_normal((1, n)).astype(F32) * F32(1e-6)])
    blocks, got = jnp_bytes("rq3_0", rows)
    with np.errstate(over="ignore"):
        want = ref_rq3_0(rows)
    assert np.array_equal(got, want)
    values = np.asarray(jax.jit(kq.dequantize)(blocks))
    with np.errstate(invalid="ignore"):
        assert same_bits(values, ref_dequant("rq3_0", want, n))
    assert np.all(values[12] == 0) and np.all(np.isnan(values[14]) | np.isinf(values[14]))


def test_rq4_0_matches_the_reference_bit_for_bit():
    """RQ4_0 on random rows, a zero row (scale byte 0: zeros back), rows past the largest scale (clipped to the top
    level, finite) and below the smallest (scale byte 1)."""
    n = 128
    rng = np.random.default_rng(4)
    rows = np.concatenate([random_rows(n, rows=12), np.zeros((1, n), F32), np.eye(n, dtype=F32)[[17]] * F32(4e6),
                           rng.standard_normal((1, n)).astype(F32) * F32(1e-7)])
    blocks, got = jnp_bytes("rq4_0", rows)
    want = ref_rq4_0(rows)
    assert np.array_equal(got, want)
    values = np.asarray(jax.jit(kq.dequantize)(blocks))
    assert same_bits(values, ref_dequant("rq4_0", want, n))
    assert np.all(values[12] == 0) and np.all(np.isfinite(values[13])) and set(got[13 * 4:14 * 4, 0]) == {255}
    assert set(got[14 * 4:, 0]) == {1}


def test_rq4_0_scales_and_ties():
    """Scale bytes round |max| up to the next E5M3 value; a rotated value on a midpoint takes the upper level."""
    m = jnp.asarray([0.0, 1e-9, 1.0, 1.0000001, 1.125, 1.9, 2.0, 6.144e4, 7e4], jnp.float32)
    codes = np.asarray(kq._e5m3_up(m))
    assert codes.tolist() == [ref_e5m3_up(v) for v in np.asarray(m)] == [0, 1, 128, 129, 129, 136, 136, 255, 255]
    assert [float(kq._e5m3(jnp.uint8(c))) for c in (0, 1, 128, 255)] == [0.0, 1.125 * 2**-16, 1.0, 61440.0]
    n = 32
    y = np.zeros((1, n), F32)
    y[0, :6] = [256, 24.5, -24.5, 103.5, -103.5, 0]  # d = 256 (byte 192): (37 + 12) / 2 and (118 + 89) / 2, 0
    _, inverse = ref_shifts(n)
    x = ref_fwht(y) * inverse * ref_signs(n)
    got = jnp_bytes("rq4_0", x)[1]
    assert np.array_equal(got, ref_rq4_0(x)) and got[0, 0] == 192
    codes = np.concatenate([got[0, 1:] & 15, got[0, 1:] >> 4])[:6]
    assert codes.tolist() == [15, 9, 7, 12, 4, 8]


def test_rotated_ties_take_the_upper_level():
    """Rotated values built to sit on the codebook's midpoints (d = 512: 115, 244 and 413 are midpoints * 512)."""
    n = 64
    y = np.zeros((1, n), F32)
    y[0, :8] = [512, 115, -115, 244, -244, 413, -413, 0]
    _, inverse = ref_shifts(n)
    x = ref_fwht(y) * inverse * ref_signs(n)  # integers and halves: every step exact
    got = jnp_bytes("rq3_0", x)[1]
    assert np.array_equal(got, ref_rq3_0(x))
    j = np.arange(8)
    codes = ((got[0, 2 + j % 8] >> (2 * (j // 8))) & 3) | (((got[0, 10 + j % 4] >> (j // 4)) & 1) << 2)
    assert codes.tolist() == [7, 5, 3, 6, 2, 7, 1, 4]


def test_a_float32_denormal_scale_gives_zeros():
    """XLA flushes float32 denormals: blocks of magnitude 1e-37 keep d = 0 and codes 0 (llama.cpp would write other
    codes, which its d of 0 multiplies to the same zeros)."""
    rows = (random_rows(64, rows=4) * F32(1e-38)).astype(F32)
    for kind in ("q8_0", "q4_0", "rq3_0"):  # rq4_0's least nonzero scale is 1.125 * 2^-16 (its own test)
        assert not np.any(np.asarray(jax.jit(lambda r: kq.dequantize(kq.quantize(r, kind)))(rows))), kind


def test_sizes_and_bits_per_value():
    bits = {name: t.bits for name, t in kq.TYPES.items()}
    assert bits == {"f32": 32, "bf16": 16, "f16": 16, "q8_0": 8.5, "q4_0": 4.5, "rq3_0": 3.5, "rq4_0": 4.25}
    cache = jax.eval_shape(lambda: kq.empty("rq3_0", (16, 1024, 4, 256)))
    assert cache.shape == (16, 1024, 4, 256)
    assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)) == 16 * 1024 * 4 * 256 * 3.5 / 8


def test_reconstruction_errors_of_gaussian_rows():
    """Relative squared error on Gaussian rows: rq3_0 near the 3-bit Lloyd-Max quantizer's 0.0345 (it rounds the
    rotated values, again Gaussian, with a per-block scale), q4_0 about a quarter of it, rq4_0 below q4_0 in fewer
    bits (0.0068 against 0.0074), q8_0 far below."""
    x = np.random.default_rng(5).standard_normal((256, 256)).astype(F32)

    def err(kind):
        back = np.asarray(jax.jit(lambda r: kq.dequantize(kq.quantize(r, kind)))(x))
        return float(np.sum((back - x) ** 2) / np.sum(x ** 2))

    assert 0.025 < err("rq3_0") < 0.035 and 0.005 < err("q4_0") < 0.01 and err("q8_0") < 1e-4
    assert 0.006 < err("rq4_0") < 0.95 * err("q4_0")


def test_stored_and_readable_and_bad_names():
    rows = jnp.asarray(random_rows(64, rows=6).reshape(2, 3, 64))
    cache = kq.empty("q4_0", (2, 3, 64))
    held = kq.stored(rows, cache)
    assert isinstance(held, kq.KVBlocks) and kq.stored(held, cache) is held
    assert same_bits(kq.readable(held), kq.dequantize(kq.quantize(rows, "q4_0")))
    assert same_bits(kq.readable(held, 1), kq.dequantize(kq.quantize(rows[1], "q4_0")))
    assert kq.stored(rows, kq.empty("bf16", (2, 3, 64))).dtype == jnp.bfloat16
    with pytest.raises(InputError, match="KV type 'q3' is not one of f32, bf16, f16, q8_0, q4_0, rq3_0, rq4_0"):
        kq.kv_type("q3")
    with pytest.raises(NotImplementedError, match="rq3_0 needs a head_dim that is a power of two"):
        kq.empty("rq3_0", (4, 96))
    with pytest.raises(NotImplementedError, match="q8_0 needs a head_dim that is a multiple of 32"):
        kq.empty("q8_0", (4, 80))
