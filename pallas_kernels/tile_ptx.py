"""How the tensor-core kernel dequantizes Q4_K/Q6_K tiles: inline PTX on a GPU, jnp giving the same values elsewhere.

Two tile maths (`tile_math`, chosen by the weight alone): "f16x2", two weights an instruction in packed float16
(`plane_tile_pairs`), multiplied with x in float16 (x scaled by 2**-F16_SHIFT, the weights by 2**F16_SHIFT), for a
weight float16 holds (`PackedWeight.f16_ok`); else "f32", a float32 fma per weight rounded to bf16 (`plane_tile_asm`).
On an H100 the f32 PTX made the 32-row products 1.15-1.3x faster than jnp's dequantization (16 rows: 1.0-1.3x) and
the 27B's DDTree-22 step 38.5 -> 32.8 ms (scripts/results/qmatmul_rows_probe_h100.txt, bench_27b_h100_dequant.txt);
f16x2 is another 1.02-1.15x for Q4_K and 6x closer to the float32 product (3.0e-4 against 1.7e-3; the DDTree-22
step 28.60 -> 27.89 ms on an H200: scripts/results/qmatmul_f16x2_h200.txt, tree_f16x2_h200.txt). In interpret
mode (CPU) `plane_tile_mma` runs the jnp forms instead (`asm=False`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

from pallas_kernels.qcommon import F16_SHIFT, PTX_FORMATS, PackedWeight, plane_quants, plane_scales, plane_tile

# PTX that dequantizes the 4 quant bytes of one 32-bit register into 4 weights of one plane. prmt places each 4-6 bit
# quant q in the third byte of a word whose top byte is 0x43: the float32 128 + q, exactly, with no conversion
# instruction; one float32 fma with the bias folded into the offset, (128 + q) * scale + (offset - 128 * scale);
# cvt.rn.bf16x2 packs the 4 weights into 2 bf16 pairs ($0-$1). Inputs: the quant register(s), then 4 scales and 4
# offsets (float32).
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
_PTX_OUT = """cvt.rn.bf16x2.f32 $0, w1, w0;
cvt.rn.bf16x2.f32 $1, w3, w2;
}}"""


def tile_math(pw: PackedWeight) -> str:
    """The tile arithmetic of the tensor-core kernel for `pw`: "f16x2" where float16 holds it, else "f32"."""
    return "f16x2" if pw.f16_ok else "f32"


def mma_dtype(tile_math: str):
    """The dtype of the tensor-core kernel's operands under `tile_math`."""
    return jnp.float16 if tile_math == "f16x2" else jnp.bfloat16


def weight_gain(tile_math: str) -> float:
    """What `tile_math` scales the weights by (and x by its inverse): 2**F16_SHIFT for f16x2, else 1."""
    return 2.0 ** F16_SHIFT if tile_math == "f16x2" else 1.0


def _ptx_quants(fmt: str, plane: int, get) -> tuple[list, dict, str]:
    """The inline PTX's quant tiles of a Q4_K/Q6_K plane ([rows, units, p, 32]; Q6_K's low and high bits, [rows,
    units, h, half, 16]), the shifts that take the plane's bits out of them, and Q6_K's code for the high bits."""
    if fmt == "Q4_K":
        return [get("qs")], dict(low_shift=4 * plane), ""
    if fmt == "Q6_K":
        return ([get("ql", slice(None), plane % 2), get("qh")], dict(low_shift=4 * (plane // 2), high_shift=2 * plane),
                _PTX_Q6K_HIGH)
    raise ValueError(f"no inline PTX dequantization for {fmt}")


def plane_tile_asm(fmt: str, plane: int, get) -> jax.Array:
    """A Q4_K/Q6_K plane tile dequantized by inline PTX in float32 and rounded to bf16 (GPU only; about 3
    instructions per weight instead of 5); the values are `plane_tile`'s up to float32 rounding."""
    quants, shifts, high = _ptx_quants(fmt, plane, get)
    scale, neg_min = plane_scales(fmt, plane, get)
    # q * scale + neg_min = (128 + q) * scale + offset; Q6_K: q - 32 = (128 + q) - 160
    offset = -160 * scale if neg_min is None else neg_min - 128 * scale
    shape, outputs = quants[0].shape, 2
    regs = {f"{name}{i}": outputs + len(quants) + 4 * j + i for j, name in enumerate("so") for i in range(4)}
    code = (_PTX_HEAD + high + _PTX_DEQUANT + _PTX_OUT).format(q=outputs, qh=outputs + 1, **shifts, **regs)
    args = quants + [jnp.broadcast_to(a[..., None], shape) for a in (scale, offset)]
    constraints = ",".join(["=r"] * outputs + ["r"] * (len(quants) + 8))
    return plt.elementwise_inline_asm(code, args=args, constraints=constraints, pack=4,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.bfloat16)])[0]


# The same in packed float16, two weights an instruction: one prmt places two quant bytes under two bytes 0x64, the
# pair (1024 + q0, 1024 + q1) (float16's step is 1 there); sub takes 1024 off exactly; fma.rn makes q * scale +
# neg_min with one rounding. Outputs: 2 pairs ($0-$1); inputs: the quant register(s), then the scales and the
# neg_mins as 2 pairs each (the 4 weights of a register share one sub-block).
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


def pair_scales(fmt: str, plane: int, get) -> tuple[jax.Array, jax.Array]:
    """(scale, neg_min) of a Q4_K/Q6_K plane tile's sub-blocks in float16 times 2**F16_SHIFT, as `plane_tile_pairs`
    dequantizes with them: a weight is q * scale + neg_min (Q6_K: neg_min = -32 * scale, exact)."""
    if fmt not in PTX_FORMATS:
        raise ValueError(f"no f16x2 dequantization for {fmt}")
    gain = weight_gain("f16x2")
    scale, neg_min = plane_scales(fmt, plane, get)
    scale = (scale * gain).astype(jnp.float16)
    return scale, scale * -32 if neg_min is None else (neg_min * gain).astype(jnp.float16)


def plane_tile_pairs_reference(fmt: str, plane: int, get) -> jax.Array:
    """The tile `plane_tile_pairs` makes, by jnp ops: q * scale + neg_min in float32 (exact unless the two terms'
    exponents are far apart: q has at most 6 significant bits, scale and neg_min 11), rounded once to float16, as
    the PTX's fma rounds (the two can differ by an ulp where float32 rounded first)."""
    scale, neg_min = (a.astype(jnp.float32)[..., None] for a in pair_scales(fmt, plane, get))
    return (plane_quants(fmt, plane, get).astype(jnp.float32) * scale + neg_min).astype(jnp.float16)


def plane_tile_pairs(fmt: str, plane: int, get) -> jax.Array:
    """A Q4_K/Q6_K plane tile dequantized by inline PTX in packed float16 arithmetic, times 2**F16_SHIFT (GPU only):
    about 1 instruction per weight fewer than `plane_tile_asm`'s (scripts/results/qmatmul_sass_bf16x2_cpu.txt)."""
    scale, neg_min = pair_scales(fmt, plane, get)
    quants, shifts, high = _ptx_quants(fmt, plane, get)
    shape = quants[0].shape
    regs = {f"{name}{i}": 2 + len(quants) + 2 * j + i for j, name in enumerate("so") for i in range(2)}
    code = (_PTX_PAIRS_HEAD + high + _PTX_PAIRS).format(q=2, qh=3, c="0x64", k="0x64006400", op="f16x2", **shifts,
                                                        **regs)
    args = quants + [jnp.broadcast_to(a[..., None], shape) for a in (scale, neg_min)]
    constraints = ",".join(["=r"] * 2 + ["r"] * (len(quants) + 4))
    return plt.elementwise_inline_asm(code, args=args, constraints=constraints, pack=4,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float16)])[0]


def plane_tile_mma(fmt: str, plane: int, get, asm: bool, tile_math: str) -> jax.Array:
    """A plane tile as the tensor-core kernel multiplies it (`tile_math`), by inline PTX (`asm`, Q4_K/Q6_K on a GPU)
    or by the jnp ops that give the same values up to rounding ties: "f16x2" `plane_tile_pairs` or its emulation
    `plane_tile_pairs_reference`; "f32" `plane_tile_asm` or `plane_tile` rounded to bf16."""
    if tile_math == "f16x2":
        return (plane_tile_pairs if asm else plane_tile_pairs_reference)(fmt, plane, get)
    return plane_tile_asm(fmt, plane, get) if asm else plane_tile(fmt, plane, get).astype(jnp.bfloat16)
