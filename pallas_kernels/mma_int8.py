"""Products of 2-64 tokens with int8 activations on the tensor cores: Q4_K weights times x quantized per super-block.

The tensor-core kernel (qmatmul's `_kernel`) turns every quant into a bf16 weight before its product: about 7.4 SASS
instructions per weight at 32 rows of x, which bounds it by instruction issue, not by memory (0.2-0.4 of the copy
rate; scripts/results/qmatmul_sass_cpu.txt). Here the quants enter the tensor cores as they are, as llama.cpp's
MMQ does: x is quantized to int8 with one float scale per row and super-block (256 columns, as llama.cpp's q8_K;
`quantize_rows`), each 32-column sub-block's 4-bit quants (a nibble mask of the packed bytes) multiply x's int8
quants in one int8 product with int32 sums, and the weight's 6-bit sub-block scales and mins are applied to those
sums in int32; each super-block's float scales (the weight's d and dmin per row, x's per token) once per output.
The product is exact for the quantized x (`mma_int8_reference`, to float32 rounding); against x itself it carries
int8's rounding (0.7 % on Gaussian x).

It takes 4.8 SASS instructions per weight at 23 tokens against the bf16 kernel's 7.4, but on an H100 it is no faster
(1.0-1.3x slower by kernel time; scripts/results/mma_int8_h100.txt): Nsight Compute finds its warps waiting on the
many small loads of 8 products of K = 32 per super-block (scripts/results/mma_int8_ncu_h100.txt). So qmatmul takes
it only when asked (`int8_mma=True`; README, "Int8 activations on the tensor cores").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dflash_jax.quant import QK_K
from pallas_kernels.gemv_int8 import quantize_groups
from pallas_kernels.qmatmul import INT8_MMA_FORMATS as FORMATS
from pallas_kernels.qmatmul import PackedWeight, dequantize_packed, prefetch_loop, sum_splits
from pallas_kernels.tiles import dot_tile

SUB = 32  # columns per Q4_K sub-block: one int8 product's K


def quantize_rows(x: jax.Array) -> dict[str, jax.Array]:
    """x [M, K] (rounded to bf16 first, as the other kernels take it) as int8 quants `q` [M, K] with a float32
    `scale` [M, K / 256] per row and super-block (its largest |x| maps to 127, rounded half up), and each 32-column
    sub-block's quant sum `qsum` [M, K / 32] (int32)."""
    m, k = x.shape
    q, scale = quantize_groups(x.astype(jnp.bfloat16).astype(jnp.float32).reshape(m, k // QK_K, QK_K))
    return {"q": q.reshape(m, k).astype(jnp.int8), "scale": scale,
            "qsum": jnp.sum(q.reshape(m, k // SUB, SUB), axis=-1)}


def dequantized_rows(x: jax.Array) -> jax.Array:
    """x [M, K] as the kernel sees it: its int8 quants times their super-block's scale."""
    xq = quantize_rows(x)
    m, k = x.shape
    return (xq["q"].astype(jnp.float32).reshape(m, k // QK_K, QK_K) * xq["scale"][..., None]).reshape(m, k)


def mma_int8_reference(x: jax.Array, pw: PackedWeight) -> jax.Array:
    """x [M, K] @ W^T -> [M, N] float32 for x as the kernel quantizes it (`dequantized_rows`)."""
    return jnp.einsum("mk,nk->mn", dequantized_rows(x), dequantize_packed(pw), precision=jax.lax.Precision.HIGHEST)


def _nibbles(qs: jax.Array, nib: int, asm: bool) -> jax.Array:
    """The low (nib 0) or high (1) nibble of each byte of qs (uint8) as int8: by inline PTX on 4 bytes a register
    (`asm`, GPU only) or in jnp."""
    if asm:
        code = ("and.b32 $0, $1, 0x0F0F0F0F;" if nib == 0 else
                "{\n.reg .b32 t;\nshr.u32 t, $1, 4;\nand.b32 $0, t, 0x0F0F0F0F;\n}")
        return plt.elementwise_inline_asm(code, args=[qs], constraints="=r,r", pack=4,
                                          result_shape_dtypes=[jax.ShapeDtypeStruct(qs.shape, jnp.int8)])[0]
    return ((qs.astype(jnp.int32) >> (4 * nib)) & 0xF).astype(jnp.int8)


def _kernel(n: int, steps: int, block_n: int, asm: bool, prefetch: int, xq_ref, xs_ref, xmin_ref, qs_ref, sc_ref,
            mn_ref, d_ref, dmin_ref, o_ref):
    r0, split = pl.program_id(0) * block_n, pl.program_id(1)
    rows = pl.ds(r0, block_n)
    row_ok = (r0 + jnp.arange(block_n)) < n
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    first = (jnp.arange(16) < 8)[None]  # a super-block's 8 sub-blocks of a 16-wide load (the rest never read)

    def load(i, valid):  # super-block i's tiles; rows past N (and every row where `valid` is False) read zeros
        u = split * steps + i
        ok = row_ok if valid is None else row_ok & valid

        def get(ref, *idx, cols_ok=None):
            scalars = sum(not isinstance(j, (slice, pl.Slice)) for j in idx)
            mask = ok.reshape((block_n,) + (1,) * (len(ref.shape) - 1 - scalars))
            mask = mask if cols_ok is None else mask & cols_ok
            idx = tuple(jnp.int32(j) if isinstance(j, int) else j for j in idx)
            return plt.load(ref.at[(rows, *idx)], mask=mask, other=0, eviction_policy="evict_first")

        return {"qs": [get(qs_ref, u, p, slice(None)) for p in range(4)],  # [rows, 32]: sub-blocks 2p and 2p + 1
                "sc": [[get(sc_ref, u, nib, p) for p in range(4)] for nib in range(2)],
                "mn": get(mn_ref, pl.ds(u * 8, 16), cols_ok=first), "d": get(d_ref, u), "dmin": get(dmin_ref, u),
                "x": [xq_ref[:, pl.ds(u * QK_K + SUB * j, SUB)] for j in range(8)],  # [M, 32] int8 each
                "xs": xs_ref[:, u], "xmin": plt.load(xmin_ref.at[:, pl.ds(u * 8, 16)], mask=first, other=0)}

    def compute(t, acc):
        main = jnp.zeros(acc.shape, jnp.int32)  # sum over sub-blocks j of sc_j * (x quants . weight quants)
        for p in range(4):
            for nib in range(2):
                dot = jax.lax.dot_general(t["x"][2 * p + nib], _nibbles(t["qs"][p], nib, asm),
                                          (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
                main = main + dot * t["sc"][nib][p].astype(jnp.int32)[None]
        # the mins' share, sum_j (dmin mn_j)[row] (x scale * quant sum of sub-block j)[token], as one product of
        # K = 16 (the super-block's 8 sub-blocks and 8 zeros: the tensor cores take no fewer), in TF32
        mins = f32(t["dmin"])[:, None] * f32(t["mn"])
        acc = acc - jax.lax.dot_general(t["xmin"], mins, (((1,), (1,)), ((), ())),
                                        precision=jax.lax.Precision.DEFAULT, preferred_element_type=jnp.float32)
        return acc + t["xs"][:, None] * f32(t["d"])[None] * f32(main)

    acc = prefetch_loop(load, compute, steps, jnp.zeros((xq_ref.shape[0], block_n), jnp.float32), prefetch)
    o_ref[split, :, rows] = acc


@functools.partial(jax.jit, static_argnames=("block_n", "splits", "num_warps", "num_stages", "asm", "prefetch",
                                             "interpret"))
def mma_int8(x: jax.Array, pw: PackedWeight, *, block_n: int = 64, splits: int = 1, num_warps: int = 4,
             num_stages: int = 3, asm: bool | None = None, prefetch: int = 0, interpret: bool = False) -> jax.Array:
    """x [M, K] @ W^T -> [M, N] float32 for a Q4_K PackedWeight, x quantized to int8 per row and super-block
    (`quantize_rows`, by XLA ops before the kernel); K is split over `splits` programs per row tile."""
    m, k = x.shape
    n, kw = pw.shape
    if pw.fmt not in FORMATS:
        raise ValueError(f"no int8 tensor-core product for {pw.fmt} (it takes {', '.join(FORMATS)})")
    if k != kw:
        raise ValueError(f"x has {k} columns, the weight {kw}")
    nb = k // QK_K
    if nb % splits:
        raise ValueError(f"{nb} super-blocks do not split {splits} ways")
    asm = not interpret if asm is None else asm
    if asm and interpret:
        raise ValueError("inline PTX (asm=True) runs only on a GPU, not in interpret mode")
    m_pad = dot_tile(m)
    xq = quantize_rows(x)
    # per sub-block, x's scale times its quant sum, in the order of the mins [super-block, nib, p]
    xmin = (xq["scale"][..., None] * xq["qsum"].reshape(m, nb, 8)).reshape(m, nb, 4, 2).transpose(0, 1, 3, 2)
    pad = lambda a: jnp.zeros((m_pad,) + a.shape[1:], a.dtype).at[:m].set(a)  # noqa: E731
    tiles = pl.cdiv(n, block_n)
    w = pw.data
    out = pl.pallas_call(
        functools.partial(_kernel, n, nb // splits, block_n, asm, prefetch),
        out_shape=jax.ShapeDtypeStruct((splits, m_pad, tiles * block_n), jnp.float32),
        grid=(tiles, splits),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="mma_int8_q4_k",
    )(pad(xq["q"]), pad(xq["scale"]), pad(xmin.reshape(m, nb * 8)), w["qs"], w["sc"], w["mn"].reshape(n, nb * 8),
      w["d"], w["dmin"])
    return sum_splits(out, m, n)
