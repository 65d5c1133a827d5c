"""Q4_K weights times 2-64 tokens on Hopper, in Mosaic GPU (Pallas:MGPU): TMA pipelines and wgmma.

The Triton tensor-core kernel (qmatmul.py) multiplies tokens by weight rows with mma.sync, its operands built in
registers; this kernel puts the weight rows on wgmma's M side (64 per warpgroup, one warpgroup per program) and the
tokens on its N side (any multiple of 8), with x^T read by the tensor cores straight from shared memory. Per program
and pipeline step (one super-block, 256 columns), TMA brings in the [64, 256] int4 quants, x's [T, 256] columns and
the rows' Q4_K scales; the warpgroup converts each 32-column sub-block to float16 weights in registers (inline
PTX, `_f16_tile_wgmma`: q scale - min with the sub-block's scale and min as row vectors) and issues one wgmma of
K = 32 on it. K is split over `splits` programs whose partial products XLA adds. On an H200, 1.4-2.4x faster than the
Triton kernel on the 27B's Q4_K shapes at 8-32 tokens, at the same accuracy
(scripts/results/qmatmul_mgpu_wgmma_h200.txt).

Layout (`MgpuQ4K`, repacked once from the GGUF's Q4_K by `pack`): the quants as q - 8 in int4 [N, K], each 32-column
group in the order of wgmma's registers (`ORDER` "wgmma", `WGMMA_PERM`: 1.09-1.17x faster than column order, which
`order="natural"` keeps; scripts/results/qmatmul_mgpu_wgmma_h200.txt); per super-block the 8 sub-block scales and 8
mins (6-bit, one byte each) and d, dmin (float16, two bytes each) as `scales` [K / 256 x 20, N] uint8, transposed
so that a step's scales are row vectors one TMA copy brings (its innermost run of bytes is the program's rows).
4.625 bits a weight, 2.8 % over the GGUF's 4.5.

Arithmetic: as qmatmul's f16x2 tiles, float16 weights and x, exact up to float16's rounding of the weights: x enters
scaled by 2**-F16_SHIFT and the scales and mins by 2**F16_SHIFT (`pack` checks that they fit, `f16_fits`). Each
sub-block's scale d sc and min dmin m are made in float32 and rounded to float16 once, each weight by one fma.

GPU only (Hopper): GPU interpret mode (jax 0.10.2) cannot run wgmma with its A operand in registers, so the CPU
tests check the layout and the reference and that the kernel lowers for CUDA; its numerics are checked on a GPU
(`pytest -m gpu`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dflash_jax.quant import QK_K, QTensor, k_scale_min
from pallas_kernels.qmatmul import F16_SHIFT, f16_holds, sum_splits, x_operand

ROWS = 64  # wgmma's M: a warpgroup's instruction takes 64 weight rows; a program takes `rows`, a multiple
# `rows` a program may take, ROWS by default: 128 and 256, which read x half or a quarter as often, were no faster on
# the 27B's ffn matrices (scripts/results/qmatmul_mgpu_rows_h200.txt)
ROWS_PER_PROGRAM = (64, 128, 256)
GROUP = 32  # columns of a Q4_K sub-block (one scale and min)
SUB_BLOCKS = QK_K // GROUP
SCALE_ROWS = 2 * SUB_BLOCKS + 4  # bytes per row and super-block of `MgpuQ4K.scales`
M_MAX = 64  # tokens: x's [M, 256] tile per pipeline stage beside the weights'
STAGES = 3  # pipeline steps in flight: 1.08x faster than 4 at 24 tokens on an H200 (mgpu_probe_q4k_fields_h200)
CONVERTS = ("ptx", "mosaic")  # how the quants become float16 weights (`qmatmul`)
CONVERT = "ptx"  # 1.08-1.24x faster than "mosaic" on an H200 (scripts/results/qmatmul_mgpu_ptx_h200.txt)
ORDERS = ("wgmma", "natural")  # how `pack` orders the quants of each 32-column group (`MgpuQ4K.order`)
ORDER = "wgmma"
# (mask, xor, magic) of the lop3 that makes float16 magic + q from the "wgmma" order's nibbles at bits 0-3 (magic
# 1024) or 4-7 (magic 64, whose unit is 1/16 there) of each half-word, the xor flipping the int4's sign bit
NIBBLE_FIELDS = ((0x000F000F, 0x6408, 0x6400), (0x00F000F0, 0x5480, 0x5400))
# WGMMA_PERM[i]: the column (of its 32-column group) whose quant the "wgmma" order stores at position i. Loaded in
# Mosaic GPU's WGMMA_UPCAST_4X layout, lane l of a row's four gets positions 8 (l % 4) + p, p = 0..7 in one 32-bit
# word, and its wgmma A registers (WGMMA layout, float16 pairs) want columns 8 t + 2 (l % 4) + {0, 1}, t = 0..3; so
# nibble p holds column 8 (p % 4) + 2 (l % 4) + p // 4, and register t's pair is nibbles t and t + 4, one in each
# half of the word: no lane shuffle and no byte permute (`_f16_tile_wgmma`).
WGMMA_PERM = np.array([8 * (p % 4) + 2 * c + p // 4 for c in range(4) for p in range(8)])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MgpuQ4K:
    """A Q4_K weight [N, K] in this kernel's layout (module docstring)."""

    q: jax.Array  # [N, K] int4: the quants minus 8
    # [K / 256 * 20, N] uint8: per super-block, rows 0-7 the sub-block scales, 8-15 the mins, 16-19 d then dmin (the
    # bytes of a float16 each, low byte first)
    scales: jax.Array
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    order: str = dataclasses.field(default="natural", metadata=dict(static=True))  # one of ORDERS

    @property
    def nbytes(self) -> int:
        return self.q.size // 2 + self.scales.size


def pack(qt: QTensor, order: str | None = None) -> MgpuQ4K:
    """A Q4_K QTensor in this kernel's layout (once, at load), its quants in `order` (default `ORDER`); refuses
    other formats, rows not a multiple of 64 and weights whose float16 form would overflow (`f16_fits`)."""
    order = order or ORDER
    if order not in ORDERS:
        raise ValueError(f"order is one of {ORDERS}, got {order!r}")
    if qt.fmt != "Q4_K":
        raise NotImplementedError(f"the Mosaic GPU kernel is implemented for Q4_K weights only, not {qt.fmt} (Q5_K "
                                  "and Q6_K are not written yet): qmatmul.pack and the Triton kernels take them")
    n, k = qt.shape
    if n % ROWS:
        raise ValueError(f"the Mosaic GPU kernel takes weights of a multiple of {ROWS} rows, got {n}")
    f = {name: jnp.asarray(a) for name, a in qt.data.items()}
    nb = k // QK_K
    qs = f["qs"].reshape(n, nb, 4, 1, 32)  # byte 32p + l: sub-block 2p (low nibble), 2p + 1 (high), column l
    q = jnp.concatenate([qs & 0xF, qs >> 4], axis=3).reshape(n, k)
    if order == "wgmma":
        q = q.reshape(n, k // GROUP, GROUP)[..., WGMMA_PERM].reshape(n, k)
    sc, mn = k_scale_min(f["scales"].reshape(n, nb, 12))  # [n, nb, 8] each
    dd = jnp.stack([f["d"].reshape(n, nb), f["dmin"].reshape(n, nb)], axis=-1).astype(jnp.float16)
    dd_bytes = jax.lax.bitcast_convert_type(dd, jnp.uint8).reshape(n, nb, 4)
    w = MgpuQ4K(q=(q.astype(jnp.int8) - 8).astype(jnp.int4),
                scales=jnp.concatenate([sc.astype(jnp.uint8), mn.astype(jnp.uint8), dd_bytes], axis=-1)
                .reshape(n, nb * SCALE_ROWS).T,
                shape=(n, k), order=order)
    if not f16_fits(w):
        raise ValueError(f"this Q4_K weight does not fit float16 at 2**{F16_SHIFT} (f16_fits): take qmatmul")
    return w


def available() -> bool:
    """Whether the default device can run this kernel: a CUDA GPU of compute capability 9.x (Hopper's wgmma)."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def _scales(w: MgpuQ4K) -> tuple[jax.Array, jax.Array]:
    """Each sub-block's scale d sc and negated min -dmin m, float32 [N, K / 32]: w = q scale + neg_min."""
    n, k = w.shape
    nb = k // QK_K
    rows = w.scales.T.reshape(n, nb, SCALE_ROWS)
    codes = rows[..., :2 * SUB_BLOCKS].reshape(n, nb, 2, SUB_BLOCKS).astype(jnp.float32)
    dd = jax.lax.bitcast_convert_type(rows[..., 2 * SUB_BLOCKS:].reshape(n, nb, 2, 2), jnp.float16).astype(jnp.float32)
    return (dd[..., :1] * codes[:, :, 0]).reshape(n, -1), (-dd[..., 1:] * codes[:, :, 1]).reshape(n, -1)


def _quants(w: MgpuQ4K) -> jax.Array:
    """The stored quants q - 8 [N, K / 32, 32] in column order, as int32."""
    q = w.q.astype(jnp.int32).reshape(w.shape[0], -1, GROUP)
    return q[..., np.argsort(WGMMA_PERM)] if w.order == "wgmma" else q


def _terms(w: MgpuQ4K, convert: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(quants, scale, offset) as `convert` multiplies them, w = quants scale + offset: "ptx" takes q with the
    negated min, "mosaic" q - 8 (the int4 as stored) with 8 scale - dmin m; float32, scales [N, K / 32]."""
    scale, neg_min = _scales(w)
    q = _quants(w).astype(jnp.float32)
    return (q + 8, scale, neg_min) if convert == "ptx" else (q, scale, 8 * scale + neg_min)


def f16_fits(w: MgpuQ4K) -> bool:
    """Whether every weight, scale and offset of either form (`_terms`) times 2**F16_SHIFT stays under 2**15 in
    float16 (`f16_holds`: 15 |scale| + |neg_min| bounds them)."""
    return f16_holds(15, _scales(w))


def dequantize(w: MgpuQ4K) -> jax.Array:
    """The weight [N, K] in float32, exactly the GGUF's Q4_K values (d sc q - dmin m)."""
    q, scale, offset = _terms(w, "ptx")
    return (q * scale[..., None] + offset[..., None]).reshape(w.shape)


def _convert(w: MgpuQ4K, convert: str | None) -> str:
    """How the kernel turns w's quants into float16 weights: "ptx" for the "wgmma" order (the only way written for
    it), else `convert` (default `CONVERT`)."""
    if convert is not None and convert not in CONVERTS:
        raise ValueError(f"convert is one of {CONVERTS}, got {convert!r}")
    if w.order == "wgmma" and convert not in (None, "ptx"):
        raise ValueError(f"the \"wgmma\" order is converted by inline PTX only, not {convert!r}: pack with "
                         "order=\"natural\" for it")
    return "ptx" if w.order == "wgmma" else convert or CONVERT


def f16_weights(w: MgpuQ4K, convert: str | None = None) -> jax.Array:
    """The float16 weights [N, K] the kernel multiplies under `convert` (`_convert`): quants x scale + offset
    (`_terms`) with the scale and offset times 2**F16_SHIFT in float16, rounded once (one fma)."""
    q, scale, offset = _terms(w, _convert(w, convert))
    scale, offset = (jnp.asarray(a * 2.0 ** F16_SHIFT, jnp.float16).astype(jnp.float32) for a in (scale, offset))
    return (q * scale[..., None] + offset[..., None]).reshape(w.shape).astype(jnp.float16)


def reference(x: jax.Array, w: MgpuQ4K, convert: str | None = None) -> jax.Array:
    """x [M, K] @ W^T -> [M, N] float32, with x and the weights rounded as the kernel takes them (`convert`:
    `_convert`)."""
    return jnp.einsum("mk,nk->mn", x_operand(x, "f16x2").astype(jnp.float32),
                      f16_weights(w, convert).astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def default_splits(n: int, k: int, target: int = 2048, rows: int = ROWS) -> int:
    """Programs along K: 4 where they divide the super-blocks and keep row tiles x splits within `target`, else 2
    or 1. Four were the fastest of 1, 2 and 4 on the 27B's ffn_gate, ffn_down and attn_qkv at 16-32 tokens
    (scripts/results/mgpu_probe_splits_h200.txt, mgpu_probe_shapes_h200.txt)."""
    nb = k // QK_K
    for s in (4, 2):
        if nb % s == 0 and n // rows * s <= target:
            return s
    return 1


def _f16_twice(reg):
    """A row vector's register (vector<1 x f16>) -> its float16 in both halves of a 32-bit register, the scale or
    min operand of an f16x2 fma (inside `inline_mgpu`)."""
    from jax.experimental.mosaic.gpu import utils as mu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm, vector

    i32, i16 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(16)
    return llvm.inline_asm(i32, [mu.bitcast(vector.extract(reg, [], [0]), i16)], "mov.b32 $0, {$1, $1};", "=r,h")


def _f16_tile(q, scale, neg_min):
    """q [64, 32] int4 as loaded (WGMMA_UPCAST_4X layout: 8 nibbles a 32-bit register) -> float16 [64, 32] in WGMMA
    layout, (q ^ 8) scale + neg_min per row.

    Mosaic GPU's relayout to WGMMA (a lane shuffle and a prmt per register) leaves each register two nibbles of a
    32-bit word. Then, by inline PTX, a prmt puts the two nibbles in the low bits of two halves; a lop3 masks them,
    flips the stored sign bit (the int4 holds q - 8) and sets float16's exponent of 1024, which makes 1024 + q
    exactly; a sub takes the 1024 off and one fma applies the row's scale and negated min, two weights an
    instruction. The same part and byte order as Mosaic GPU's own int4-to-bf16 conversion (FragmentedArray.astype),
    which this replaces."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm

    wgmma, row = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X, row, row),
                       return_type=plgpu.ShapeDtypeStruct(q.shape, jnp.float16, wgmma))
    def convert(_, qf, sf, of):
        i32 = ir.IntegerType.get_signless(32)
        qf = qf.to_layout(fa.WGMMA_LAYOUT)  # built here, so each register's slice of its word can be read back

        # registers [row tile, column tile, .., .., row half, ..]: a thread holds rows r and r + 8 of its warp's 16
        scales = {(i, h): _f16_twice(sf.registers[i, 0, h, 0, 0]) for i in range(q.shape[0] // ROWS) for h in range(2)}
        mins = {(i, h): _f16_twice(of.registers[i, 0, h, 0, 0]) for i in range(q.shape[0] // ROWS) for h in range(2)}
        out = np.empty_like(qf.registers)
        for idx, reg in np.ndenumerate(qf.registers):
            piece = reg.owner.opview  # vector.extract_strided_slice of the 8-nibble word
            offset = piece.offsets[0]
            part = (offset.value if hasattr(offset, "value") else int(offset)) // 2
            word = mu.bitcast(piece.source, i32)
            pair_f16 = llvm.inline_asm(
                i32, [word, arith.shrui(word, mu.c(4, i32)), scales[idx[0], idx[4]], mins[idx[0], idx[4]]],
                f"""{{
                .reg .b32 t, k;
                prmt.b32 t, $1, $2, 0xF{part + 4}F{part};
                lop3.b32 t, t, 0x000F000F, 0x64086408, 0x6a;
                mov.b32 k, 0x64006400;
                sub.f16x2 t, t, k;
                fma.rn.f16x2 $0, t, $3, $4;
                }}""",
                "=r,r,r,r,r")
            out[idx] = mu.bitcast(pair_f16, ir.VectorType.get((2,), ir.F16Type.get()))
        return fa.FragmentedArray(_registers=out, _layout=qf.layout, _is_signed=None)

    return convert(q, scale, neg_min)


def _f16_tile_wgmma(q, scale, neg_min):
    """q [64, 32] int4 in the "wgmma" order as loaded (WGMMA_UPCAST_4X: a lane's 8 quants of a row in one 32-bit
    word) -> float16 [64, 32] in WGMMA layout, (q ^ 8) scale + neg_min per row, with no data between lanes.

    The order (`WGMMA_PERM`) puts each of the lane's four wgmma registers in two nibbles, t and t + 4 of the word.
    Per register, one lop3 masks them where they lie (bits 0-3 of each half: float16's exponent of 1024 makes 1024
    + q; bits 4-7: an exponent of 64, whose unit there is 1/16, makes 64 + q) and flips the stored sign bit (the
    int4 holds q - 8); a sub takes the 1024 or 64 off and one fma applies the row's scale and negated min. One shift
    right by 8 serves registers 2 and 3."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm

    wgmma, row = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X, row, row),
                       return_type=plgpu.ShapeDtypeStruct(q.shape, jnp.float16, wgmma))
    def convert(_, qf, sf, of):
        i32 = ir.IntegerType.get_signless(32)
        f16x2 = ir.VectorType.get((2,), ir.F16Type.get())

        out = np.empty(fa.WGMMA_LAYOUT.registers_shape(q.shape), dtype=object)  # [row tiles, 4 col tiles, 1, 1, 2, ..]
        # row tile i, half h: a lane holds rows r and r + 8 of its warp's 16 in each tile of 64
        for i, h in np.ndindex(q.shape[0] // ROWS, 2):
            scale, neg_min = _f16_twice(sf.registers[i, 0, h, 0, 0]), _f16_twice(of.registers[i, 0, h, 0, 0])
            word = mu.bitcast(qf.registers[i, 0, 0, 0, h, 0, 0, 0, 0], i32)
            words = (word, arith.shrui(word, mu.c(8, i32)))
            for t in range(4):
                mask, xor, magic = NIBBLE_FIELDS[t % 2]
                reg = llvm.inline_asm(
                    i32, [words[t // 2], scale, neg_min],
                    f"""{{
                    .reg .b32 u, k;
                    lop3.b32 u, $1, {mask:#010x}, {xor * 0x10001:#010x}, 0x6a;
                    mov.b32 k, {magic * 0x10001:#010x};
                    sub.f16x2 u, u, k;
                    fma.rn.f16x2 $0, u, $2, $3;
                    }}""",
                    "=r,r,r,r")
                out[i, t, 0, 0, h, 0, 0, 0, 0] = mu.bitcast(reg, f16x2)
        return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return convert(q, scale, neg_min)


def _body(t: int, rows: int, steps: int, stages: int, convert: str, order: str, w_gmem, x_gmem, scales_gmem, o_gmem,
          o_smem):
    ni, si = jax.lax.axis_index("n"), jax.lax.axis_index("k")
    row = plgpu.Layout.WGMMA.reduce(1)  # a vector over the tile's rows, as wgmma's accumulator holds them
    f32, f16 = jnp.float32, jnp.float16
    gain = 2.0 ** F16_SHIFT

    def f16_at(scales_smem, i):  # the float16 whose bytes are rows i, i + 1 of the step's scales
        lo, hi = (plgpu.load(scales_smem.at[i + b], (), layout=row).astype(jnp.uint16) for b in (0, 1))
        return jax.lax.bitcast_convert_type((hi << 8) | lo, f16)

    def step(_, w_smem, x_smem, scales_smem, acc_ref):
        d = f16_at(scales_smem, 2 * SUB_BLOCKS).astype(f32) * gain
        dmin = f16_at(scales_smem, 2 * SUB_BLOCKS + 2).astype(f32) * gain

        if convert == "ptx":  # and the "wgmma" order
            quants = plgpu.load(w_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
        else:
            quants = w_smem[...]
        for j in range(SUB_BLOCKS):
            scale = d * plgpu.load(scales_smem.at[j], (), layout=row).astype(f32)
            neg_min = -dmin * plgpu.load(scales_smem.at[SUB_BLOCKS + j], (), layout=row).astype(f32)
            cols = slice(j * GROUP, (j + 1) * GROUP)
            if order == "wgmma":
                a = _f16_tile_wgmma(quants[:, cols], scale.astype(f16), neg_min.astype(f16))
            elif convert == "ptx":
                a = _f16_tile(quants[:, cols], scale.astype(f16), neg_min.astype(f16))
            else:  # int4 -> bf16 is Mosaic's fast conversion; bf16 -> float16 a generic one
                q = quants[:, cols].astype(jnp.bfloat16).astype(f16)
                offset = 8.0 * scale + neg_min
                a = (q * jax.lax.broadcast_in_dim(scale.astype(f16), q.shape, [0])
                     + jax.lax.broadcast_in_dim(offset.astype(f16), q.shape, [0]))
            plgpu.wgmma(acc_ref, a, x_smem.at[:, cols].T)
            plgpu.wgmma_wait(1)

    def specs():
        k0 = si * steps
        return [plgpu.BlockSpec((rows, QK_K), lambda i: (ni, k0 + i), delay_release=1,
                                transforms=(plgpu.TilingTransform((8, QK_K)), plgpu.SwizzleTransform(128))),
                # 64-byte swizzle: x's 32-column slices (one sub-block) are whole swizzle tiles for wgmma's B
                plgpu.BlockSpec((t, QK_K), lambda i: (0, k0 + i), delay_release=1,
                                transforms=(plgpu.TilingTransform((8, GROUP)), plgpu.SwizzleTransform(64))),
                plgpu.BlockSpec((SCALE_ROWS, rows), lambda i: (k0 + i, ni), delay_release=1)]

    def compute(acc_ref):
        plgpu.emit_pipeline(lambda i, *refs: step(i, *refs, acc_ref), grid=(steps,), in_specs=specs(),
                            max_concurrent_steps=stages)(w_gmem, x_gmem, scales_gmem)
        return acc_ref[...]

    o_smem[...] = pl.run_scoped(compute, plgpu.ACC((rows, t), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, pl.ds(ni * rows, rows)])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("splits", "stages", "convert", "rows"))
def qmatmul(x: jax.Array, w: MgpuQ4K, *, splits: int | None = None, stages: int = STAGES,
            convert: str | None = None, rows: int | None = None) -> jax.Array:
    """x [M, K] @ W^T -> [M, N] float32 for M <= 64 (padded to a multiple of 8 tokens), on a Hopper GPU; K split over
    `splits` programs (default: `default_splits`), `stages` pipeline steps in flight, `rows` weight rows a program
    (one of ROWS_PER_PROGRAM; default ROWS); `convert` ("ptx" or "mosaic", `_convert`) how the quants become float16
    weights (`_f16_tile_wgmma` for the "wgmma" order; `_f16_tile`, or Mosaic's int4-to-bf16 and a bf16-to-float16
    conversion, for the natural one)."""
    convert = _convert(w, convert)
    m, k = x.shape
    n, kw = w.shape
    if k != kw:
        raise ValueError(f"x has {k} columns, the weight {kw}")
    if not 1 <= m <= M_MAX:
        raise ValueError(f"the Mosaic GPU kernel takes 1 to {M_MAX} rows of x, got {m}")
    nb = k // QK_K
    rows = rows or ROWS
    if rows not in ROWS_PER_PROGRAM or n % rows:
        raise ValueError(f"rows per program is one of {ROWS_PER_PROGRAM} and divides the weight's {n}, got {rows}")
    splits = splits or default_splits(n, k, rows=rows)
    if nb % splits:
        raise ValueError(f"{nb} super-blocks do not split {splits} ways")
    t = -(-m // 8) * 8
    xt = jnp.zeros((t, k), jnp.float16).at[:m].set(x_operand(x, "f16x2"))
    out = plgpu.kernel(
        functools.partial(_body, t, rows, nb // splits, stages, convert, w.order),
        out_type=jax.ShapeDtypeStruct((splits, n, t), jnp.float32),
        grid=(n // rows, splits), grid_names=("n", "k"),
        scratch_types=[plgpu.SMEM((rows, t), jnp.float32)],
        kernel_name="qmatmul_mgpu_q4_k",
    )(w.q, xt, w.scales)
    return sum_splits(out, n, m).T  # out is [splits, N, tokens]
