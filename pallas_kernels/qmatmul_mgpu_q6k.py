"""Q6_K weights times 2-64 tokens on Hopper, in Mosaic GPU: qmatmul_mgpu's kernel for Q6_K (ffn_down and attn_qkv
where llama.cpp's Q4_K_M gives them more bits, and the output head).

Layout (`MgpuQ6K`, repacked once from the GGUF's Q6_K by `pack`): each 6-bit quant q (0..63) split into its low
nibble, stored as qmatmul_mgpu stores Q4_K's quants (int4 lo - 8 [N, K] in the order of wgmma's registers,
`WGMMA_PERM`), and its high two bits, 16 to a 32-bit word in `hi` [N, K / 2] int4: per row and 64 columns, the word
lane c of a row's four loads (Mosaic GPU's WGMMA_UPCAST_4X layout) holds the high bits of its 16 quants, placed so
that four shifts of it (`HI_VIEWS`) bring each of its 8 wgmma registers' pairs to where the float16 conversion
wants them; per super-block the 16 int8 sub-block scales and d (float16) as `scales` [K / 256 x 5, N] uint32 (four
words of scales, then d twice). 6.625 bits a weight, 1 % over the GGUF's 6.5625.

Per pipeline step (one super-block) and 64-column chunk, the warpgroup makes each float16 pair (two weights) of
its wgmma operand with two lop3 (the low nibbles under float16's exponent of 1024 or 64 with the int4's sign bit
flipped, then the high bits or'ed in), a sub (1024 + 32, or 64 + 32: q - 32, exact) and one f16x2 multiply by the
sub-block's scale, d sc 2**F16_SHIFT rounded once to float16 (a lop3, a sub and a multiply per two sub-blocks,
qmatmul_mgpu's `_scale_pairs`): each weight rounded once to float16, as `f16_weights`, the reference's, says.

GPU only (Hopper), as qmatmul_mgpu: the CPU tests check the layout, the bit operations (emulated in numpy) and
the reference, and that the kernel lowers for CUDA; on an H100 it matches its reference at the 27B's Q6_K shapes
and is 1.7-2.3x faster than the Triton kernel (scripts/results/qmatmul_mgpu_q6k_h100.txt). `qmatmul.pack` gives Q6_K
weights this layout with mgpu="beside" or "only".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import utils as mu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

from pallas_kernels.ggml import QK_K, q6_k_quants
from pallas_kernels.qcommon import F16_SHIFT, f16_within
from pallas_kernels.qmatmul_mgpu import (GROUP, NIBBLE_FIELDS, ROWS, SCALE_WORDS, STAGES, WGMMA_PERM, _scalar,
                                         _scale_pairs, _scaled_dd, checked_layout, f16_product, grid_product,
                                         x_tokens)

SUB = 16  # columns of a Q6_K sub-block (one int8 scale): half a 32-column group, one wgmma of K = 16
CHUNK = 2 * GROUP  # columns whose high bits one 32-bit word of `hi` holds for a lane
# HI_SLOT[g, t]: the 2-bit slot (of 8 in each half-word) that holds the high bits of register t of group g of a
# 64-column chunk; HI_VIEWS[v]: the left shift (negative: right) that brings slots to bits 4-5 (for registers t =
# 0, 2, whose low nibbles sit at bits 0-3: float16's unit 1 there, so the high bits weigh 16) and 8-9 (t = 1, 3,
# low nibbles at bits 4-7 under an exponent of 64, unit 1/16: the same weights); view v = 2 g + t // 2 serves both
HI_SLOT = np.array([[0, 2, 1, 3], [4, 6, 5, 7]])
HI_VIEWS = (4, 2, -4, -6)
HI_MASKS = (0x00300030, 0x03000300)  # bits 4-5 or 8-9 of each half-word, by t % 2
# float16 pairs 1024 + 32 and 64 + 32: what the sub takes off 1024 + q or 64 + q to leave q - 32, by t % 2
OFFSETS = (0x64206420, 0x56005600)
# float16 1152 (1024 + 128), whose bits xored over an int8 scale make 1152 + sc (`_scale_pairs`)
SCALE_BIAS = 0x6480
# f16x2 (2**F16_SHIFT, 2**F16_SHIFT): d (the scales' word holds it twice) times it, by `_scaled_dd`
GAIN_D = int(np.array([2.0 ** F16_SHIFT] * 2, np.float16).view(np.uint32)[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MgpuQ6K:
    """A Q6_K weight [N, K] in this kernel's layout (module docstring)."""

    lo: jax.Array  # [N, K] int4: the low nibbles minus 8, each 32-column group in WGMMA_PERM's order
    hi: jax.Array  # [N, K / 2] int4: the high two bits (`pack`)
    # [K / 256 * 5, N] uint32: per super-block, word w < 4 the int8 scales of sub-blocks 4w, 4w + 2, 4w + 1, 4w + 3
    # (low byte first), word 4 d twice (float16)
    scales: jax.Array
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))

    @property
    def nbytes(self) -> int:
        return self.lo.size // 2 + self.hi.size // 2 + self.scales.size * 4


def _as_int4(nibbles: jax.Array) -> jax.Array:
    """Bit patterns 0..15 as the int4 values that hold them (two's complement)."""
    v = nibbles.astype(jnp.int8)
    return jnp.where(v >= 8, v - 16, v).astype(jnp.int4)


def _hi_words(hi: jax.Array) -> jax.Array:
    """The high bits [N, K] (0..3) -> `MgpuQ6K.hi` [N, K / 2] int4: per row, chunk of 64 columns and lane c, the
    word of nibbles 8c..8c+7 holds at bits 16 e + 2 HI_SLOT[g, t] the high bits of column 32 g + 8 t + 2 c + e.
    Built nibble by nibble in bytes (the output head's 1.3 G weights would take 5 GB as 32-bit words)."""
    n, k = hi.shape
    hi = hi.astype(jnp.uint8).reshape(n, k // CHUNK, 2, 4, 4, 2)  # [row, chunk, g, t, c, e]
    owner = {int(HI_SLOT[g, t]): (g, t) for g, t in np.ndindex(HI_SLOT.shape)}  # slot -> its register

    def nibble(p: int) -> jax.Array:  # bits 4p..4p+3: slots 2 (p % 4) and 2 (p % 4) + 1 of half p // 4
        (g0, t0), (g1, t1) = owner[2 * (p % 4)], owner[2 * (p % 4) + 1]
        return hi[:, :, g0, t0, :, p // 4] | (hi[:, :, g1, t1, :, p // 4] << 2)  # [row, chunk, c]

    return _as_int4(jnp.stack([nibble(p) for p in range(8)], axis=-1).reshape(n, k // 2))


def _hi_bits(w: MgpuQ6K) -> jax.Array:
    """`_hi_words`' inverse: the high bits [N, K] (0..3) in column order, as int32."""
    n, k = w.shape
    nibbles = w.hi.astype(jnp.int32).reshape(n, k // CHUNK, 4, 8) & 0xF
    words = jnp.sum(nibbles << (4 * jnp.arange(8)), axis=-1)  # [row, chunk, c]
    shift = 16 * np.arange(2)[None, None, :] + 2 * HI_SLOT[:, :, None]  # [g, t, e]
    bits = (words[:, :, None, None, :, None] >> shift[None, None, :, :, None, :]) & 3  # [row, chunk, g, t, c, e]
    return bits.reshape(n, k)


def pack(fmt: str, shape: tuple[int, int], data: dict[str, jax.Array]) -> MgpuQ6K:
    """A Q6_K weight [N, K] (its GGUF block fields `data`, as dflash_jax's QTensor holds them) in this kernel's layout,
    once, at load; refuses other formats, rows not a multiple of 64 and weights whose float16 form would overflow
    (`f16_fits`)."""
    if fmt != "Q6_K":
        raise NotImplementedError(f"qmatmul_mgpu_q6k takes Q6_K weights, not {fmt} (qmatmul_mgpu takes Q4_K)")
    return checked_layout(fmt, shape, data, _layout, f16_fits)


@functools.partial(jax.jit, static_argnums=0)
def _layout(shape: tuple[int, int], f: dict[str, jax.Array]) -> MgpuQ6K:
    """`pack`'s repacking, one compiled program per shape (as qmatmul_mgpu's)."""
    n, k = shape
    nb = k // QK_K
    q = q6_k_quants(f["ql"].reshape(n, nb, 128), f["qh"].reshape(n, nb, 64)).reshape(n, k)
    lo = (q & 0xF).reshape(n, k // GROUP, GROUP)[..., WGMMA_PERM].reshape(n, k)
    codes = jax.lax.bitcast_convert_type(f["scales"].reshape(n, nb, 4, 2, 2), jnp.uint8)  # [.., w, pair, half]
    codes = codes.swapaxes(-1, -2).reshape(n, nb, 4, 4)  # bytes: sub-blocks 4w, 4w + 2, 4w + 1, 4w + 3
    d = f["d"].reshape(n, nb).astype(jnp.float16)
    words = jnp.concatenate([jax.lax.bitcast_convert_type(codes, jnp.uint32),
                             jax.lax.bitcast_convert_type(jnp.stack([d, d], -1), jnp.uint32)[..., None]], axis=-1)
    return MgpuQ6K(lo=(lo.astype(jnp.int8) - 8).astype(jnp.int4), hi=_hi_words(q >> 4),
                   scales=words.reshape(n, nb * SCALE_WORDS).T, shape=(n, k))


def _fields(w: MgpuQ6K) -> tuple[jax.Array, jax.Array]:
    """(scales, d): each sub-block's int8 scale [N, K / 16] and each super-block's d [N, K / 256], float32."""
    n, k = w.shape
    words = w.scales.T.reshape(n, k // QK_K, SCALE_WORDS)
    codes = jax.lax.bitcast_convert_type(words[..., :-1], jnp.int8).reshape(n, -1, 4, 2, 2).swapaxes(-1, -2)
    d = jax.lax.bitcast_convert_type(words[..., -1], jnp.float16)[..., 0]
    return codes.reshape(n, -1).astype(jnp.float32), d.astype(jnp.float32)


def _scales(w: MgpuQ6K) -> jax.Array:
    """Each sub-block's scale d sc, float32 [N, K / 16]: w = (q - 32) scale."""
    sc, d = _fields(w)
    return (sc.reshape(*d.shape, -1) * d[..., None]).reshape(sc.shape)


def _quants(w: MgpuQ6K) -> jax.Array:
    """q - 32 [N, K] in column order, as int32."""
    lo = w.lo.astype(jnp.int32).reshape(w.shape[0], -1, GROUP)[..., np.argsort(WGMMA_PERM)].reshape(w.shape) + 8
    return lo + 16 * _hi_bits(w) - 32


def f16_fits(w: MgpuQ6K) -> bool:
    """Whether every weight and scale times 2**F16_SHIFT stays under 2**15 in float16 (32 |scale| bounds the
    weights), and so does d, which the kernel scales in float16 too."""
    return bool(_f16_fits(w))


@jax.jit
def _f16_fits(w: MgpuQ6K) -> jax.Array:
    scale = _scales(w)
    _, d = _fields(w)
    return f16_within(32, (scale, jnp.zeros_like(scale))) & (jnp.abs(d).max() * 2.0 ** F16_SHIFT < 2 ** 15)


def dequantize(w: MgpuQ6K) -> jax.Array:
    """The weight [N, K] in float32, exactly the GGUF's Q6_K values (d sc (q - 32))."""
    return (_quants(w).astype(jnp.float32).reshape(w.shape[0], -1, SUB) * _scales(w)[..., None]).reshape(w.shape)


def f16_weights(w: MgpuQ6K) -> jax.Array:
    """The float16 weights [N, K] the kernel multiplies: (q - 32) scale, the scale times 2**F16_SHIFT rounded once to
    float16 (the kernel's f16x2 product of the code and the scaled d) and each weight once (one multiply)."""
    scale = jnp.asarray(_scales(w) * 2.0 ** F16_SHIFT, jnp.float16).astype(jnp.float32)
    q = _quants(w).astype(jnp.float32).reshape(w.shape[0], -1, SUB)
    return (q * scale[..., None]).reshape(w.shape).astype(jnp.float16)


def reference(x: jax.Array, w: MgpuQ6K) -> jax.Array:
    """x [M, K] @ W^T -> [M, N] float32, with x and the weights rounded as the kernel takes them."""
    return f16_product(x, f16_weights(w))


def _f16_tile_q6k(lo, hi, word, d, group: int):
    """A 32-column group, group `group` (0, 1) of a 64-column chunk: its low nibbles lo [64 r, 32] int4 as loaded
    (WGMMA_UPCAST_4X), its chunk's high bits hi [64 r, 32] int4 as loaded, the rows' scale word of the chunk and
    (d, d) pair -> float16 [64 r, 32] in WGMMA layout, (q - 32) scale per row and sub-block (module docstring)."""
    wgmma, row = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X, plgpu.Layout.WGMMA_UPCAST_4X, row, row),
                       return_type=plgpu.ShapeDtypeStruct(lo.shape, jnp.float16, wgmma))
    def convert(_, lf, hf, wf, df):
        i32 = ir.IntegerType.get_signless(32)
        f16x2 = ir.VectorType.get((2,), ir.F16Type.get())

        out = np.empty(fa.WGMMA_LAYOUT.registers_shape(lo.shape), dtype=object)
        # row tile i, half h: a lane holds rows r and r + 8 of its warp's 16 in each tile of 64
        for i, h in np.ndindex(lo.shape[0] // ROWS, 2):
            pair = _scale_pairs(_scalar(wf.registers[i, 0, h, 0, 0]), _scalar(df.registers[i, 0, h, 0, 0]),
                                group, bias=SCALE_BIAS)
            word = mu.bitcast(lf.registers[i, 0, 0, 0, h, 0, 0, 0, 0], i32)
            halves = (word, arith.shrui(word, mu.c(8, i32)))
            high = mu.bitcast(hf.registers[i, 0, 0, 0, h, 0, 0, 0, 0], i32)
            views = [arith.shli(high, mu.c(s, i32)) if s > 0 else arith.shrui(high, mu.c(-s, i32))
                     for s in HI_VIEWS[2 * group: 2 * group + 2]]
            for t in range(4):
                mask, xor, _ = NIBBLE_FIELDS[t % 2]
                reg = llvm.inline_asm(
                    i32, [halves[t // 2], views[t // 2], pair],
                    f"""{{
                    .reg .b32 u, k, s2;
                    .reg .b16 sl, sh;
                    mov.b32 {{sl, sh}}, $3;
                    mov.b32 s2, {{{"sl, sl" if t < 2 else "sh, sh"}}};
                    lop3.b32 u, $1, {mask:#010x}, {xor * 0x10001:#010x}, 0x6a;
                    lop3.b32 u, u, $2, {HI_MASKS[t % 2]:#010x}, 0xf8;
                    mov.b32 k, {OFFSETS[t % 2]:#010x};
                    sub.f16x2 u, u, k;
                    mul.rn.f16x2 $0, u, s2;
                    }}""",
                    "=r,r,r,r")
                out[i, t, 0, 0, h, 0, 0, 0, 0] = mu.bitcast(reg, f16x2)
        return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return convert(lo, hi, word, d)


def _multiply(lo_smem, x_smem, scales_smem, hi_smem, acc_ref) -> None:
    """One pipeline step: the step's super-block of weights, converted and multiplied 32 columns (one wgmma call) at
    a time, times x^T into acc."""
    row = plgpu.Layout.WGMMA.reduce(1)
    d = _scaled_dd(plgpu.load(scales_smem.at[SCALE_WORDS - 1], (), layout=row), GAIN_D)
    words = [plgpu.load(scales_smem.at[i], (), layout=row) for i in range(SCALE_WORDS - 1)]
    lo = plgpu.load(lo_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
    hi = plgpu.load(hi_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
    for j in range(QK_K // GROUP):
        chunk = j // 2  # the 64-column chunk this group lies in
        part = slice(j * GROUP, (j + 1) * GROUP)
        a = _f16_tile_q6k(lo[:, part], hi[:, chunk * GROUP: (chunk + 1) * GROUP], words[chunk], d, j % 2)
        plgpu.wgmma(acc_ref, a, x_smem.at[:, part].T)
        plgpu.wgmma_wait(1)


def _hi_spec(t: int, at) -> plgpu.BlockSpec:
    """The high bits' [64, 128] int4 tile of step i, beside qmatmul_mgpu's inputs (`grid_product`)."""
    del t
    return plgpu.BlockSpec((ROWS, QK_K // 2), at, delay_release=1,
                           transforms=(plgpu.TilingTransform((8, QK_K // 2)), plgpu.SwizzleTransform(64)))


@functools.partial(jax.jit, static_argnames=("splits", "stages"))
def qmatmul(x: jax.Array, w: MgpuQ6K, *, splits: int | None = None, stages: int = STAGES) -> jax.Array:
    """x [M, K] @ W^T -> [M, N] float32 for M <= 64 (padded to a multiple of 8 tokens), on a Hopper GPU: a program
    per 64 weight rows and K split (`splits`, default qmatmul_mgpu.default_splits; `grid_product`), `stages` steps in
    flight."""
    return qmatmul_many(x, (w,), splits=splits, stages=stages)[0]


@functools.partial(jax.jit, static_argnames=("splits", "stages"))
def qmatmul_many(x: jax.Array, ws: tuple[MgpuQ6K, ...], *, splits: int | None = None, stages: int = STAGES
                 ) -> list[jax.Array]:
    """[x @ W^T for W in ws] in one launch, each bit for bit `qmatmul`'s (qmatmul_mgpu.qmatmul_many)."""
    if len({w.shape[1] for w in ws}) > 1:
        raise ValueError(f"the weights of one launch share K, got {[w.shape for w in ws]}")
    _, xt = x_tokens(x, ws[0].shape)
    return grid_product(xt, tuple((w.lo, w.scales, w.hi) for w in ws), _multiply, m=x.shape[0],
                        rows=tuple(w.shape[0] for w in ws), blocks=x.shape[1] // QK_K, splits=splits, stages=stages,
                        name="qmatmul_mgpu_q6_k", extra_specs=(_hi_spec,))
