"""Q4_K weights times 2-64 tokens on Hopper, in Mosaic GPU (Pallas:MGPU): TMA pipelines and wgmma.

The Triton tensor-core kernel (qmatmul_triton.py) multiplies tokens by weight rows with mma.sync, its operands built in
registers; this kernel puts the weight rows on wgmma's M side (64 per warpgroup, one warpgroup per program) and the
tokens on its N side (any multiple of 8), with x^T read by the tensor cores straight from shared memory. Per program
and pipeline step (one super-block, 256 columns), TMA brings in the [64, 256] int4 quants, x's [T, 256] columns and
the rows' Q4_K scales; the warpgroup converts each 32-column sub-block to float16 weights in registers (inline
PTX, `_f16_tile_wgmma`: q scale - min with the sub-block's scale and min as row vectors) and issues one wgmma of
K = 32 on it. K is split over `splits` programs whose partial products XLA adds. Two other schedules were tried and
dropped: a few programs an SM streaming equal runs of all the tiles' super-blocks, 0.88-1.04x this one's speed
(scripts/results/qmatmul_mgpu_stream_h200.txt), and a memory warpgroup issuing the copies for two compute warpgroups
of 64 rows each, 0.71-0.95x on an H100 (qmatmul_mgpu_q6k_h100.txt). On an H200, 1.4-2.4x faster than the Triton
kernel on the 27B's Q4_K shapes at 8-32 tokens, at the same accuracy (scripts/results/qmatmul_mgpu_wgmma_h200.txt);
since the scales travel in words, another 1.05-1.12x on an H100 (scripts/results/qmatmul_mgpu_scale_words_h100.txt).

Layout (`MgpuQ4K`, repacked once from the GGUF's Q4_K by `pack`): the quants as q - 8 in int4 [N, K], each 32-column
group in the order of wgmma's registers (`WGMMA_PERM`: 1.09-1.17x faster than column order;
scripts/results/qmatmul_mgpu_wgmma_h200.txt); per super-block the 8 sub-block scales and 8 mins (6-bit, one byte
each) and d, dmin (float16) as `scales` [K / 256 x 5, N] uint32, a row's (scale, min) of two sub-blocks a word and
(d, dmin) the fifth, transposed so that a step's scales are 5 row vectors one TMA copy brings (its innermost run is
the program's rows) and a thread reads a row's two sub-blocks in one load. 4.625 bits a weight, 2.8 % over the
GGUF's 4.5.

Arithmetic: as the tensor-core kernel's f16x2 tiles (tile_ptx.py), float16 weights and x, exact up to float16's
rounding of the weights: x enters scaled by 2**-F16_SHIFT and the scales and mins by 2**F16_SHIFT (`pack` checks that
they fit, `f16_fits`). Each sub-block's scale d sc and negated min -dmin m is one f16x2 product of the codes and the
scaled (d, -dmin), rounded once to float16 (`_scale_pairs`), each weight by one fma. The K splits' partial products
go to their own slices of the output, which XLA adds (deterministic).

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
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import utils as mu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector

from pallas_kernels.ggml import QK_K, k_scale_min
from pallas_kernels.qcommon import F16_SHIFT, f16_within, sum_splits, x_operand

ROWS = 64  # wgmma's M: a warpgroup's instruction takes 64 weight rows, and a program (one warpgroup) 64 rows
GROUP = 32  # columns of a Q4_K sub-block (one scale and min)
SUB_BLOCKS = QK_K // GROUP
SCALE_WORDS = SUB_BLOCKS // 2 + 1  # 32-bit words per row and super-block of `MgpuQ4K.scales`
M_MAX = 64  # tokens: x's [M, 256] tile per pipeline stage beside the weights'
STAGES = 3  # pipeline steps in flight: 1.08x faster than 4 at 24 tokens on an H200 (mgpu_probe_q4k_fields_h200)
# (mask, xor, magic) of the lop3 that makes float16 magic + q from the "wgmma" order's nibbles at bits 0-3 (magic
# 1024) or 4-7 (magic 64, whose unit is 1/16 there) of each half-word, the xor flipping the int4's sign bit
NIBBLE_FIELDS = ((0x000F000F, 0x6408, 0x6400), (0x00F000F0, 0x5480, 0x5400))
# WGMMA_PERM[i]: the column (of its 32-column group) whose quant the "wgmma" order stores at position i. Loaded in
# Mosaic GPU's WGMMA_UPCAST_4X layout, lane l of a row's four gets positions 8 (l % 4) + p, p = 0..7 in one 32-bit
# word, and its wgmma A registers (WGMMA layout, float16 pairs) want columns 8 t + 2 (l % 4) + {0, 1}, t = 0..3; so
# nibble p holds column 8 (p % 4) + 2 (l % 4) + p // 4, and register t's pair is nibbles t and t + 4, one in each
# half of the word: no lane shuffle and no byte permute (`_f16_tile_wgmma`). A wgmma call multiplies one sub-block.
WGMMA_PERM = np.array([8 * (p % 4) + 2 * c + p // 4 for c in range(4) for p in range(8)])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MgpuQ4K:
    """A Q4_K weight [N, K] in this kernel's layout (module docstring)."""

    q: jax.Array  # [N, K] int4: the quants minus 8
    # [K / 256 * 5, N] uint32: per super-block, word w < 4 the bytes (6 bits each, low byte first) scale of sub-block
    # 2w, of 2w + 1, min of 2w, of 2w + 1; word 4 d then dmin (float16, low half first)
    scales: jax.Array
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))

    @property
    def nbytes(self) -> int:
        return self.q.size // 2 + self.scales.size * 4


def pack(fmt: str, shape: tuple[int, int], data: dict[str, jax.Array]) -> MgpuQ4K:
    """A Q4_K weight [N, K] (its GGUF block fields `data`, as dflash_jax's QTensor holds them) in this kernel's layout,
    once, at load; refuses other formats, rows not a multiple of 64 and weights whose float16 form would overflow
    (`f16_fits`)."""
    if fmt != "Q4_K":
        raise NotImplementedError(f"qmatmul_mgpu takes Q4_K weights, not {fmt} (qmatmul_mgpu_q6k takes Q6_K; no "
                                  "Mosaic GPU kernel is written for Q5_K): qmatmul.pack and the Triton kernels take "
                                  "the others")
    return checked_layout(fmt, shape, data, _layout, f16_fits)


def checked_layout(fmt: str, shape: tuple[int, int], data: dict[str, jax.Array], layout, fits):
    """`layout(shape, data)`, a Mosaic GPU kernel's layout of a weight, refused (ValueError: the Triton kernels take it)
    for rows not a multiple of ROWS and where float16 cannot hold the weight (`fits` of the layout False)."""
    if shape[0] % ROWS:
        raise ValueError(f"the Mosaic GPU kernel takes weights of a multiple of {ROWS} rows, got {shape[0]}")
    w = layout(tuple(shape), dict(data))
    if not fits(w):
        raise ValueError(f"this {fmt} weight does not fit float16 at 2**{F16_SHIFT} (f16_fits): take qmatmul")
    return w


@functools.partial(jax.jit, static_argnums=0)
def _layout(shape: tuple[int, int], f: dict[str, jax.Array]) -> MgpuQ4K:
    """`pack`'s repacking, one compiled program per shape (op by op, a load compiled each op per shape and
    device: most of the time a sharded target took to load)."""
    n, k = shape
    nb = k // QK_K
    qs = f["qs"].reshape(n, nb, 4, 1, 32)  # byte 32p + l: sub-block 2p (low nibble), 2p + 1 (high), column l
    q = jnp.concatenate([qs & 0xF, qs >> 4], axis=3).reshape(n, k)
    q = q.reshape(n, k // GROUP, GROUP)[..., WGMMA_PERM].reshape(n, k)
    sc, mn = k_scale_min(f["scales"].reshape(n, nb, 12))  # [n, nb, 8] each
    # a word's bytes: the scales of sub-blocks 2w, 2w + 1, then their mins (`_scale_pairs` masks out one of each)
    codes = jnp.stack([sc.reshape(n, nb, -1, 2), mn.reshape(n, nb, -1, 2)], axis=-2).astype(jnp.uint8)
    codes = codes.reshape(n, nb, SUB_BLOCKS // 2, 4)
    dd = jnp.stack([f["d"].reshape(n, nb), f["dmin"].reshape(n, nb)], axis=-1).astype(jnp.float16)
    words = jnp.concatenate([jax.lax.bitcast_convert_type(codes, jnp.uint32),
                             jax.lax.bitcast_convert_type(dd, jnp.uint32)[..., None]], axis=-1)
    return MgpuQ4K(q=(q.astype(jnp.int8) - 8).astype(jnp.int4), scales=words.reshape(n, nb * SCALE_WORDS).T,
                   shape=(n, k))


def _fields(w: MgpuQ4K) -> tuple[jax.Array, jax.Array]:
    """(codes, dd): each sub-block's 6-bit (scale, min) [N, K / 256, 8, 2] and each super-block's (d, dmin)
    [N, K / 256, 2], float32."""
    n, k = w.shape
    words = w.scales.T.reshape(n, k // QK_K, SCALE_WORDS)
    codes = jax.lax.bitcast_convert_type(words[..., :-1], jnp.uint8).reshape(n, -1, SUB_BLOCKS // 2, 2, 2)
    codes = codes.swapaxes(-1, -2).reshape(n, -1, SUB_BLOCKS, 2)
    return codes.astype(jnp.float32), jax.lax.bitcast_convert_type(words[..., -1], jnp.float16).astype(jnp.float32)


def _scales(w: MgpuQ4K) -> tuple[jax.Array, jax.Array]:
    """Each sub-block's scale d sc and negated min -dmin m, float32 [N, K / 32]: w = q scale + neg_min."""
    codes, dd = _fields(w)
    scale, neg_min = (sign * dd[..., None, i] * codes[..., i] for i, sign in ((0, 1), (1, -1)))
    return scale.reshape(w.shape[0], -1), neg_min.reshape(w.shape[0], -1)


def _quants(w: MgpuQ4K) -> jax.Array:
    """The stored quants q - 8 [N, K / 32, 32] in column order, as int32."""
    return w.q.astype(jnp.int32).reshape(w.shape[0], -1, GROUP)[..., np.argsort(WGMMA_PERM)]


def f16_fits(w: MgpuQ4K) -> bool:
    """Whether every weight, scale and negated min times 2**F16_SHIFT stays under 2**15 in float16 (`f16_within`:
    15 |scale| + |neg_min| bounds them), and so do d and dmin, which the kernel scales in float16 too."""
    return bool(_f16_fits(w))


@jax.jit
def _f16_fits(w: MgpuQ4K) -> jax.Array:
    _, dd = _fields(w)
    return f16_within(15, _scales(w)) & (jnp.abs(dd).max() * 2.0 ** F16_SHIFT < 2 ** 15)


def dequantize(w: MgpuQ4K) -> jax.Array:
    """The weight [N, K] in float32, exactly the GGUF's Q4_K values (d sc q - dmin m)."""
    scale, neg_min = _scales(w)
    q = _quants(w).astype(jnp.float32) + 8
    return (q * scale[..., None] + neg_min[..., None]).reshape(w.shape)


def _f16(a: jax.Array) -> jax.Array:
    """float32 values rounded to float16 (subnormals kept), back as float32."""
    return a.astype(jnp.float16).astype(jnp.float32)


def f16_weights(w: MgpuQ4K) -> jax.Array:
    """The float16 weights [N, K] the kernel multiplies, times 2**F16_SHIFT: q scale + neg_min, the scale and
    negated min times 2**F16_SHIFT rounded once to float16 (as the kernel's f16x2 products of the codes and the
    scaled d, dmin make them) and each weight once (one fma)."""
    q = _quants(w).astype(jnp.float32) + 8
    scale, neg_min = (_f16(a * 2.0 ** F16_SHIFT) for a in _scales(w))
    return (q * scale[..., None] + neg_min[..., None]).reshape(w.shape).astype(jnp.float16)


def f16_product(x: jax.Array, weights: jax.Array) -> jax.Array:
    """x [M, K] rounded as the kernels take it (float16 times 2**-F16_SHIFT) times float16 weights [N, K] that carry
    a gain of 2**F16_SHIFT: [M, N] float32 (the Mosaic kernels' references)."""
    return jnp.einsum("mk,nk->mn", x_operand(x, "f16x2").astype(jnp.float32), weights.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def reference(x: jax.Array, w: MgpuQ4K) -> jax.Array:
    """x [M, K] @ W^T -> [M, N] float32, with x and the weights rounded as the kernel takes them."""
    return f16_product(x, f16_weights(w))


def default_splits(n: int, k: int, target: int = 2048) -> int:
    """Programs along K: 4 where they divide the super-blocks and keep row tiles x splits within `target`, else 2
    or 1. Four were the fastest of 1, 2 and 4 on the 27B's ffn_gate, ffn_down and attn_qkv at 16-32 tokens
    (scripts/results/mgpu_probe_splits_h200.txt, mgpu_probe_shapes_h200.txt)."""
    nb = k // QK_K
    for s in (4, 2):
        if nb % s == 0 and n // ROWS * s <= target:
            return s
    return 1


def f16_pair(low: float, high: float) -> int:
    """Two float16 values as the 32-bit word of an f16x2 constant, low half first."""
    return int(np.array([low, high], np.float16).view(np.uint32)[0])


# f16x2 (2**F16_SHIFT, -2**F16_SHIFT): d and dmin of a super-block times it are the factors of its scales and
# negated mins, in float16 (`_scaled_dd`)
GAIN_PAIR = f16_pair(2.0 ** F16_SHIFT, -2.0 ** F16_SHIFT)


def _scalar(reg):
    """A row vector's register (vector<1 x i32>, inside `inline_mgpu`) -> its i32."""
    return vector.extract(reg, [], [0])


def _scaled_dd(words, gain: int):
    """Each row's word (d, dmin) [rows] uint32 (a row vector) -> (d, -dmin) 2**F16_SHIFT as float16 pairs (exact:
    `f16_fits` keeps them finite), one f16x2 multiply a register by `gain` (an f16x2 constant: GAIN_PAIR; Q6_K's
    (d, d) word takes qmatmul_mgpu_q6k.GAIN_D)."""
    muls = f"mov.b32 k, {gain:#010x}; mul.rn.f16x2 $0, $1, k;"
    row = plgpu.Layout.WGMMA.reduce(1)

    @plgpu.inline_mgpu(arg_types=(row,), return_type=plgpu.ShapeDtypeStruct(words.shape, jnp.uint32, row))
    def scale(_, df):
        i32 = ir.IntegerType.get_signless(32)
        out = np.empty_like(df.registers)
        for idx, reg in np.ndenumerate(df.registers):
            pair = llvm.inline_asm(i32, [_scalar(reg)], f"{{ .reg .b32 k; {muls} }}", "=r,r")
            out[idx] = mu.bitcast(pair, reg.type)
        return fa.FragmentedArray(_registers=out, _layout=df.layout, _is_signed=False)

    return scale(words)


def _scale_pairs(word, dd, part: int, bias: int = 0x6400):
    """One row's sub-block scale and min codes, bytes part and part + 2 of `word` (i32), and its (d, -dmin)
    2**F16_SHIFT pair `dd` -> (scale, neg_min) as f16x2 (i32). A lop3 masks the two codes (shifted down a byte for
    part 1) and xors float16's `bias` over each: 0x6400 sets the exponent of 1024 (1024 + code, exact); 0x6480 also
    flips the sign bit of an int8 code (1152 + code, qmatmul_mgpu_q6k's scales). A sub takes the bias off and one
    f16x2 multiply makes both products, each rounded once as the reference (`f16_weights`) rounds them."""
    return llvm.inline_asm(
        ir.IntegerType.get_signless(32), [word, dd],
        f"""{{
        .reg .b32 t, k;
        {"shr.b32 t, $1, 8;" if part else "mov.b32 t, $1;"}
        lop3.b32 t, t, 0x00ff00ff, {bias * 0x10001:#010x}, 0x6a;
        mov.b32 k, {bias * 0x10001:#010x};
        sub.f16x2 t, t, k;
        mul.rn.f16x2 $0, t, $2;
        }}""",
        "=r,r,r")


# PTX that sets `s2` to (scale, scale) and `n2` to (neg_min, neg_min) from a `_scale_pairs` value in operand `{}`:
# moves between register halves, which ptxas folds into the fma's operand selectors
BROADCAST = """.reg .b16 sl, sh;
                .reg .b32 s2, n2;
                mov.b32 {{sl, sh}}, ${};
                mov.b32 s2, {{sl, sl}};
                mov.b32 n2, {{sh, sh}};"""


def _f16_tile_wgmma(q, word, dd, part: int):
    """q [64 r, 32] int4 as loaded (WGMMA_UPCAST_4X: a lane's 8 quants of a row in one 32-bit word, in WGMMA_PERM's
    order) -> float16 [64 r, 32] in WGMMA layout, (q ^ 8) scale + neg_min per row, the row's scale and min codes in
    `word` (bytes part, part + 2) and its (d, -dmin) pair in `dd` (`_scale_pairs`), with no data between lanes.

    The order puts each of the lane's four wgmma registers in two nibbles, t and t + 4 of the word. Per register, one
    lop3 masks them where they lie (bits 0-3 of each half: float16's exponent of 1024 makes 1024 + q; bits 4-7: an
    exponent of 64, whose unit there is 1/16, makes 64 + q) and flips the stored sign bit (the int4 holds q - 8); a
    sub takes the 1024 or 64 off and one fma applies the row's scale and negated min. One shift right by 8 serves
    registers 2 and 3."""
    wgmma, row = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)

    def weights(t: int) -> str:  # the PTX that makes register t's pair from word $1 and the scale pair $2
        mask, xor, magic = NIBBLE_FIELDS[t % 2]
        return f"""{BROADCAST.format(2)}
                    lop3.b32 u, $1, {mask:#010x}, {xor * 0x10001:#010x}, 0x6a;
                    mov.b32 k, {magic * 0x10001:#010x};
                    sub.f16x2 u, u, k;
                    fma.rn.f16x2 $0, u, s2, n2;"""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X, row, row),
                       return_type=plgpu.ShapeDtypeStruct(q.shape, jnp.float16, wgmma))
    def convert(_, qf, wf, df):
        i32 = ir.IntegerType.get_signless(32)
        f16x2 = ir.VectorType.get((2,), ir.F16Type.get())

        out = np.empty(fa.WGMMA_LAYOUT.registers_shape(q.shape), dtype=object)  # [row tiles, 4 col tiles, 1, 1, 2,..]
        # row tile i, half h: a lane holds rows r and r + 8 of its warp's 16 in each tile of 64
        for i, h in np.ndindex(q.shape[0] // ROWS, 2):
            pair = _scale_pairs(_scalar(wf.registers[i, 0, h, 0, 0]), _scalar(df.registers[i, 0, h, 0, 0]), part)
            word = mu.bitcast(qf.registers[i, 0, 0, 0, h, 0, 0, 0, 0], i32)
            halves = (word, arith.shrui(word, mu.c(8, i32)))
            for t in range(4):
                reg = llvm.inline_asm(i32, [halves[t // 2], pair], f"{{ .reg .b32 u, k; {weights(t)} }}", "=r,r,r")
                out[i, t, 0, 0, h, 0, 0, 0, 0] = mu.bitcast(reg, f16x2)
        return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return convert(q, word, dd)


def _multiply(w_smem, x_smem, scales_smem, acc_ref) -> None:
    """One pipeline step: the step's super-block of weights, converted and multiplied a sub-block (one wgmma call)
    at a time, times x^T into acc."""
    row = plgpu.Layout.WGMMA.reduce(1)  # a vector over the tile's rows, as wgmma's accumulator holds them
    dd = _scaled_dd(plgpu.load(scales_smem.at[SCALE_WORDS - 1], (), layout=row), GAIN_PAIR)
    words = [plgpu.load(scales_smem.at[i], (), layout=row) for i in range(SCALE_WORDS - 1)]
    quants = plgpu.load(w_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
    for j in range(SUB_BLOCKS):
        part = slice(j * GROUP, (j + 1) * GROUP)
        plgpu.wgmma(acc_ref, _f16_tile_wgmma(quants[:, part], words[j // 2], dd, j % 2), x_smem.at[:, part].T)
        plgpu.wgmma_wait(1)


def _specs(t: int, at) -> list:
    """The pipeline's inputs (quants, x, scales) at step i, whose (row tile, super-block) is `at(i)`."""
    return [plgpu.BlockSpec((ROWS, QK_K), lambda i: at(i), delay_release=1,
                            transforms=(plgpu.TilingTransform((8, QK_K)), plgpu.SwizzleTransform(128))),
            # 64-byte swizzle: x's 32-column slices (one sub-block) are whole swizzle tiles for wgmma's B
            plgpu.BlockSpec((t, QK_K), lambda i: (0, at(i)[1]), delay_release=1,
                            transforms=(plgpu.TilingTransform((8, GROUP)), plgpu.SwizzleTransform(64))),
            plgpu.BlockSpec((SCALE_WORDS, ROWS), lambda i: at(i)[::-1], delay_release=1)]


def _body(t: int, steps: int, stages: int, multiply, extra_specs: tuple, starts: tuple[int, ...], *refs):
    """A program per (row tile, K split), `steps` super-blocks each, over the row tiles of one or more weights side
    by side (weight j's first tile is `starts[j]`). `refs`: x in GMEM, each weight's quants, scales and further
    inputs (`extra_specs`), the output [splits, t, N] (the weights' rows in order), its SMEM tile [t, 64];
    `multiply(*input_smem, acc_ref)` one step. A program computes what it computes for that weight alone."""
    x_gmem, *fields, o_gmem, o_smem = refs
    ni, si = jax.lax.axis_index("n"), jax.lax.axis_index("k")
    per = len(fields) // len(starts)

    def program(start: int, quants, scales, *extra):
        at = lambda i: (ni - start, si * steps + i)  # noqa: E731

        def compute(acc_ref):
            plgpu.emit_pipeline(lambda _, *smem: multiply(*smem, acc_ref), grid=(steps,),
                                in_specs=_specs(t, at) + [spec(t, at) for spec in extra_specs],
                                max_concurrent_steps=stages)(quants, x_gmem, scales, *extra)
            return acc_ref[...]

        acc = pl.run_scoped(compute, plgpu.ACC((ROWS, t), jnp.float32))
        # tokens-major out: XLA's sum of the splits is then elementwise into the consumer, no transpose launch; the
        # transposed layout makes the store into the transposed tile legal (a shuffle between lane pairs)
        o_smem.T[...] = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, :, pl.ds(ni * ROWS, ROWS)])
        plgpu.wait_smem_to_gmem(0)

    if len(starts) == 1:
        program(0, *fields)
        return
    for j, start in enumerate(starts):
        mine = ni >= start if j + 1 == len(starts) else (ni >= start) & (ni < starts[j + 1])
        pl.when(mine)(functools.partial(program, start, *fields[j * per:(j + 1) * per]))


def grid_product(x_operand: jax.Array, weights: tuple[tuple[jax.Array, ...], ...], multiply, *, m: int,
                 rows: tuple[int, ...], blocks: int, splits: int | None, stages: int, name: str,
                 extra_specs: tuple = ()) -> list[jax.Array]:
    """The kernel (`_body`) on x^T's operand (t >= m tokens, `x_tokens`) and one or more weights of the same K, each
    its fields (quants, scales, then the inputs of `extra_specs`, each (t, at) -> its BlockSpec) and `rows` rows: in
    one launch, each weight's product [m, rows] float32, a program per 64 rows and K split, `splits` (default
    `default_splits`, which must agree over the weights) dividing the `blocks` super-blocks, the partial products
    added by XLA. Each product is bit for bit the one its weight alone gives."""
    chosen = {splits or default_splits(n, blocks * QK_K) for n in rows}
    if len(chosen) > 1:
        raise ValueError(f"weights of {rows} rows take different default K splits {sorted(chosen)}: pass `splits`")
    splits = chosen.pop()
    if blocks % splits:
        raise ValueError(f"{blocks} super-blocks do not split {splits} ways")
    starts = tuple(int(s) // ROWS for s in np.cumsum((0,) + tuple(rows[:-1])))
    n, t = sum(rows), x_operand.shape[0]
    body = functools.partial(_body, t, blocks // splits, stages, multiply, tuple(extra_specs), starts)
    out = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((splits, t, n), jnp.float32),
                       grid=(n // ROWS, splits), grid_names=("n", "k"),
                       scratch_types=[plgpu.SMEM((t, ROWS), jnp.float32)],
                       kernel_name=name)(x_operand, *(a for w in weights for a in w))
    whole = sum_splits(out, m, n)  # out is [splits, tokens, N]
    return jnp.split(whole, np.cumsum(rows[:-1]), axis=1) if len(rows) > 1 else [whole]


def x_tokens(x: jax.Array, shape: tuple[int, int]) -> tuple[int, jax.Array]:
    """(t, x^T's operand): x [M, K] checked against a weight of `shape` [N, K] and 1 <= M <= M_MAX, as float16
    times 2**-F16_SHIFT, zero-padded to t, a multiple of 8 tokens (wgmma's N)."""
    m, k = x.shape
    if k != shape[1]:
        raise ValueError(f"x has {k} columns, the weight {shape[1]}")
    if not 1 <= m <= M_MAX:
        raise ValueError(f"the Mosaic GPU kernel takes 1 to {M_MAX} rows of x, got {m}")
    t = -(-m // 8) * 8
    return t, jnp.zeros((t, k), jnp.float16).at[:m].set(x_operand(x, "f16x2"))


@functools.partial(jax.jit, static_argnames=("splits", "stages"))
def qmatmul(x: jax.Array, w: MgpuQ4K, *, splits: int | None = None, stages: int = STAGES) -> jax.Array:
    """x [M, K] @ W^T -> [M, N] float32 for M <= 64 (padded to a multiple of 8 tokens), on a Hopper GPU: a program
    per 64 weight rows and K split (`splits`, default `default_splits`), `stages` pipeline steps in flight."""
    return qmatmul_many(x, (w,), splits=splits, stages=stages)[0]


@functools.partial(jax.jit, static_argnames=("splits", "stages"))
def qmatmul_many(x: jax.Array, ws: tuple[MgpuQ4K, ...], *, splits: int | None = None, stages: int = STAGES
                 ) -> list[jax.Array]:
    """[x @ W^T for W in ws] in one launch (weights of one K, e.g. an MLP's gate and up): each product bit for bit
    `qmatmul`'s, their programs in one grid (`grid_product`), so one launch's ramp and tail instead of several."""
    if len({w.shape[1] for w in ws}) > 1:
        raise ValueError(f"the weights of one launch share K, got {[w.shape for w in ws]}")
    _, xt = x_tokens(x, ws[0].shape)
    return grid_product(xt, tuple((w.q, w.scales) for w in ws), _multiply, m=x.shape[0],
                        rows=tuple(w.shape[0] for w in ws), blocks=x.shape[1] // QK_K, splits=splits, stages=stages,
                        name="qmatmul_mgpu_q4_k")
