"""KV cache types: float32, bfloat16 and float16 arrays, llama.cpp's Q8_0 and Q4_0 blocks, and RQ3_0 and RQ4_0, 3- and
4-bit blocks of a Walsh-Hadamard-rotated row (docs/kv_cache.md has the layouts, bits per value and sizes).

A float type's cache is an array of its dtype. A block type's cache is a `KVBlocks`: one array per field of the
type's block struct (storage order as in ggml-common.h), each [..., blocks per row, count]: the layout of `QTensor`
(dflash_jax/quant.py), whose Q8_0 and Q4_0 field lists these types share. Rows [..., head_dim] are quantized when
written (`stored`) and dequantized when read (`readable`), inside jit; the Pallas tree-attention kernel decodes its
tiles with the same `block_values`, and for a rotated type rotates its queries (`rotate_query`) and its output back
(`unrotate`) instead of each key and value row.

Bit-exactness with llama.cpp's quantize_row_q8_0_ref / quantize_row_q4_0_ref (as compiled without FMA contraction,
which is what gguf-py's numpy quantizers compute): XLA contracts a multiply feeding an add into one FMA, and an
optimization barrier does not stop it inside a fusion, so no rounding decision here adds to a product. Each one
compares the product v = x * (1/d) with thresholds: Q8_0's roundf(v) as |v| >= floor(|v|) + 0.5, Q4_0's (int8_t)(v +
8.5f) against the least float32 v whose rounded v + 8.5 reaches each integer (`_Q4_0_STEPS`); and Q8_0's d = amax /
127 is divided as C divides (`_divide`). XLA also flushes float32 denormals to zero: a block whose scale is below
float32's normal range (amax < 1.5e-36 for Q8_0) gets codes 0, where llama.cpp writes codes that its float16 scale of
0 multiplies to the same zeros. Like llama.cpp, a scale past float16's range (|x| > 8.3e6 for Q8_0) is stored as an
infinity.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.errors import InputError
from dflash_jax.quant import FORMATS, Unsupported

BLOCK = 32  # values per block of every block type

# RQ3_0's codebook: level c of a block is LEVELS[c] * d, d = the block's largest |value| after the rotation. The inner
# levels are Lloyd-Max's for the entries of Gaussian blocks of 32 divided by their largest magnitude (which the top
# level hits exactly), rounded to 1/256: 8 significant bits, so that d (float16, 11 bits) * level is exact in float32
# and the inverse rotation's sums round alike whether or not XLA fuses them with the products.
LEVELS = np.array([-256, -157, -87, -28, 28, 87, 157, 256], np.float32) / 256
_MIDPOINTS = (LEVELS[1:] + LEVELS[:-1]) / 2  # a value at a midpoint takes the upper level

# RQ4_0's codebook: level c of a block is LEVELS4[c] * d, d = the block's largest |value| rounded up to an E5M3 scale
# (`_e5m3_up`). The levels are Lloyd-Max's for the entries of Gaussian blocks of 32 divided by that scale, rounded to
# 1/256 (8 significant bits; d has 4, so every product is exact in float32).
LEVELS4 = np.array([-237, -189, -151, -118, -89, -62, -37, -12, 12, 37, 62, 89, 118, 151, 189, 237], np.float32) / 256
_MIDPOINTS4 = (LEVELS4[1:] + LEVELS4[:-1]) / 2
E5M3_BIAS = 16  # an RQ4_0 scale byte e << 3 | j > 0 stands for (1 + j / 8) * 2^(e - 16), up to 1.875 * 2^15; 0 for 0


def _q4_0_steps() -> np.ndarray:
    """[15] float32: step k-1 is the least float32 v with fl(v + 8.5) >= k, so (int8_t)(v + 8.5f), for v in [-8, 8]
    (min 15), is the number of steps <= v."""
    steps = []
    for k in range(1, 16):
        v = np.float32(k - 8.5)  # exact, and v + 8.5 = k
        while np.float32(np.nextafter(v, np.float32(-np.inf)) + np.float32(8.5)) >= k:
            v = np.nextafter(v, np.float32(-np.inf))
        steps.append(v)
    return np.array(steps, np.float32)


_Q4_0_STEPS = _q4_0_steps()


@dataclasses.dataclass(frozen=True)
class KVType:
    """A KV cache type: a float dtype, or a block struct of 32 values (fields in storage order)."""

    name: str
    dtype: str | None = None  # float types: the cache's dtype
    fields: tuple[tuple[str, np.dtype, int], ...] = ()  # block types: (name, dtype, count) per block
    rotated: bool = False  # rows go through the fixed signed Walsh-Hadamard rotation before quantizing

    @property
    def blocked(self) -> bool:
        """Whether the type stores blocks (rather than an array of a float dtype)."""
        return self.dtype is None

    @property
    def block_bytes(self) -> int:
        """Bytes per block of 32 values (block types)."""
        return sum(np.dtype(t).itemsize * c for _, t, c in self.fields)

    @property
    def bits(self) -> float:
        """Bits per stored value, scales included."""
        return 8 * self.block_bytes / BLOCK if self.blocked else 8 * np.dtype(self.dtype).itemsize


TYPES: dict[str, KVType] = {t.name: t for t in (
    KVType("f32", dtype="float32"),
    KVType("bf16", dtype="bfloat16"),
    KVType("f16", dtype="float16"),
    KVType("q8_0", fields=FORMATS["Q8_0"].fields),
    KVType("q4_0", fields=FORMATS["Q4_0"].fields),
    KVType("rq3_0", fields=(("d", np.dtype(np.float16), 1), ("qs", np.dtype(np.uint8), 8),
                            ("qh", np.dtype(np.uint8), 4)), rotated=True),
    KVType("rq4_0", fields=(("d", np.dtype(np.uint8), 1), ("qs", np.dtype(np.uint8), 16)), rotated=True),
)}


def kv_type(name: str) -> KVType:
    """The KVType of a name, or an InputError listing the names."""
    if name not in TYPES:
        raise InputError(f"KV type {name!r} is not one of {', '.join(TYPES)}")
    return TYPES[name]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVBlocks:
    """Rows [..., head_dim] in a block type: field name -> [..., head_dim / 32, count] (e.g. Q8_0: d float16 [..., nb,
    1], qs int8 [..., nb, 32])."""

    data: dict[str, jax.Array]
    kind: str = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The rows' shape [..., head_dim]."""
        lead = self.data["d"].shape[:-1]
        return (*lead[:-1], lead[-1] * BLOCK)


# ---------------------------------------------------------------------------------------------------------------
# The rotation (RQ3_0, RQ4_0)

def _signs(n: int) -> jax.Array:
    """[n] float32 +-1: entry i is -1 where the popcount of ((i + 1) * 2654435761 mod 2^32) is odd. Computed, not a
    table, so that a kernel's tile dequantization captures no constant array."""
    h = (jnp.arange(n, dtype=jnp.uint32) + 1) * jnp.uint32(2654435761)
    return 1.0 - 2.0 * (jax.lax.population_count(h) & 1).astype(jnp.float32)


def _fwht(x: jax.Array) -> jax.Array:
    """H x over the last axis (n a power of two; H[i, j] = (-1)^popcount(i & j), unnormalised), by butterflies of
    half-width 1, 2, 4, ..., n/2: (a, b) -> (a + b, a - b) for a at i and b at i + h in each group of 2h."""
    n = x.shape[-1]
    h = 1
    while h < n:
        pairs = x.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = jnp.stack([a + b, a - b], axis=-2).reshape(*x.shape[:-1], n)
        h *= 2
    return x


def _rotation_shifts(n: int) -> tuple[float, float]:
    """The powers of two that scale the forward and inverse rotation: 2^-e and 2^-(log2 n - e), e = ceil(log2(n)/2),
    so a rotated row keeps about its magnitude and forward-then-inverse is the identity (in exact arithmetic), every
    scale exact."""
    log = n.bit_length() - 1
    e = -(-log // 2)
    return 2.0 ** -e, 2.0 ** -(log - e)


def _check_row(kind: str, n: int, rotated: bool) -> None:
    if n % BLOCK or (rotated and n & (n - 1)):
        need = "a power of two of at least 32" if rotated else f"a multiple of {BLOCK}"
        raise Unsupported(f"KV type {kind} needs a head_dim that is {need}; this model's is {n}")


# ---------------------------------------------------------------------------------------------------------------
# Quantizers: float rows [..., n] -> fields [..., n / 32, count]

def _divide(x: jax.Array, c: float) -> jax.Array:
    """x / c rounded once, as C divides: XLA turns a division by a constant into a product with its reciprocal, which
    rounds 4.5 % of quotients differently; a divisor that depends on x (it is 1 only for a NaN) keeps the division."""
    return x / jnp.where(jnp.isnan(x), 1.0, c)


def _inverse(d: jax.Array) -> jax.Array:
    """1/d, 0 where d is 0 (llama.cpp's `id = d ? 1.0f/d : 0.0f`)."""
    return jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))


def _q8_0(b: jax.Array) -> dict[str, jax.Array]:
    d = _divide(jnp.max(jnp.abs(b), axis=-1, keepdims=True), 127.0)
    v = b * _inverse(d)
    a = jnp.abs(v)
    whole = jnp.floor(a)
    q = jnp.sign(v) * (whole + (a >= whole + 0.5))  # roundf: half away from zero
    return {"d": d.astype(jnp.float16), "qs": q.astype(jnp.int8)}


def _nibbles_packed(q: jax.Array) -> jax.Array:
    """[..., 32] values 0..15 -> [..., 16] bytes: element j in the low nibble of byte j, j + 16 in the high one."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(jnp.uint8)


def _q4_0(b: jax.Array) -> dict[str, jax.Array]:
    at = jnp.argmax(jnp.abs(b), axis=-1, keepdims=True)  # the first of equal magnitudes, as the C loop's `<`
    d = jnp.take_along_axis(b, at, axis=-1) / -8
    v = b * _inverse(d)
    q = jnp.sum(v[..., None] >= _Q4_0_STEPS, axis=-1, dtype=jnp.uint8)  # min(15, (int8_t)(v + 8.5f))
    return {"d": d.astype(jnp.float16), "qs": _nibbles_packed(q)}


def _rq3_0(b: jax.Array) -> dict[str, jax.Array]:
    d = jnp.max(jnp.abs(b), axis=-1, keepdims=True).astype(jnp.float16)
    t = b * _inverse(d.astype(jnp.float32))
    c = jnp.sum(t[..., None] >= _MIDPOINTS, axis=-1, dtype=jnp.uint8)  # the nearest level, ties upward
    low, high = (c & 3).reshape(*c.shape[:-1], 4, 8), (c >> 2).reshape(*c.shape[:-1], 8, 4)
    qs = sum(low[..., s, :] << (2 * s) for s in range(4))  # element 8s + b: bits 2s, 2s+1 of byte b
    qh = sum(high[..., s, :] << s for s in range(8))  # element 4s + b: bit s of byte b
    return {"d": d, "qs": qs.astype(jnp.uint8), "qh": qh.astype(jnp.uint8)}


def _e5m3_up(m: jax.Array) -> jax.Array:
    """The scale byte (`E5M3_BIAS`) of the least E5M3 value >= m >= 0, from m's float32 bits: its top three mantissa
    bits, plus one when any lower bit is set; clamped to the range (a larger m keeps the largest scale and its values
    clip to the top level); byte 0, the scale 0, for m = 0."""
    bits = jax.lax.bitcast_convert_type(m.astype(jnp.float32), jnp.int32)
    e = (bits >> 23) - 127 + E5M3_BIAS
    j = ((bits >> 20) & 7) + ((bits & 0xFFFFF) != 0)
    e, j = jnp.where(j == 8, e + 1, e), jnp.where(j == 8, 0, j)
    e, j = jnp.where(e < 0, 0, e), jnp.where(e < 0, 0, j)
    e, j = jnp.where(e > 31, 31, e), jnp.where(e > 31, 7, j)
    return jnp.where(m > 0, jnp.maximum(e << 3 | j, 1), 0).astype(jnp.uint8)


def _e5m3(byte: jax.Array) -> jax.Array:
    """The float32 value of E5M3 scale bytes, built from its bits (exact on every device)."""
    b = byte.astype(jnp.int32)
    d = jax.lax.bitcast_convert_type(((b >> 3) + 127 - E5M3_BIAS) << 23 | (b & 7) << 20, jnp.float32)
    return jnp.where(b == 0, 0.0, d)


def _rq4_0(b: jax.Array) -> dict[str, jax.Array]:
    code = _e5m3_up(jnp.max(jnp.abs(b), axis=-1, keepdims=True))
    t = b * _inverse(_e5m3(code))  # a product, not a sum: no FMA can change which side of a midpoint it falls
    c = jnp.sum(t[..., None] >= _MIDPOINTS4, axis=-1, dtype=jnp.uint8)  # the nearest level, ties upward
    return {"d": code, "qs": _nibbles_packed(c)}


_QUANTIZE = {"q8_0": _q8_0, "q4_0": _q4_0, "rq3_0": _rq3_0, "rq4_0": _rq4_0}


def quantize(rows: jax.Array, kind: str) -> KVBlocks:
    """Rows [..., n] (any float dtype) as blocks of a block type."""
    t = kv_type(kind)
    n = rows.shape[-1]
    _check_row(kind, n, t.rotated)
    x = rows.astype(jnp.float32)
    if t.rotated:
        forward, _ = _rotation_shifts(n)
        x = _fwht(x * _signs(n)) * forward
    return KVBlocks(data=_QUANTIZE[kind](x.reshape(*x.shape[:-1], n // BLOCK, BLOCK)), kind=kind)


# ---------------------------------------------------------------------------------------------------------------
# Dequantizers: fields -> float32 rows

def _level(c: jax.Array, levels: np.ndarray) -> jax.Array:
    """levels[c] of a codebook symmetric about zero (levels[n - 1 - i] = -levels[i]), by selects of scalars (no
    table: see _signs)."""
    half = len(levels) // 2
    c = c.astype(jnp.int32)
    up = c >= half
    m = jnp.where(up, c - half, half - 1 - c)  # 0 .. half - 1 from the middle out
    mag = jnp.full(c.shape, float(levels[-1]), jnp.float32)
    for k in range(half - 2, -1, -1):
        mag = jnp.where(m == k, float(levels[half + k]), mag)
    return jnp.where(up, mag, -mag)


def _codes(x: jax.Array, bits: int) -> jax.Array:
    """[..., c] bytes -> [..., 8 / bits * c] codes of `bits` bits in element order: element s * c + b is bits
    bits * s .. bits * (s + 1) - 1 of byte b. Shifts by a vector of offsets, a mask and a reshape: ops that the Pallas
    Triton lowering has (no concatenate or gather), so the tree-attention kernel decodes its tiles with this too."""
    parts = 8 // bits
    shift = jax.lax.broadcasted_iota(jnp.int32, (parts, 1), 0) * bits
    codes = (x.astype(jnp.int32)[..., None, :] >> shift) & ((1 << bits) - 1)  # [..., parts, c]
    return codes.reshape(*x.shape[:-1], parts * x.shape[-1])


def block_values(kind: str, data: dict[str, jax.Array]) -> jax.Array:
    """The float32 values [..., nb, 32] of a block type's fields, each [..., nb, count], in the rotated domain for a
    rotated type (every value d * code, exact in float32). Also the tree-attention kernel's decode of a tile."""
    if kind == "rq4_0":
        return _e5m3(data["d"]) * _level(_codes(data["qs"], 4), LEVELS4)
    d = data["d"].astype(jnp.float32)
    if kind == "q8_0":
        return d * data["qs"].astype(jnp.float32)
    if kind == "q4_0":
        return d * (_codes(data["qs"], 4) - 8).astype(jnp.float32)
    return d * _level(_codes(data["qs"], 2) | (_codes(data["qh"], 1) << 2), LEVELS)


def rotate_query(q: jax.Array) -> jax.Array:
    """q' [..., n] with q' . y = q . x for every row x that rotated-domain values y dequantize to (x = s * H y *
    2^-(log2 n - e), H symmetric): a product with a rotated type's keys then needs no inverse rotation of the keys."""
    n = q.shape[-1]
    _, inverse = _rotation_shifts(n)
    return _fwht(q * _signs(n)) * inverse


def unrotate(y: jax.Array) -> jax.Array:
    """Rows [..., n] back from the rotated domain: s * (H y) * 2^-(log2 n - e)."""
    n = y.shape[-1]
    _, inverse = _rotation_shifts(n)
    return _fwht(y) * inverse * _signs(n)


def dequantize(blocks: KVBlocks) -> jax.Array:
    """The float32 rows [..., n] that blocks hold (rotated back for a rotated type)."""
    values = block_values(blocks.kind, blocks.data)
    y = values.reshape(*values.shape[:-2], blocks.shape[-1])
    return unrotate(y) if TYPES[blocks.kind].rotated else y


# ---------------------------------------------------------------------------------------------------------------
# Caches

def empty(kind: str, shape: tuple[int, ...]) -> jax.Array | KVBlocks:
    """A zeroed cache of rows `shape` [..., head_dim] in a KV type."""
    t = kv_type(kind)
    if not t.blocked:
        return jnp.zeros(shape, t.dtype)
    _check_row(kind, shape[-1], t.rotated)
    nb = shape[-1] // BLOCK
    return KVBlocks(data={name: jnp.zeros((*shape[:-1], nb, count), dtype) for name, dtype, count in t.fields},
                    kind=kind)


def stored(rows: jax.Array | KVBlocks, cache: jax.Array | KVBlocks) -> jax.Array | KVBlocks:
    """Rows as `cache` holds them: float rows cast to a float cache's dtype or quantized to a block cache's type;
    rows already in the cache's form (e.g. taken from it) as they are."""
    if isinstance(cache, KVBlocks):
        return rows if isinstance(rows, KVBlocks) else quantize(rows, cache.kind)
    return rows.astype(cache.dtype)


def readable(cache: jax.Array | KVBlocks, layer: int | jax.Array | None = None) -> jax.Array:
    """Rows as attention reads them (one layer of a stacked cache with `layer`): a float cache as it is, a block cache
    dequantized to float32."""
    if layer is not None:
        cache = jax.tree.map(lambda x: x[layer], cache)
    return dequantize(cache) if isinstance(cache, KVBlocks) else cache


def block_bytes(blocks: KVBlocks) -> np.ndarray:
    """The blocks as bytes [..., n / 32, block_bytes]: each block's fields in storage order, little-endian, as
    llama.cpp lays out a block_q8_0 / block_q4_0 (and as docs/kv_cache.md lays out RQ3_0's and RQ4_0's)."""
    t = TYPES[blocks.kind]
    parts = [np.ascontiguousarray(np.asarray(blocks.data[name]).astype(dtype)).view(np.uint8)
             for name, dtype, _ in t.fields]
    return np.concatenate(parts, axis=-1)

