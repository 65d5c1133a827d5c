"""The packed layout the Triton qmatmul kernels stream (`PackedWeight`), and the helpers all qmatmul kernels share.

A weight [N, K] is repacked once at load (qmatmul.pack) within 3% of its GGUF bytes: the quant bytes keep GGUF
order, reshaped to [N, super-blocks, ...] so that a tile of rows x super-blocks is one load; Q4_K/Q5_K's 6-bit
scales and mins are unpacked into bytes (148 bytes per 256 weights instead of 144 for Q4_K, 180 instead of 176 for
Q5_K); Q6_K and Q8_0 keep their size.

A super-block splits into column planes that unpack alike: Q4_K/Q5_K the low and the high nibbles of each byte,
Q6_K its four 2-bit groups (`plane_columns` gives the weight column behind each plane column). `plane_tile`
dequantizes one plane's tile from a `get(name, *index)` that reads a field's tile: the kernels read from refs
(`tile_reader`), the references from whole arrays (`whole_rows`), so both run the same arithmetic.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.ggml import QK_K

QUANTIZED_FORMATS = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")
PTX_FORMATS = ("Q4_K", "Q6_K")  # the formats whose tiles the kernels dequantize by inline PTX (f16x2 and f32 tiles)
M_MAX = 64
UNIT_SHAPE = {"Q4_K": (4, 32), "Q5_K": (4, 32), "Q6_K": (2, 2, 16), "Q8_0": (32,)}  # a plane tile is [rows,
# units, *UNIT_SHAPE[fmt]]
N_PLANES = {"Q4_K": 2, "Q5_K": 2, "Q6_K": 4, "Q8_0": 1}  # rows of plane_columns
# float16 keeps 3 more significand bits than bf16 but not its range: products in float16 take x times 2**-F16_SHIFT
# and the weights times 2**F16_SHIFT (exact both), so x may reach 65504 * 2**8 and the weights 2**7 (`f16_fits`)
F16_SHIFT = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A weight [N, K] in the kernels' layout (module docstring); format and shape static."""

    data: dict[str, jax.Array]  # every array is [N, units, ...]: one row of W per leading index
    fmt: str = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    # whether float16 holds the weights, scales and mins times 2**F16_SHIFT (f16x2 tiles; `f16_fits`, at pack)
    f16_ok: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # the same weight in a Mosaic GPU kernel's layout (qmatmul_mgpu.MgpuQ4K, qmatmul_mgpu_q6k.MgpuQ6K), where pack
    # made one (its `mgpu`): products of 2-64 rows then take that kernel on a GPU
    mgpu: object = None

    @property
    def nbytes(self) -> int:
        own = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in self.data.values())
        return own + (0 if self.mgpu is None else self.mgpu.nbytes)

    @property
    def mgpu_only(self) -> bool:
        """Whether the weight is in the Mosaic GPU kernel's layout alone (pack's mgpu="only")."""
        return self.mgpu is not None and not self.data


def unit(fmt: str) -> int:
    """Columns per unit of the K loop: a super-block (Q8_0: a block)."""
    return 32 if fmt == "Q8_0" else QK_K


def plane_columns(fmt: str, k: int) -> np.ndarray:
    """[planes, K / planes]: the column of W behind each column of each plane's flattened tile."""
    sb = np.arange(k // unit(fmt))[:, None, None, None]
    if fmt in ("Q4_K", "Q5_K"):  # plane nib, tile (unit, p, l): column 64p + 32nib + l
        cols = [256 * sb + 64 * np.arange(4)[:, None] + 32 * nib + np.arange(32) for nib in range(2)]
    elif fmt == "Q6_K":  # plane c, tile (unit, h, half, l): column 128h + 32c + 16half + l
        cols = [256 * sb[..., None] + 128 * np.arange(2)[:, None, None] + 32 * c + 16 * np.arange(2)[:, None]
                + np.arange(16) for c in range(4)]
    else:
        cols = [np.arange(k)]
    return np.stack([c.reshape(-1) for c in cols])


def plane_quants(fmt: str, plane: int, get) -> jax.Array:
    """The unsigned quants (int32) of a Q4_K/Q5_K/Q6_K plane tile: [rows, units, p, 32], Q6_K [rows, units, h,
    half, 16]."""
    i32 = lambda a: a.astype(jnp.int32)  # noqa: E731
    if fmt == "Q6_K":
        low = (i32(get("ql", slice(None), plane % 2)) >> (4 * (plane // 2))) & 0xF
        return low | (((i32(get("qh")) >> (2 * plane)) & 3) << 4)
    q = (i32(get("qs")) >> (4 * plane)) & 0xF
    if fmt == "Q5_K":
        shift = 2 * jax.lax.broadcasted_iota(jnp.int32, (1, 1, 4, 1), 2) + plane
        q = q | (((i32(get("qh"))[:, :, None, :] >> shift) & 1) << 4)
    return q


def plane_tile(fmt: str, plane: int, get) -> jax.Array:
    """Dequantized float32 tile [rows, units, ...] of one plane; `get(name, *index)` reads a field's tile.

    `get` returns the field for the tile's rows and units with the given trailing indices applied; the kernel
    reads from refs, the reference from whole arrays, so both run this same arithmetic.
    """
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    if fmt == "Q8_0":
        return f32(get("qs")) * f32(get("d"))[..., None]
    q = plane_quants(fmt, plane, get)
    if fmt == "Q6_K":
        scale = f32(get("d"))[..., None, None] * f32(get("sc", plane))  # [rows, units, h, half]
        return f32(q - 32) * scale[..., None]
    nib = plane  # Q4_K, Q5_K
    scale = f32(get("d"))[..., None] * f32(get("sc", nib))  # [rows, units, p]
    offset = f32(get("dmin"))[..., None] * f32(get("mn", nib))
    return f32(q) * scale[..., None] - offset[..., None]


def plane_scales(fmt: str, plane: int, get) -> tuple[jax.Array, jax.Array | None]:
    """(scale, neg_min) in float32 of each sub-block of a Q4_K/Q6_K plane tile, [rows, units, p] (Q6_K [rows, units,
    h, half], no neg_min: its weights are (q - 32) * scale): a weight is q * scale + neg_min."""
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    if fmt == "Q6_K":
        return f32(get("d"))[..., None, None] * f32(get("sc", plane)), None
    return f32(get("d"))[..., None] * f32(get("sc", plane)), -f32(get("dmin"))[..., None] * f32(get("mn", plane))


def whole_rows(data: dict[str, jax.Array]):
    """`get(name, *index)` (as `plane_tile` reads fields) over every row and unit of a PackedWeight's arrays."""
    return lambda name, *idx: data[name][(slice(None), slice(None), *idx)]


def dequantize_packed(pw: PackedWeight, tile=plane_tile) -> jax.Array:
    """The float32 [N, K] matrix of a PackedWeight in the Triton layout, each plane's tile made by `tile(fmt, plane,
    get)`: by default `plane_tile`, the GGUF's values exactly (equal to quant.dequantize of the tensor)."""
    n, k = pw.shape
    get = whole_rows(pw.data)
    out = jnp.zeros((n, k), jnp.float32)
    for plane, cols in enumerate(plane_columns(pw.fmt, k)):
        out = out.at[:, cols].set(tile(pw.fmt, plane, get).astype(jnp.float32).reshape(n, -1))
    return out


def f16_within(q_max: int, *terms: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Whether (a bool array) every q * scale and neg_min of quants 0..q_max, for each (scale, neg_min) given, stays
    under 2**15 once scaled by 2**F16_SHIFT (float16 holds 65504): what f16x2 tiles and the Mosaic GPU kernels
    need."""
    bound = jnp.max(jnp.stack([(q_max * jnp.abs(scale) + jnp.abs(neg_min)).max() for scale, neg_min in terms]))
    return bound * 2.0 ** F16_SHIFT < 2 ** 15


def f16_fits(fmt: str, data: dict[str, jax.Array]) -> bool:
    """Whether a Q4_K/Q6_K weight (its packed fields `data`) dequantizes in float16 after scaling by 2**F16_SHIFT
    (`f16_within`); False for other formats and for traced arrays."""
    if fmt not in PTX_FORMATS or any(isinstance(a, jax.core.Tracer) for a in data.values()):
        return False
    return bool(_f16_fits(fmt, dict(data)))


@functools.partial(jax.jit, static_argnums=0)
def _f16_fits(fmt: str, data: dict[str, jax.Array]) -> jax.Array:
    # one program per format and shape: op by op, a load compiles each op per shape and device
    terms = []
    for plane in range(N_PLANES[fmt]):
        scale, neg_min = plane_scales(fmt, plane, whole_rows(data))
        terms.append((scale, 32 * scale if neg_min is None else neg_min))  # Q6_K: (q - 32) * scale
    return f16_within(63 if fmt == "Q6_K" else 15, *terms)


def x_operand(x: jax.Array, tile_math: str) -> jax.Array:
    """x as a tensor-core product multiplies it: float16 scaled by 2**-F16_SHIFT (`tile_math` "f16x2"), else bf16."""
    if tile_math == "f16x2":
        return (x.astype(jnp.float32) / 2.0 ** F16_SHIFT).astype(jnp.float16)
    return x.astype(jnp.bfloat16)


def tile_reader(w: dict, r0, row_ok: jax.Array, block_n: int, start, step: int, valid=None):
    """`get(name, *index)` for `plane_tile`: a field's tile of `block_n` rows from r0 and `step` units from `start`,
    the trailing indices applied; rows past N read zeros, and so does every row when `valid` (a scalar) is False."""
    ok = row_ok if valid is None else row_ok & valid

    def get(name, *idx):
        ref = w[name]
        ndim = ref.ndim - sum(isinstance(j, int) for j in idx)
        idx = tuple(jnp.int32(j) if isinstance(j, int) else j for j in idx)
        return plt.load(ref.at[(pl.ds(r0, block_n), pl.ds(start, step), *idx)],
                        mask=ok.reshape((block_n,) + (1,) * (ndim - 1)), other=0, eviction_policy="evict_first")

    return get


def prefetch_loop(load, compute, steps: int, acc, prefetch: int):
    """acc after `compute(load(i, valid), acc)` over K steps i = 0..steps-1, where `load(i, valid)` reads step i
    (every tile masked to zeros when the scalar `valid` is False; None: no mask). With prefetch = 0 each step loads
    as it computes. With prefetch = d > 0 the loop carries d steps' loads and issues step i + d's before computing
    step i, so that d steps' loads are in flight while one computes; loads past the last step are masked off."""
    if not prefetch:
        return jax.lax.fori_loop(0, steps, lambda i, acc: compute(load(i, None), acc), acc)

    def body(i, carry):
        acc, ahead = carry
        nxt = load(jnp.minimum(i + prefetch, steps - 1), i + prefetch < steps)
        return compute(ahead[0], acc), ahead[1:] + (nxt,)

    ahead = tuple(load(min(j, steps - 1), j < steps) for j in range(prefetch))
    return jax.lax.fori_loop(0, steps, body, (acc, ahead))[0]


def units_per_step(fmt: str, k: int, columns: int = 512) -> int:
    """Units per K-loop step: the largest power of two dividing the row's units with at most `columns` columns."""
    units = k // unit(fmt)
    s = 1
    while units % (2 * s) == 0 and 2 * s * unit(fmt) <= columns:
        s *= 2
    if s * unit(fmt) < 16:
        raise ValueError(f"{fmt} rows of {k} columns do not split into steps of 16 or more columns")
    return s


def default_splits(n: int, steps: int, block_n: int, target: int = 1024) -> int:
    """Programs along K: the largest power of two, at most 8, that keeps row tiles x splits within `target` (about
    eight programs per multiprocessor of an H100) and divides the K steps evenly. On the 27B's 5120-row matrices
    that is 2-4 splits, 1.3-1.8x faster than one (scripts/results/qmatmul_splits_h100.txt). The GEMVs' narrow row
    tiles take a target of 2048: two splits on those matrices, none on the wider ones."""
    tiles, s = -(-n // block_n), 1
    while 2 * s <= 8 and tiles * 2 * s <= target and steps % (2 * s) == 0:
        s *= 2
    return s


def k_steps(fmt: str, n: int, k: int, block_n: int, columns: int, splits: int | None, target: int) -> tuple:
    """(units per K step, K steps per program, splits): `splits` (default: `default_splits` at `target`) must
    divide the K steps."""
    step = units_per_step(fmt, k, columns)
    total = k // unit(fmt) // step
    splits = splits or default_splits(n, total, block_n, target=target)
    if total % splits:
        raise ValueError(f"{total} K steps do not split {splits} ways")
    return step, total // splits, splits


def sum_splits(out: jax.Array, m: int, n: int) -> jax.Array:
    """A kernel's output [splits, rows of x, row tiles x rows] as [m, n]: the K splits' partial products added, split
    0 first, as elementwise adds. A reduce would let XLA order the sum by the shape of the fusion it lands in (on an
    H200 one launch of two weights gave other bits than their own launches at 23 tokens), so a product's bits would
    depend on its neighbours and on how many rows it has."""
    total = out[0]
    for part in range(1, out.shape[0]):
        total = total + out[part]
    return total[:m, :n]
