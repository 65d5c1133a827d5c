"""Fused dequantize + matmul for GGUF weights: x [M, K] (bf16) @ W[N, K]^T -> [M, N] float32, M = 1..64.

The weight is repacked once at load (`pack`) into a `PackedWeight` within 3% of its GGUF bytes: the quant bytes
keep GGUF order, reshaped to [N, super-blocks, ...] so that a tile of rows x super-blocks is one load; Q4_K/Q5_K's
6-bit scales and mins are unpacked into bytes (148 bytes per 256 weights instead of 144 for Q4_K, 180 instead of 176
for Q5_K); Q6_K, Q8_0 and bf16 keep their size.

A super-block splits into column planes that unpack alike: Q4_K/Q5_K the low and the high nibbles of each byte,
Q6_K its four 2-bit groups (`plane_columns` gives the weight column behind each plane column). Each program owns
`block_n` rows of W and walks K a few super-blocks per step: per plane it dequantizes the tile in registers
(`plane_tile`, the same function the reference runs), rounds it to bf16 and multiplies it on the tensor cores with
the activations, which the wrapper permutes into each plane's column order once per call. Dense weights take a
plain 2-D bf16 tile. A matrix with few row tiles (the 5120-row ones) splits K over several programs (`splits`), so
that every multiprocessor streams, and XLA adds their partial products.

On a GPU, Q4_K and Q6_K tiles are dequantized by inline PTX (`plane_tile_asm`): prmt builds each quant's float32
(128 + q) from its byte without a conversion instruction, one fma applies scale and offset, and cvt.rn.bf16x2 packs
two weights, about 3 instructions per weight instead of 5. The values are plane_tile's up to float32 rounding. On
an H100 that makes the 32-row products 1.15-1.3x faster (16 rows: 1.0-1.3x) and the 27B's DDTree-22 step 38.5 ->
32.8 ms (scripts/results/qmatmul_rows_probe_h100.txt, bench_27b_h100_dequant.txt); `asm=False` turns it off.
By default (`TILE_MATH`) they are dequantized two weights an instruction in packed float16 instead and multiplied
with x in float16 (`plane_tile_pairs`, f16x2; x scaled by 2**-8 and the weights by 2**8 to keep x's range): 1.02-1.15x
faster for Q4_K and 3x closer to the float32 product.

One token (M = 1, the AR decode step) takes a GEMV instead (`gemv`): no tensor cores, so no bf16 rounding of the
tile and no shuffle into the product's operand layout; each program owns 8 rows, multiplies each plane's float32
tile by the activations in the tile's own shape and accumulates it, and sums the rows once at the end. On an H100
that is 1.0-1.7x faster per matrix than the tensor-core kernel at M = 1 (scripts/results/qmatmul_h100_gemv.json)
and takes the 27B's AR step from 23.5 to 16.0 ms (scripts/results/ar_one_token_h100.txt).

The GEMV also dequantizes Q4_K/Q6_K tiles by the inline PTX, in float32 (5.75 and 6.34 SASS instructions per
weight instead of 7.25 and 11.6, scripts/results/qmatmul_sass_cpu.txt), and loads one K step ahead of the one it
computes (`prefetch`, `_k_loop`): 13.2 against 15.6 ms for the AR step on an H100 (`ASM`, `PREFETCH`;
scripts/results/ar_gemv_h100.txt). By default (`INT8_X`) one token of a Q4_K/Q6_K weight takes the
int8-activation GEMV instead (gemv_int8.py), x quantized inside it: 11.9 against 12.7 ms for the AR step
(scripts/results/ar_int8_in_kernel_h100.txt); `int8_x=0` keeps the float GEMV. `int8_mma` takes int8 tensor-core
products for two or more tokens of a Q4_K weight (mma_int8.py): fewer instructions, no faster, so off (`INT8_MMA`).

Pallas Triton backend; `interpret=True` runs it on CPU for the tests.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dflash_jax.quant import FORMATS, QK_K, QTensor, k_scale_min
from pallas_kernels.tiles import dot_tile

QUANTIZED_FORMATS = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")
PACKED_FORMATS = QUANTIZED_FORMATS + ("BF16",)  # dense F32/F16/BF16 weights all pack to BF16
M_MAX = 64
UNIT_SHAPE = {"Q4_K": (4, 32), "Q5_K": (4, 32), "Q6_K": (2, 2, 16), "Q8_0": (32,), "BF16": ()}  # a plane tile
# is [rows, units, *UNIT_SHAPE[fmt]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A weight [N, K] in the kernel's layout (see the module docstring); format and shape static."""

    data: dict[str, jax.Array]  # every array is [N, units, ...]: one row of W per leading index
    fmt: str = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    # whether float16 holds the weights, scales and mins times 2**F16_SHIFT (`f16x2` tiles; `pack` checks)
    f16_ok: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # the same weight in a Mosaic GPU kernel's layout (qmatmul_mgpu.MgpuQ4K, qmatmul_mgpu_q6k.MgpuQ6K), where `pack`
    # made one (`MGPU_LAYOUT`, `MGPU_FORMATS`); products of 2-64 rows then take that kernel on a GPU (`MGPU`)
    mgpu: object = None

    @property
    def nbytes(self) -> int:
        own = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in self.data.values())
        return own + (0 if self.mgpu is None else self.mgpu.nbytes)

    @property
    def mgpu_only(self) -> bool:
        """Whether the weight is in the Mosaic GPU kernel's layout alone (`MGPU_LAYOUT` "only")."""
        return self.mgpu is not None and not self.data


def unit(fmt: str, k: int) -> int:
    """Columns per unit of the K loop: a super-block (Q8_0: a block; dense: a column)."""
    return {"Q8_0": 32, "BF16": 1}.get(fmt, QK_K)


def pack(qt: QTensor) -> PackedWeight:
    """Repack a GGUF-layout QTensor into the kernel layout (once, at load; runs wherever its arrays live)."""
    n, k = qt.shape
    f = {name: jnp.asarray(a) for name, a in qt.data.items()}
    if FORMATS[qt.fmt].dense:
        if k % 16:
            raise ValueError(f"dense weight rows of {k} are not a multiple of 16")
        return PackedWeight({"w": f["w"].astype(jnp.bfloat16)}, "BF16", (n, k))
    if qt.fmt not in PACKED_FORMATS:
        raise NotImplementedError(f"the qmatmul kernel does not take {qt.fmt} weights (it takes "
                                  f"{', '.join(PACKED_FORMATS)}, F16, F32)")
    mgpu = mgpu_layout(qt)
    if mgpu is not None and MGPU_LAYOUT == "only":
        return PackedWeight({}, qt.fmt, (n, k), mgpu=mgpu)
    nb = k // unit(qt.fmt, k)
    if qt.fmt == "Q8_0":
        data = {"qs": f["qs"].reshape(n, nb, 32), "d": f["d"].reshape(n, nb)}
    elif qt.fmt == "Q6_K":
        # ql byte 64h + 32cc + 16half + l; qh byte 32h + 16half + l; scale 8h + 2c + half -> [c, h, half]
        data = {"ql": f["ql"].reshape(n, nb, 2, 2, 2, 16), "qh": f["qh"].reshape(n, nb, 2, 2, 16),
                "sc": f["scales"].reshape(n, nb, 2, 4, 2).transpose(0, 1, 3, 2, 4), "d": f["d"].reshape(n, nb)}
    else:  # Q4_K, Q5_K: scale of sub-block 2p + nib -> [nib, p]
        sc, mn = k_scale_min(f["scales"])
        split = lambda a: a.reshape(n, nb, 4, 2).transpose(0, 1, 3, 2)  # noqa: E731
        data = {"qs": f["qs"].reshape(n, nb, 4, 32), "sc": split(sc), "mn": split(mn),
                "d": f["d"].reshape(n, nb), "dmin": f["dmin"].reshape(n, nb)}
        if qt.fmt == "Q5_K":
            data["qh"] = f["qh"].reshape(n, nb, 32)
    return PackedWeight(data, qt.fmt, (n, k), f16_ok=f16_fits(qt.fmt, data), mgpu=mgpu)


def mgpu_module(fmt: str):
    """The Mosaic GPU kernel module for weights of `fmt` (Q4_K: qmatmul_mgpu, Q6_K: qmatmul_mgpu_q6k)."""
    # imported here: both build on this module
    if fmt == "Q4_K":
        from pallas_kernels import qmatmul_mgpu
        return qmatmul_mgpu
    if fmt == "Q6_K":
        from pallas_kernels import qmatmul_mgpu_q6k
        return qmatmul_mgpu_q6k
    raise NotImplementedError(f"no Mosaic GPU kernel is written for {fmt} weights (Q4_K and Q6_K only)")


def mgpu_layout(qt: QTensor):
    """A Mosaic GPU kernel's layout of a weight whose format is in `MGPU_FORMATS` when `MGPU_LAYOUT` asks for it and
    the kernel takes the weight (rows a multiple of 64, float16 holds it; concrete arrays), else None."""
    if MGPU_LAYOUT not in MGPU_LAYOUTS:
        raise ValueError(f"MGPU_LAYOUT is one of {MGPU_LAYOUTS}, got {MGPU_LAYOUT!r}")
    if not set(MGPU_FORMATS) <= {"Q4_K", "Q6_K"}:
        raise ValueError(f"MGPU_FORMATS holds Q4_K and Q6_K at most, got {MGPU_FORMATS!r}")
    if (not MGPU_LAYOUT or qt.fmt not in MGPU_FORMATS
            or any(isinstance(a, jax.core.Tracer) for a in qt.data.values())):
        return None
    try:
        return mgpu_module(qt.fmt).pack(qt)
    except ValueError:  # rows not a multiple of 64, or a weight float16 cannot hold: the Triton kernels take it
        return None


def f16_fits(fmt: str, data: dict[str, jax.Array]) -> bool:
    """Whether a Q4_K/Q6_K weight dequantizes in float16 after scaling by 2**F16_SHIFT (`f16x2`, `f16_holds`);
    False for other formats and for traced arrays."""
    if fmt not in PTX_FORMATS or any(isinstance(a, jax.core.Tracer) for a in data.values()):
        return False
    terms = []
    for plane in range(N_PLANES[fmt]):
        scale, neg_min = _ptx_scales(fmt, plane, whole_rows(data))
        terms.append((scale, 32 * scale if neg_min is None else neg_min))  # Q6_K: (q - 32) * scale
    return f16_holds(63 if fmt == "Q6_K" else 15, *terms)


def f16_holds(q_max: int, *terms: tuple[jax.Array, jax.Array]) -> bool:
    """Whether every q * scale and neg_min of quants 0..q_max, for each (scale, neg_min) given, stays under 2**15
    once scaled by 2**F16_SHIFT (float16 holds 65504): what f16x2 tiles and the Mosaic GPU kernel need."""
    bound = jnp.max(jnp.stack([(q_max * jnp.abs(scale) + jnp.abs(neg_min)).max() for scale, neg_min in terms]))
    return bool(bound * weight_gain("f16x2") < 2 ** 15)


def whole_rows(data: dict[str, jax.Array]):
    """`get(name, *index)` (as `plane_tile` reads fields) over every row and unit of a PackedWeight's arrays."""
    return lambda name, *idx: data[name][(slice(None), slice(None), *idx)]


def plane_columns(fmt: str, k: int) -> np.ndarray:
    """[planes, K / planes]: the column of W behind each column of each plane's flattened tile."""
    sb = np.arange(k // unit(fmt, k))[:, None, None, None]
    if fmt in ("Q4_K", "Q5_K"):  # plane nib, tile (unit, p, l): column 64p + 32nib + l
        cols = [256 * sb + 64 * np.arange(4)[:, None] + 32 * nib + np.arange(32) for nib in range(2)]
    elif fmt == "Q6_K":  # plane c, tile (unit, h, half, l): column 128h + 32c + 16half + l
        cols = [256 * sb[..., None] + 128 * np.arange(2)[:, None, None] + 32 * c + 16 * np.arange(2)[:, None]
                + np.arange(16) for c in range(4)]
    else:
        cols = [np.arange(k)]
    return np.stack([c.reshape(-1) for c in cols])


N_PLANES = {"Q4_K": 2, "Q5_K": 2, "Q6_K": 4, "Q8_0": 1, "BF16": 1}  # rows of plane_columns
PLANE_RUN = 32  # plane_columns' runs of consecutive columns in the multi-plane formats


def plane_view(fmt: str, x: jax.Array) -> jax.Array:
    """x [M, K] as the tensor-core kernel reads it with `x_view`: for Q4_K/Q5_K/Q6_K, [M, K / (planes x 32), planes,
    32], where [:, :, p] flattened is x at plane p's columns (`plane_columns`) in order; else x. A reshape: no copy
    and no launch, where gathering x by plane_columns is a launch a product."""
    planes = N_PLANES[fmt]
    return x if planes == 1 else x.reshape(x.shape[0], -1, planes, PLANE_RUN)


def plane_tile(fmt: str, plane: int, get) -> jax.Array:
    """Dequantized float32 tile [rows, units, ...] of one plane; `get(name, *index)` reads a field's tile.

    `get` returns the field for the tile's rows and units with the given trailing indices applied; the kernel
    reads from refs, the reference from whole arrays, so both run this same arithmetic.
    """
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    if fmt == "BF16":
        return f32(get("w"))
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


# PTX that dequantizes the 4 quant bytes of one 32-bit register into 4 weights of one plane. prmt places each 4-6 bit
# quant q in the third byte of a word whose top byte is 0x43: the float32 128 + q, exactly, with no conversion
# instruction; one float32 fma with the bias folded into the offset, (128 + q) * scale + (offset - 128 * scale).
# Outputs: 4 float32 ($0-$3), or cvt.rn.bf16x2 packs them into 2 bf16 pairs ($0-$1); inputs: the quant register(s),
# then 4 scales and 4 offsets (float32).
_PTX_HEAD = """{{
.reg .b32 m, k, t, h;
.reg .f32 w<4>, s<4>, o<4>;
mov.b32 k, 0x43000000;
shr.u32 m, ${q}, {low_shift};
and.b32 m, m, 0x0F0F0F0F;
"""
_PTX_Q6K_HIGH = """shr.u32 h, ${qh}, {high_shift};
and.b32 h, h, 0x03030303;
shl.b32 h, h, 4;
or.b32 m, m, h;
"""
_PTX_DEQUANT = "".join(f"""prmt.b32 t, m, k, 0x7{i}44;
mov.b32 w{i}, t;
mov.b32 s{i}, ${{s{i}}};
mov.b32 o{i}, ${{o{i}}};
fma.rn.f32 w{i}, w{i}, s{i}, o{i};
""" for i in range(4))
_PTX_OUT = {jnp.bfloat16: """cvt.rn.bf16x2.f32 $0, w1, w0;
cvt.rn.bf16x2.f32 $1, w3, w2;
}}""", jnp.float32: "".join(f"mov.b32 ${i}, w{i};\n" for i in range(4)) + "}}"}
PTX_FORMATS = ("Q4_K", "Q6_K")


def _ptx_quants(fmt: str, plane: int, get) -> tuple[list, dict, str]:
    """The inline PTX's quant tiles of a Q4_K/Q6_K plane ([rows, units, p, 32]; Q6_K's low and high bits, [rows,
    units, h, half, 16]), the shifts that take the plane's bits out of them, and Q6_K's code for the high bits."""
    if fmt == "Q4_K":
        return [get("qs")], dict(low_shift=4 * plane), ""
    if fmt == "Q6_K":
        return ([get("ql", slice(None), plane % 2), get("qh")], dict(low_shift=4 * (plane // 2), high_shift=2 * plane),
                _PTX_Q6K_HIGH)
    raise ValueError(f"no inline PTX dequantization for {fmt}")


def _ptx_scales(fmt: str, plane: int, get) -> tuple[jax.Array, jax.Array | None]:
    """(scale, neg_min) in float32 of each sub-block of a Q4_K/Q6_K plane tile, [rows, units, p] (Q6_K [rows, units,
    h, half], no neg_min: its weights are (q - 32) * scale), for the inline PTX: a weight is q * scale + neg_min."""
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    if fmt == "Q6_K":
        return f32(get("d"))[..., None, None] * f32(get("sc", plane)), None
    return f32(get("d"))[..., None] * f32(get("sc", plane)), -f32(get("dmin"))[..., None] * f32(get("mn", plane))


def plane_tile_asm(fmt: str, plane: int, get, dtype=jnp.bfloat16) -> jax.Array:
    """A Q4_K/Q6_K plane tile dequantized by inline PTX (GPU only; about 3 instructions per weight instead of 5),
    in bf16 or float32 (`dtype`); the values are `plane_tile`'s up to float32 rounding."""
    quants, shifts, high = _ptx_quants(fmt, plane, get)
    scale, neg_min = _ptx_scales(fmt, plane, get)
    # q * scale + neg_min = (128 + q) * scale + offset; Q6_K: q - 32 = (128 + q) - 160
    offset = -160 * scale if neg_min is None else neg_min - 128 * scale
    shape, outputs = quants[0].shape, 4 if dtype == jnp.float32 else 2
    regs = {f"{name}{i}": outputs + len(quants) + 4 * j + i for j, name in enumerate("so") for i in range(4)}
    code = (_PTX_HEAD + high + _PTX_DEQUANT + _PTX_OUT[dtype]).format(q=outputs, qh=outputs + 1, **shifts, **regs)
    args = quants + [jnp.broadcast_to(a[..., None], shape) for a in (scale, offset)]
    constraints = ",".join(["=r"] * outputs + ["r"] * (len(quants) + 8))
    return plt.elementwise_inline_asm(code, args=args, constraints=constraints, pack=4,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct(shape, dtype)])[0]


# How the tensor-core kernel dequantizes a Q4_K/Q6_K tile (`tile_math`): "f32", a float32 fma per weight, then
# rounded to bf16 (`plane_tile_asm`); "bf16x2"/"f16x2", two weights an instruction in packed bf16/float16 arithmetic
# (`plane_tile_pairs`), the sub-blocks' scales and mins rounded to that type first. float16 keeps 3 more significand
# bits than bf16 but not its range: with f16x2 x enters the products scaled by 2**-F16_SHIFT and the weights by
# 2**F16_SHIFT (exact both), so x may reach 65504 * 2**8 and the weights 2**7 (`f16_fits`, checked at `pack`).
TILE_MATHS = ("f32", "bf16x2", "f16x2")
PAIR_DTYPES = {"bf16x2": jnp.bfloat16, "f16x2": jnp.float16}
F16_SHIFT = 8


def mma_dtype(tile_math: str):
    """The dtype of the tensor-core kernel's operands under `tile_math`."""
    return PAIR_DTYPES.get(tile_math, jnp.bfloat16)


def weight_gain(tile_math: str) -> float:
    """What `tile_math` scales the weights by (and x by its inverse): 2**F16_SHIFT for f16x2, else 1."""
    return 2.0 ** F16_SHIFT if tile_math == "f16x2" else 1.0


def x_operand(x: jax.Array, tile_math: str) -> jax.Array:
    """x as the tensor-core kernel multiplies it: bf16, or float16 scaled by 2**-F16_SHIFT (f16x2)."""
    if tile_math == "f16x2":
        return (x.astype(jnp.float32) / weight_gain(tile_math)).astype(jnp.float16)
    return x.astype(jnp.bfloat16)


def plane_tile_mma(fmt: str, plane: int, get, asm: bool, tile_math: str = "f32") -> jax.Array:
    """A Q4_K/Q6_K plane tile as the tensor-core kernel multiplies it (`tile_math`), by inline PTX (`asm`) or by
    jnp ops that give the same values up to rounding ties: "f32" `plane_tile_asm` or `plane_tile` rounded to bf16;
    else `plane_tile_pairs` or its emulation `plane_tile_pairs_reference`."""
    if tile_math != "f32":
        return (plane_tile_pairs if asm else plane_tile_pairs_reference)(fmt, plane, get, tile_math)
    return plane_tile_asm(fmt, plane, get) if asm else plane_tile(fmt, plane, get).astype(jnp.bfloat16)


# The same in packed arithmetic, two weights an instruction: one prmt places two quant bytes under two bytes `c`,
# the pair (B + q0, B + q1) (bf16 0x43: B = 128; float16 0x64: B = 1024, where its step is 1); sub takes B off
# exactly; fma.rn makes q * scale + neg_min with one rounding. Outputs: 2 pairs ($0-$1); inputs: the quant
# register(s), then the scales and the neg_mins as 2 pairs each (the 4 weights of a register share one sub-block).
_PTX_PAIRS_HEAD = """{{
.reg .b32 m, h, c, k, t;
mov.b32 c, {c};
mov.b32 k, {k};
shr.u32 m, ${q}, {low_shift};
and.b32 m, m, 0x0F0F0F0F;
"""
_PTX_PAIRS = "".join(f"""prmt.b32 t, m, c, 0x4{2 * i + 1}4{2 * i};
sub.rn.{{op}} t, t, k;
fma.rn.{{op}} ${i}, t, ${{s{i}}}, ${{o{i}}};
""" for i in range(2)) + "}}"
_PAIR_BIAS = {"bf16x2": ("0x43", "0x43004300"), "f16x2": ("0x64", "0x64006400")}


def pair_scales(fmt: str, plane: int, get, tile_math: str) -> tuple[jax.Array, jax.Array]:
    """(scale, neg_min) of a Q4_K/Q6_K plane tile's sub-blocks in `tile_math`'s type (f16x2: times 2**F16_SHIFT), as
    `plane_tile_pairs` dequantizes with them: a weight is q * scale + neg_min (Q6_K: neg_min = -32 * scale, exact)."""
    if fmt not in PTX_FORMATS:
        raise ValueError(f"no {tile_math} dequantization for {fmt}")
    dtype, gain = PAIR_DTYPES[tile_math], weight_gain(tile_math)
    scale, neg_min = _ptx_scales(fmt, plane, get)
    scale = (scale * gain).astype(dtype)
    return scale, scale * -32 if neg_min is None else (neg_min * gain).astype(dtype)


def plane_tile_pairs_reference(fmt: str, plane: int, get, tile_math: str) -> jax.Array:
    """The tile `plane_tile_pairs` makes, by jnp ops: q * scale + neg_min in float32 (exact unless the two terms'
    exponents are far apart: q has at most 6 significant bits, scale and neg_min 8 or 11), rounded once to the pair
    type, as the PTX's fma rounds (the two can differ by an ulp where float32 rounded first)."""
    scale, neg_min = (a.astype(jnp.float32)[..., None] for a in pair_scales(fmt, plane, get, tile_math))
    return (plane_quants(fmt, plane, get).astype(jnp.float32) * scale + neg_min).astype(PAIR_DTYPES[tile_math])


def plane_tile_pairs(fmt: str, plane: int, get, tile_math: str) -> jax.Array:
    """A Q4_K/Q6_K plane tile dequantized by inline PTX in packed bf16 or float16 arithmetic (GPU only): about 1
    instruction per weight fewer than `plane_tile_asm`'s float32 fma and conversion
    (scripts/results/qmatmul_sass_bf16x2_cpu.txt)."""
    scale, neg_min = pair_scales(fmt, plane, get, tile_math)
    quants, shifts, high = _ptx_quants(fmt, plane, get)
    shape = quants[0].shape
    regs = {f"{name}{i}": 2 + len(quants) + 2 * j + i for j, name in enumerate("so") for i in range(2)}
    c, k = _PAIR_BIAS[tile_math]
    code = (_PTX_PAIRS_HEAD + high + _PTX_PAIRS).format(q=2, qh=3, c=c, k=k, op=tile_math, **shifts, **regs)
    args = quants + [jnp.broadcast_to(a[..., None], shape) for a in (scale, neg_min)]
    constraints = ",".join(["=r"] * 2 + ["r"] * (len(quants) + 4))
    return plt.elementwise_inline_asm(code, args=args, constraints=constraints, pack=4,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct(shape, PAIR_DTYPES[tile_math])])[0]


# ---------------------------------------------------------------------------------------------------------------
# Reference

def dequantize_packed(pw: PackedWeight, tile_math: str = "f32") -> jax.Array:
    """The float32 [N, K] matrix a PackedWeight stores (equal to quant.dequantize of the tensor it came from);
    with `tile_math` "bf16x2"/"f16x2", a Q4_K/Q6_K matrix as that kernel dequantizes it (`plane_tile_pairs_reference`,
    f16x2's 2**F16_SHIFT taken back off: exact)."""
    n, k = pw.shape
    if pw.mgpu_only:  # the Mosaic kernel's float16 weights stand for f16x2's (the same arithmetic)
        kernel = mgpu_module(pw.fmt)
        return (kernel.dequantize(pw.mgpu) if tile_math == "f32" else
                kernel.f16_weights(pw.mgpu).astype(jnp.float32) / 2.0 ** pw.mgpu.gain)
    get, tile_math = whole_rows(pw.data), tile_math if pw.fmt in PTX_FORMATS else "f32"
    out = jnp.zeros((n, k), jnp.float32)
    for plane, cols in enumerate(plane_columns(pw.fmt, k)):
        tile = (plane_tile(pw.fmt, plane, get) if tile_math == "f32" else
                plane_tile_pairs_reference(pw.fmt, plane, get, tile_math))
        out = out.at[:, cols].set(tile.astype(jnp.float32).reshape(n, -1) / weight_gain(tile_math))
    return out


def qmatmul_reference(x: jax.Array, pw: PackedWeight, tile_math: str = "f32") -> jax.Array:
    """x [M, K] @ W^T -> [M, N] float32, with x rounded as the kernel takes it (bf16; float16 with f16x2) and, with
    `tile_math` "bf16x2"/"f16x2", the weights as that kernel dequantizes them."""
    x_math = tile_math if pw.fmt in PTX_FORMATS else "f32"
    xb = x_operand(x, x_math).astype(jnp.float32) * weight_gain(x_math)
    return jnp.einsum("mk,nk->mn", xb, dequantize_packed(pw, tile_math), precision=jax.lax.Precision.HIGHEST)


# ---------------------------------------------------------------------------------------------------------------
# Kernel

def default_tiles(m_pad: int, n: int, fmt: str) -> tuple[int, int, int]:
    """(rows of W per program, columns per K step, warps): the best of a sweep on an H100 (scripts/bench_kernels.py
    --sweep, 17408 x 5120 Q4_K and 5120 x 17408 Q6_K): narrow tiles for 16 activation rows, wider ones for 32;
    64 rows get half the columns (512 would need 384 KiB of shared memory for 3 pipeline stages). 32 rows on a Q6_K
    matrix of at most 8192 rows (the 27B's ffn_down) take 256 columns and 8 warps, which also lets K split 4 ways:
    1.3-1.4x faster there, while the same tiles made Q4_K's ffn_down 1.25x slower
    (scripts/results/qmatmul_h100_sweep_m32.json, qmatmul_h100_m32_narrow.json). Q5_K at 32 rows takes them too:
    the wide tiles ran 3x slower than at 16 or 64 rows (scripts/results/qmatmul_rows_probe_h100.txt, tiles).
    Q4_K at 16 rows takes 64 x 512 too, with 2 pipeline stages (`default_stages`): 1.06-1.28x faster than 32 x 256
    on four of the 27B's six Q4_K shapes, 1.03-1.08x slower on ffn_down and attn_gate
    (scripts/results/qmatmul_stages_h100.txt)."""
    if m_pad == 32 and ((n <= 8192 and fmt == "Q6_K") or fmt == "Q5_K"):
        return 64, 256, 8
    if m_pad == 16 and fmt == "Q4_K":
        return 64, 512, 4
    return {16: (32, 256, 4), 32: (64, 512, 4)}.get(m_pad, (64, 256, 4))


# Triton pipeline stages of the tensor-core kernel by weight format, for 16-32 rows of x (others: 3)
MMA_STAGES = {"Q4_K": 2}


def default_stages(m_pad: int, fmt: str, gemv: bool, wgmma: bool = False) -> int:
    """Pipeline stages (`num_stages`) of a product: `MMA_STAGES` for the tensor-core kernel at 16-32 rows, else 3.
    Two stages keep one buffer of each K step's loads instead of two: the Q4_K kernel's 64 x 512 tiles at 32 rows
    then take 51 KB of shared memory instead of 103 KB and 3 programs an SM instead of 2 (SASS read on a CPU), and
    ran 1.05-1.35x faster on five of the 27B's six Q4_K shapes at 23 tokens, 1.03x slower on ffn_down; Q5_K and
    Q6_K gained nothing (scripts/results/qmatmul_stages_h100.txt). A bf16 weight with `wgmma` takes 2 at any row
    count: its weight tile is staged in shared memory too, and three stages of 64 x 512 overflow an H100's 227 KiB."""
    if gemv:
        return 3
    if wgmma and fmt == "BF16":
        return 2
    return MMA_STAGES.get(fmt, 3) if m_pad in (16, 32) else 3


# (rows of W per program, columns per K step, warps) of the GEMV: the best single choice of a sweep on an H100 over the
# 27B's Q4_K, Q5_K and Q6_K shapes at M = 1 (scripts/qmatmul_gemv_probe.py generic, 4 warps)
GEMV_TILES = (8, 512, 4)
# Defaults by kernel: K steps loaded ahead of the one computed (`_k_loop`), and Q4_K/Q6_K tiles by inline PTX
# (`plane_tile_asm`, GPU only); chosen by timings on an H100 (README, "The GEMV's options, timed")
PREFETCH = {"gemv": 1, "mma": 0}
ASM = {"gemv": True, "mma": True}
# Whether one-token products of Q4_K/Q6_K weights quantize x to int8 per weight group and multiply by dp4a
# (pallas_kernels/gemv_int8.py) instead of dequantizing the weights to float32: 0 no, 1 with x quantized by XLA ops
# before the kernel, 2 inside the kernel. 2 at 16 rows a program: the fastest AR step of an H100 run that alternated
# it with the float GEMV (12.7 ms), 1 (12.3-12.8) and 2 at 32 rows (12.5): 11.8-12.0 ms
# (scripts/results/ar_int8_in_kernel_h100.txt)
INT8_X = 2
INT8_X_MODES = (0, 1, 2)
INT8_X_FORMATS = ("Q4_K", "Q6_K")  # the weights that kernel takes
GEMV_INT8_TILES = (16, 1024, 4)  # (rows, columns, warps) of that kernel
# Whether products of 2-64 tokens of a Q4_K weight quantize x to int8 per super-block and multiply int8 quants on
# the tensor cores (pallas_kernels/mma_int8.py) instead of bf16 tiles, and that kernel's (rows, warps)
INT8_MMA = False
INT8_MMA_FORMATS = ("Q4_K",)
MMA_INT8_TILES = (64, 4)
# Whether the tensor-core kernel multiplies weight rows by tokens (Triton then takes Hopper's warpgroup MMA, wgmma,
# for row tiles of 64+) instead of tokens by weight rows (mma.sync): fewer instructions for Q4_K and Q5_K in a CPU's
# SASS read (scripts/results/qmatmul_sass_cpu.txt), but 1.0-1.4x slower at 16-32 tokens on an H100 at every tile
# tried (scripts/results/qmatmul_wgmma_h100.txt), so off
WGMMA = False
# Whether the tensor-core kernel reads x through `plane_view` (no gather and padding before the kernel): the same
# SASS as reading the gathered copy (scripts/qmatmul_sass.py, x_view=0/1) and one launch less a product, but the
# DDTree-22 step was 1.09x slower with it on an H100 (scripts/results/tree_xview_h100.txt), so off
X_VIEW = False
# How `pack` lays out Q4_K weights for the Mosaic GPU kernel (qmatmul_mgpu.py: TMA pipelines, wgmma with the tokens on
# its N side), where it takes them: False not at all; True beside the Triton kernels' layout, products of 2-64 rows
# going to it (while `MGPU`) and one-token products to the GEMV, which reads only the other layout, so the quants are
# held twice; "only" that layout alone, every product of the weight (one token padded to 8) going to it, for the tree
# and chain engines, whose target multiplies one token only at a prompt's end. On an H200 it made the DDTree-22 step
# 1.31x faster (28.1 -> 21.5 ms, scripts/results/tree_mgpu_ptx_h200.txt) at the same accuracy. Off here (a library
# default, as interpret mode cannot run it); generate, chat and serve turn it on for chain and ddtree on Hopper
# (generate.mgpu_layout)
MGPU_LAYOUTS = (False, True, "only")
MGPU_LAYOUT = False
# the formats `MGPU_LAYOUT` applies to. Q6_K's kernel (qmatmul_mgpu_q6k.py) is 1.7-2.3x faster than the Triton
# kernel on an H100 and made the DDTree-22 step 21.67 -> 19.00 ms at the same acceptance
# (scripts/results/bench_27b_h100_mgpu_q6k_b.txt)
MGPU_FORMATS = ("Q4_K", "Q6_K")
MGPU = True
# Per format, how the tensor-core kernel dequantizes its tiles (`TILE_MATHS`; f32 for a weight f16x2 cannot hold).
# f16x2: Q4_K's kernels 1.02-1.15x faster than f32 and 6x closer to the float32 product (3.0e-4 against 1.7e-3), the
# DDTree-22 step 28.60 -> 27.89 ms, the fixture model 3.2e-3 from its float32 logits instead of 1.0e-2, on an H200
# (scripts/results/qmatmul_f16x2_h200.txt, tree_f16x2_h200.txt). bf16x2 was as fast but twice as far (2.1e-2)
TILE_MATH = {fmt: "f16x2" for fmt in PTX_FORMATS}


def resolve_tile_math(tile_math: str | None, pw: PackedWeight) -> str:
    """The tile arithmetic a tensor-core product of `pw` runs: the one asked for, else the format's `TILE_MATH`
    (f32 where f16x2 would not fit the weight); a weight f16x2 cannot hold is refused when asked for by name."""
    if tile_math is not None and tile_math not in TILE_MATHS:
        raise ValueError(f"tile_math is one of {TILE_MATHS}, got {tile_math!r}")
    if pw.fmt not in PTX_FORMATS:
        return "f32"
    if tile_math is None:
        tile_math = TILE_MATH.get(pw.fmt, "f32")
        return "f32" if tile_math == "f16x2" and not pw.f16_ok else tile_math
    if tile_math == "f16x2" and not pw.f16_ok:
        raise ValueError(f"this {pw.fmt} weight does not fit float16 at 2**{F16_SHIFT} (f16_fits): take another "
                         "tile_math")
    return tile_math


def int8_x_mode(int8_x: int, gemv: bool, fmt: str) -> int:
    """The `int8_x` mode a product runs: the one asked for where the int8-activation GEMV applies (one token, a
    Q4_K/Q6_K weight), else 0."""
    if int8_x not in INT8_X_MODES:
        raise ValueError(f"int8_x is one of {INT8_X_MODES} (off, x quantized before the kernel, inside it), "
                         f"got {int8_x}")
    return int8_x if gemv and fmt in INT8_X_FORMATS else 0


def kernel_tiles(m: int, n: int, fmt: str, gemv: bool, block_n: int | None = None, columns: int | None = None,
                 num_warps: int | None = None, int8_x: int = 0) -> tuple[int, int, int]:
    """(rows of W per program, columns per K step, warps) that qmatmul runs: those given, else its defaults."""
    int8 = int8_x_mode(int8_x, gemv, fmt)
    bn, cols, warps = (GEMV_INT8_TILES if int8 else GEMV_TILES) if gemv else default_tiles(dot_tile(m), n, fmt)
    return block_n or bn, columns or cols, num_warps or warps


def k_steps(fmt: str, n: int, k: int, block_n: int, columns: int, splits: int | None, target: int) -> tuple:
    """(units per K step, K steps per program, splits): `splits` (default: `default_splits` at `target`) must
    divide the K steps."""
    step = units_per_step(fmt, k, columns)
    total = k // unit(fmt, k) // step
    splits = splits or default_splits(n, total, block_n, target=target)
    if total % splits:
        raise ValueError(f"{total} K steps do not split {splits} ways")
    return step, total // splits, splits


def default_splits(n: int, steps: int, block_n: int, target: int = 1024) -> int:
    """Programs along K: the largest power of two, at most 8, that keeps row tiles x splits within `target` (about
    eight programs per multiprocessor of an H100) and divides the K steps evenly. On the 27B's 5120-row matrices
    that is 2-4 splits, 1.3-1.8x faster than one (scripts/results/qmatmul_splits_h100.txt). The GEMV's 8-row tiles
    take a target of 2048: two splits on those matrices (640 row tiles), none on the wider ones."""
    tiles, s = -(-n // block_n), 1
    while 2 * s <= 8 and tiles * 2 * s <= target and steps % (2 * s) == 0:
        s *= 2
    return s


def units_per_step(fmt: str, k: int, columns: int = 512) -> int:
    """Units per K-loop step: the largest power of two dividing the row's units with at most `columns` columns."""
    units = k // unit(fmt, k)
    s = 1
    while units % (2 * s) == 0 and 2 * s * unit(fmt, k) <= columns:
        s *= 2
    if s * unit(fmt, k) < 16:
        raise ValueError(f"{fmt} rows of {k} columns do not split into steps of 16 or more columns")
    return s


def sum_splits(out: jax.Array, m: int, n: int) -> jax.Array:
    """A kernel's output [splits, rows of x, row tiles x rows] as [m, n]: the K splits' partial products added."""
    return (out[0] if out.shape[0] == 1 else jnp.sum(out, axis=0))[:m, :n]


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


def _step_tiles(fmt: str, n_planes: int, get, x_tile) -> dict[str, jax.Array]:
    """One K step's loads: every field tile `plane_tile` reads for `n_planes` planes, each loaded once, and each
    plane's activations (`x_tile(plane)`), keyed as `_from_tiles` reads them. plane_tile runs here only for its
    reads (its arithmetic has no use and the compiler drops it); `plane_tile_mma` reads the same fields."""
    tiles = {}

    def load(name, *idx):
        key = f"{name}{idx}"
        if key not in tiles:
            tiles[key] = get(name, *idx)
        return tiles[key]

    for plane in range(n_planes):
        plane_tile(fmt, plane, load)
        tiles[f"x{plane}"] = x_tile(plane)
    return tiles


def _from_tiles(tiles: dict[str, jax.Array]):
    """(`get`, `x_tile`) over tiles `_step_tiles` loaded."""
    return (lambda name, *idx: tiles[f"{name}{idx}"]), (lambda plane: tiles[f"x{plane}"])


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


def _k_loop(fmt: str, n_planes: int, reader, compute, steps: int, acc, prefetch: int):
    """acc after `compute(get, x_tile, acc)` over the K steps, where `reader(i, valid)` gives step i's (`get`,
    `x_tile`) reading from the refs (`valid`: see `tile_reader`), by `prefetch_loop`. With prefetch = 0 the loads
    happen inside `compute`; with prefetch > 0 a step's loads are gathered into a pytree that the loop can carry
    (`_step_tiles`). The GEMV takes prefetch = 1 (faster on an H100; 2 was slower); in the tensor-core kernel it
    turns Triton's own load pipelining off (scripts/results/qmatmul_sass_cpu.txt), so 0 there."""
    if not prefetch:
        return prefetch_loop(reader, lambda r, acc: compute(*r, acc), steps, acc, 0)
    return prefetch_loop(lambda i, valid: _step_tiles(fmt, n_planes, *reader(i, valid)),
                         lambda tiles, acc: compute(*_from_tiles(tiles), acc), steps, acc, prefetch)


def x_reader(x_ref, m: int, m_pad: int, x_view: bool, start, cols: int):
    """`x_tile(plane)`: [m_pad, cols] bf16 of plane's columns of x from plane column `start`, from the gathered
    [planes, m_pad, K / planes] or, with `x_view`, from `plane_view`'s reshape of the unpadded x, whose rows past m
    read zeros."""
    if not x_view:
        return lambda plane: x_ref[plane, :, pl.ds(start, cols)]

    def load(ref):
        if m == m_pad:
            return plt.load(ref)
        rows = (jnp.arange(m_pad) < m).reshape((m_pad,) + (1,) * (ref.ndim - 1))
        return plt.load(ref, mask=rows, other=0)

    if x_ref.ndim == 2:
        return lambda plane: load(x_ref.at[pl.ds(0, m_pad), pl.ds(start, cols)])
    return lambda plane: load(x_ref.at[pl.ds(0, m_pad), pl.ds(start // PLANE_RUN, cols // PLANE_RUN),
                                       jnp.int32(plane), pl.ds(0, PLANE_RUN)]).reshape(m_pad, cols)


def _kernel(fmt: str, n: int, step: int, steps: int, block_n: int, names: tuple[str, ...], asm: bool,
            prefetch: int, wgmma: bool, m: int, m_pad: int, x_view: bool, tile_math: str, *refs):
    x_ref, *w_refs, o_ref = refs
    w = dict(zip(names, w_refs))
    r0, split = pl.program_id(0) * block_n, pl.program_id(1)
    row_ok = (r0 + jnp.arange(block_n)) < n  # the last program's rows past N read zeros
    n_planes = N_PLANES[fmt]
    width = unit(fmt, 0) // n_planes  # columns of x per unit and plane

    def reader(i, valid):
        i = split * steps + i
        return (tile_reader(w, r0, row_ok, block_n, i * step, step, valid),
                x_reader(x_ref, m, m_pad, x_view, i * step * width, step * width))

    def compute(get, x_tile, acc):
        for plane in range(n_planes):
            if fmt == "BF16":  # a plain 2-D tile: measured twice as fast as the same bytes through a 3-D one
                tile = get("w")
            elif fmt in PTX_FORMATS:
                tile = plane_tile_mma(fmt, plane, get, asm, tile_math).reshape(block_n, -1)
            else:
                tile = plane_tile(fmt, plane, get).reshape(block_n, -1).astype(jnp.bfloat16)
            operands = (tile, x_tile(plane)) if wgmma else (x_tile(plane), tile)
            acc = acc + jax.lax.dot_general(*operands, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc

    shape = (block_n, m_pad) if wgmma else (m_pad, block_n)
    acc = _k_loop(fmt, n_planes, reader, compute, steps, jnp.zeros(shape, jnp.float32), prefetch)
    o_ref[split, :, pl.ds(r0, block_n)] = acc.T if wgmma else acc


def _gemv_kernel(fmt: str, n: int, step: int, steps: int, block_n: int, names: tuple[str, ...], asm: bool,
                 prefetch: int, *refs):
    x_ref, *w_refs, o_ref = refs
    w = dict(zip(names, w_refs))
    r0, split = pl.program_id(0) * block_n, pl.program_id(1)
    row_ok = (r0 + jnp.arange(block_n)) < n
    n_planes = x_ref.shape[0]  # x_ref [planes, units, *UNIT_SHAPE]: the tile's shape, no reshape

    def reader(i, valid):
        i = split * steps + i
        return (tile_reader(w, r0, row_ok, block_n, i * step, step, valid),
                lambda plane: x_ref[plane, pl.ds(i * step, step)])

    def compute(get, x_tile, acc):
        for plane in range(n_planes):
            tile = plane_tile_asm(fmt, plane, get, jnp.float32) if asm else plane_tile(fmt, plane, get)
            acc = acc + tile * x_tile(plane)[None]
        return acc

    # the products accumulate elementwise; rows are summed once, after the K loop
    acc = _k_loop(fmt, n_planes, reader, compute, steps, jnp.zeros((block_n, step) + UNIT_SHAPE[fmt], jnp.float32),
                  prefetch)
    while acc.ndim > 1:
        acc = jnp.sum(acc, axis=-1)
    o_ref[split, 0, pl.ds(r0, block_n)] = acc


@functools.partial(jax.jit, static_argnames=("block_n", "columns", "splits", "num_warps", "num_stages", "gemv",
                                             "asm", "prefetch", "int8_x", "int8_mma", "wgmma", "x_view", "tile_math",
                                             "mgpu", "interpret"))
def qmatmul(x: jax.Array, pw: PackedWeight, *, block_n: int | None = None, columns: int | None = None,
            splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
            gemv: bool | None = None, asm: bool | None = None, prefetch: int | None = None, int8_x: int | None = None,
            int8_mma: bool | None = None, wgmma: bool | None = None, x_view: bool | None = None,
            tile_math: str | None = None, mgpu: bool | None = None, interpret: bool = False) -> jax.Array:
    """x [M, K] @ W^T -> [M, N] float32 for a PackedWeight, M <= 64; K is split over `splits` programs per row tile
    (default: `default_splits`). `gemv` (default: M = 1) takes the one-token kernel. The GEMV rounds x to bf16 and
    keeps the dequantized weights in float32; the tensor-core kernel multiplies bf16 x and weights, or float16 ones
    for Q4_K/Q6_K under f16x2 (`tile_math`). `asm` makes Q4_K/Q6_K
    tiles with inline PTX (`plane_tile_asm`; GPU only), `prefetch` loads K steps ahead of the one computed
    (`_k_loop`); their defaults are `ASM` (on a GPU) and `PREFETCH`, by kernel. `int8_x` (default `INT8_X`) makes
    the GEMV of a Q4_K/Q6_K weight quantize x to int8 per weight group and multiply by dp4a (gemv_int8.py): 1 with x
    quantized before the kernel, 2 inside it; other formats keep the float32 GEMV. `int8_mma` (default `INT8_MMA`)
    makes products of two or more rows of x with a Q4_K weight multiply int8 quants on the tensor cores
    (mma_int8.py; its K step is one super-block, so `columns` does not apply). `wgmma` (default `WGMMA`) puts the
    tensor-core kernel's weight rows first in its products (tokens second), where Triton takes Hopper's warpgroup
    MMA for row tiles of 64 or more (the SASS read on a CPU: HGMMA instead of HMMA); slower on an H100.
    `num_stages` (default `default_stages`) is Triton's software pipeline depth over the K loop. `x_view` (default
    `X_VIEW`) makes the tensor-core kernel read each plane's columns of x from a reshape of it (`plane_view`) and
    mask the rows past M, instead of from a copy gathered and padded by XLA before it (one launch less a product;
    slower on an H100). `tile_math` (default: the format's `TILE_MATH`, f32 where the weight
    does not fit f16x2) is how the tensor-core kernel dequantizes Q4_K/Q6_K tiles: "f32", "bf16x2" or "f16x2"
    (`plane_tile_mma`; f16x2 also multiplies x in float16). `mgpu` (default `MGPU`): whether a product of 2-64 rows
    with a weight that carries the Mosaic GPU layout (`pw.mgpu`, `MGPU_LAYOUT`) takes that kernel (GPU only; the
    other options then do not apply); a weight in that layout alone (`pw.mgpu_only`) takes it for every product."""
    m, k = x.shape
    n, kw = pw.shape
    if k != kw:
        raise ValueError(f"x has {k} columns, the weight {kw}")
    if m > M_MAX:
        raise ValueError(f"qmatmul takes at most {M_MAX} rows, got {m}")
    gemv = m == 1 if gemv is None else gemv
    if pw.mgpu_only and (interpret or mgpu is False):
        raise ValueError("this weight is packed for the Mosaic GPU kernel alone (MGPU_LAYOUT 'only'), which runs on "
                         "a Hopper GPU, not in interpret mode or with mgpu=False")
    if pw.mgpu_only or (pw.mgpu is not None and (MGPU if mgpu is None else mgpu) and not gemv and not interpret):
        return mgpu_module(pw.fmt).qmatmul(x, pw.mgpu)
    kernel = "gemv" if gemv else "mma"
    asm = ASM[kernel] and not interpret if asm is None else asm
    if asm and interpret:
        raise ValueError("inline PTX (asm=True) runs only on a GPU, not in interpret mode")
    if gemv and m != 1:
        raise ValueError(f"the GEMV kernel takes one row of x, got {m}")
    prefetch = PREFETCH[kernel] if prefetch is None else prefetch
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0 K steps, got {prefetch}")
    if (INT8_MMA if int8_mma is None else int8_mma) and not gemv and pw.fmt in INT8_MMA_FORMATS:
        from pallas_kernels import mma_int8  # imported here: mma_int8 builds on this module
        block_n, num_warps = block_n or MMA_INT8_TILES[0], num_warps or MMA_INT8_TILES[1]
        splits = splits or default_splits(n, k // QK_K, block_n)
        return mma_int8.mma_int8(x, pw, block_n=block_n, splits=splits, num_warps=num_warps, num_stages=num_stages or 3,
                                 asm=asm, prefetch=prefetch, interpret=interpret)
    m_pad = 1 if gemv else dot_tile(m)
    wgmma = WGMMA if wgmma is None else wgmma
    tile_math = "f32" if gemv else resolve_tile_math(tile_math, pw)
    num_stages = num_stages or default_stages(m_pad, pw.fmt, gemv, wgmma)
    int8_x = int8_x_mode(INT8_X if int8_x is None else int8_x, gemv, pw.fmt)
    block_n, columns, num_warps = kernel_tiles(m, n, pw.fmt, gemv, block_n, columns, num_warps, int8_x)
    if int8_x:
        from pallas_kernels import gemv_int8  # imported here: gemv_int8 builds on this module's helpers
        return gemv_int8.gemv_int8(x, pw, in_kernel=int8_x == 2, block_n=block_n, columns=columns, splits=splits,
                                   num_warps=num_warps, num_stages=num_stages, asm=asm, prefetch=prefetch,
                                   interpret=interpret)
    step, steps, splits = k_steps(pw.fmt, n, k, block_n, columns, splits, target=2048 if gemv else 1024)
    x_view = (X_VIEW if x_view is None else x_view) and not gemv
    if x_view:
        xp = plane_view(pw.fmt, x_operand(x, tile_math))
    else:
        xb = jnp.zeros((m_pad, k), mma_dtype(tile_math)).at[:m].set(x_operand(x, tile_math))
        xp = xb[:, plane_columns(pw.fmt, k)].transpose(1, 0, 2)  # [planes, M, K / planes] in each plane's order
    if gemv:
        xp = xp.astype(jnp.float32).reshape((xp.shape[0], -1) + UNIT_SHAPE[pw.fmt])
    names = tuple(sorted(pw.data))
    tiles = pl.cdiv(n, block_n)
    out = pl.pallas_call(
        functools.partial(_gemv_kernel, pw.fmt, n, step, steps, block_n, names, asm and pw.fmt in PTX_FORMATS,
                          prefetch) if gemv else
        functools.partial(_kernel, pw.fmt, n, step, steps, block_n, names, asm, prefetch, wgmma, m, m_pad, x_view,
                          tile_math),
        out_shape=jax.ShapeDtypeStruct((splits, m_pad, tiles * block_n), jnp.float32),
        grid=(tiles, splits),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"{'gemv' if gemv else 'qmatmul'}_{pw.fmt.lower()}",
    )(xp, *(pw.data[name] for name in names))
    return sum_splits(out, m, n)
