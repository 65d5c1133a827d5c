"""One-token products with int8 activations: Q4_K/Q6_K weights times x quantized per weight group, by dp4a.

The float GEMV (qmatmul_triton's `_gemv_kernel`) spent 5.75-11.6 instructions per weight turning quants into floats
(scripts/results/qmatmul_sass_cpu.txt). Here x is quantized instead, as llama.cpp's MMVQ does: each group of
weights that shares a scale (Q4_K: 32, Q6_K: 16) gets an int8 copy of its activations and one float scale, made by
each program for its own K steps (`quantize_groups`). The kernel reads the quants as 32-bit words of 4 bytes (a free
bitcast of the packed layout), isolates each plane's 4 quants in a word with a shift and a mask and multiplies them
with 4 int8 activations by one dp4a (`dots`), sums a group's dots in int32 and applies the group's scales once:
2.3-6.6 SASS instructions per weight (fewer with more rows per program). The product is exact for the quantized x
(`gemv_int8_reference`, to float32 rounding); against x itself it carries int8's rounding (about 0.5 % of a
product's size for Gaussian x). qmatmul takes it for one token of a Q4_K/Q6_K weight, 16 rows a program (`TILES`):
the 27B's AR step 11.9 against 12.7 ms with the float GEMV on an H100 (scripts/results/ar_int8_in_kernel_h100.txt).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.qcommon import PackedWeight, dequantize_packed, k_steps, prefetch_loop, sum_splits, tile_reader

FORMATS = ("Q4_K", "Q6_K")
TILES = (16, 1024, 4)  # (rows of W per program, columns per K step, warps)
STAGES = 3  # Triton pipeline stages
PREFETCH = 1  # K steps loaded ahead of the one computed (qcommon.prefetch_loop)
NIBBLES = 0x0F0F0F0F  # the low nibble of each byte of a word


def _groups(fmt: str, x: jax.Array) -> jax.Array:
    """x [K] as [planes, super-blocks, *group index, group]: each plane's weight groups in its word order."""
    nb = x.shape[0] // 256
    if fmt == "Q4_K":  # column 256 sb + 64 p + 32 nib + l -> [nib, sb, p, l]
        return x.reshape(nb, 4, 2, 32).transpose(2, 0, 1, 3)
    if fmt == "Q6_K":  # column 256 sb + 128 h + 32 c + 16 half + l -> [c, sb, h, half, l]
        return x.reshape(nb, 2, 4, 2, 16).transpose(2, 0, 1, 3, 4)
    raise ValueError(f"no int8-activation GEMV for {fmt} (it takes {', '.join(FORMATS)})")


def _ungroup(fmt: str, g: jax.Array) -> jax.Array:
    """The inverse of `_groups`: [K]."""
    return (g.transpose(1, 2, 0, 3) if fmt == "Q4_K" else g.transpose(1, 2, 0, 3, 4)).reshape(-1)


def quantize_groups(g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(int32 quants in [-127, 127], float32 scales) of float32 groups g [..., group]: each group's largest |x| maps
    to 127, rounded half up (Pallas' Triton lowering has no round). The kernel and the reference run this same code."""
    amax = jnp.max(jnp.abs(g), axis=-1)
    inv = jnp.where(amax > 0, 127 / jnp.where(amax > 0, amax, 1), 0)
    q = jnp.clip(jnp.floor(g * inv[..., None] + 0.5), -127, 127).astype(jnp.int32)
    return q, amax / 127


def pack_words(q: jax.Array) -> jax.Array:
    """int32 quants [..., group] in [-128, 127] as int32 words [..., group / 4] of 4 int8 each, the first in the
    lowest byte (the bits of each byte are disjoint, so the wrapping sum is their OR)."""
    q4 = q.reshape(q.shape[:-1] + (q.shape[-1] // 4, 4))
    return jnp.sum((q4 & 0xFF) << (8 * jax.lax.broadcasted_iota(jnp.int32, q4.shape, q4.ndim - 1)), axis=-1)


def _quantized_groups(fmt: str, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`quantize_groups` of x [K] (rounded to bf16 first, as the other kernels take it) in `_groups` order."""
    return quantize_groups(_groups(fmt, x.astype(jnp.bfloat16).astype(jnp.float32)))


def dequantized_x(fmt: str, x: jax.Array) -> jax.Array:
    """x [K] as the kernel sees it: its int8 quants times their group's scale."""
    q, scale = _quantized_groups(fmt, x)
    return _ungroup(fmt, q.astype(jnp.float32) * scale[..., None])


def x_blocks(fmt: str, x: jax.Array) -> jax.Array:
    """x [K] reshaped (no copy) so that a plane's groups of a K step are one strided load: Q4_K
    [sb, p, nib, 32], Q6_K [sb, h, c, half, 16]."""
    return x.reshape((-1, 4, 2, 32) if fmt == "Q4_K" else (-1, 2, 4, 2, 16))


def gemv_int8_reference(x: jax.Array, pw: PackedWeight) -> jax.Array:
    """x [1, K] @ W^T -> [1, N] float32 for x as the kernel quantizes it (`dequantized_x`)."""
    return jnp.einsum("k,nk->n", dequantized_x(pw.fmt, x[0]), dequantize_packed(pw),
                      precision=jax.lax.Precision.HIGHEST)[None]


def weight_words(pw: PackedWeight) -> dict[str, jax.Array]:
    """The quant bytes of a Q4_K/Q6_K PackedWeight as uint32 words (4 consecutive bytes each): a bitcast, which XLA
    makes without a copy; the scale fields as they are."""
    to_words = lambda a: jax.lax.bitcast_convert_type(a.reshape(a.shape[:-1] + (-1, 4)), jnp.uint32)  # noqa: E731
    quants = ("qs",) if pw.fmt == "Q4_K" else ("ql", "qh")
    return {name: to_words(a) if name in quants else a for name, a in pw.data.items()}


# dp4a.u32.s32: the 4 unsigned bytes of a weight word (one plane's quants, isolated by a shift and a mask) times
# the 4 signed bytes of an x word, summed into an int32. One output per call: Pallas' Triton lowering takes inline
# assembly of one result. Inputs: Q4_K the qs word, x; Q6_K the ql word of the plane's half, the qh word, x.
_PTX_HEAD = "{\n.reg .b32 q, h, z;\nmov.b32 z, 0;\nshr.u32 q, $1, %d;\nand.b32 q, q, 0x0F0F0F0F;\n"
_PTX_Q6K_HIGH = "shr.u32 h, $2, %d;\nand.b32 h, h, 0x03030303;\nshl.b32 h, h, 4;\nor.b32 q, q, h;\n"
_PTX_DOT = "dp4a.u32.s32 $0, q, $%d, z;\n}"


def _ptx(fmt: str, plane: int) -> str:
    """The inline PTX of one plane's dots (see above)."""
    if fmt == "Q4_K":
        return _PTX_HEAD % (4 * plane) + _PTX_DOT % 2
    return _PTX_HEAD % (4 * (plane // 2)) + _PTX_Q6K_HIGH % (2 * plane) + _PTX_DOT % 3


def _dp4a(a: jax.Array, b: jax.Array) -> jax.Array:
    """dp4a's arithmetic in jnp (interpret mode): the 4 unsigned bytes of a times the 4 signed bytes of b, summed."""
    a, b = a.astype(jnp.uint32), b.astype(jnp.int32)
    total = jnp.zeros(jnp.broadcast_shapes(a.shape, b.shape), jnp.int32)
    for i in range(4):
        total = total + ((a >> (8 * i)) & 0xFF).astype(jnp.int32) * ((b << (24 - 8 * i)) >> 24)
    return total


def dots(fmt: str, quants: list[jax.Array], x: list[jax.Array], asm: bool) -> list[jax.Array]:
    """Per plane, the int32 dot of each weight word's 4 quants with its 4 int8 activations: Q4_K from the qs words
    (planes: low, high nibbles), Q6_K from the ql words of both halves and the qh words (planes c = 0..3); x holds
    each plane's activation words, broadcast to the weight words' shape. By inline PTX (`asm`) or in jnp."""
    if asm:
        shape = quants[0].shape
        inputs = [[quants[0]] if fmt == "Q4_K" else [quants[plane % 2], quants[2]] for plane in range(len(x))]
        return [plt.elementwise_inline_asm(
            _ptx(fmt, plane), args=ins + [jnp.broadcast_to(x[plane], shape)],
            constraints=",".join(["=r"] + ["r"] * (len(ins) + 1)), pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.int32)])[0] for plane, ins in enumerate(inputs)]
    if fmt == "Q4_K":
        (qs,) = quants
        return [_dp4a((qs >> (4 * nib)) & NIBBLES, x[nib]) for nib in range(2)]
    ql, qh = quants[:2], quants[2]
    return [_dp4a(((ql[c % 2] >> (4 * (c // 2))) & NIBBLES) | (((qh >> (2 * c)) & 0x03030303) << 4), x[c])
            for c in range(4)]


def _gemv_int8_kernel(fmt: str, n: int, step: int, steps: int, block_n: int, names: tuple[str, ...], asm: bool,
                      *refs):
    # x_ref `x_blocks`' [sb, ...] float32; w_refs [N, units, ...] (`weight_words`); o_ref [splits, 1, N']
    x_ref, *w_refs, o_ref = refs
    w = dict(zip(names, w_refs))
    r0, split = pl.program_id(0) * block_n, pl.program_id(1)
    row_ok = (r0 + jnp.arange(block_n)) < n
    planes = 2 if fmt == "Q4_K" else 4

    def load(i, valid):
        i = split * steps + i
        get = tile_reader(w, r0, row_ok, block_n, i * step, step, valid)
        x = pl.ds(i * step, step)
        # each plane's float x: [step, 4, 32] (Q4_K) or [step, 2, 2, 16] (Q6_K)
        tiles = {"xf": [x_ref[x, :, c] for c in range(planes)]}
        tiles["d"] = get("d")
        if fmt == "Q4_K":
            tiles.update(quants=[get("qs")], sc=[get("sc", nib) for nib in range(2)],
                         mn=[get("mn", nib) for nib in range(2)], dmin=get("dmin"))
        else:
            tiles.update(quants=[get("ql", slice(None), cc) for cc in range(2)] + [get("qh")],
                         sc=[get("sc", c) for c in range(4)])
        return tiles

    def compute(t, acc):
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        quantized = [quantize_groups(f32(xf.astype(jnp.bfloat16))) for xf in t["xf"]]
        t = t | {"x": [pack_words(q) for q, _ in quantized], "xs": [scale for _, scale in quantized],
                 "xq": [jnp.sum(q, axis=-1) for q, _ in quantized]}
        sums = [jnp.sum(s, axis=-1) for s in dots(fmt, t["quants"], [v[None] for v in t["x"]], asm)]
        d = f32(t["d"])
        if fmt == "Q4_K":  # [rows, units, p]: xs (d sc dot - dmin mn qsum)
            dmin = f32(t["dmin"])[..., None]
            for nib in range(2):
                acc = acc + t["xs"][nib][None] * (d[..., None] * f32(t["sc"][nib]) * f32(sums[nib])
                                                  - dmin * f32(t["mn"][nib]) * f32(t["xq"][nib])[None])
        else:  # [rows, units, h, half]: xs d sc (dot - 32 qsum)
            for c in range(4):
                acc = acc + (t["xs"][c][None] * d[..., None, None] * f32(t["sc"][c])
                             * f32(sums[c] - 32 * t["xq"][c][None]))
        return acc

    acc = jnp.zeros((block_n, step) + ((4,) if fmt == "Q4_K" else (2, 2)), jnp.float32)
    acc = prefetch_loop(load, compute, steps, acc, PREFETCH)
    while acc.ndim > 1:
        acc = jnp.sum(acc, axis=-1)
    o_ref[split, 0, pl.ds(r0, block_n)] = acc


def gemv_int8(x: jax.Array, pw: PackedWeight, *, interpret: bool = False, block_n: int | None = None,
              columns: int | None = None, splits: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None) -> jax.Array:
    """x [1, K] @ W^T -> [1, N] float32 for a Q4_K/Q6_K PackedWeight, x quantized to int8 per weight group by each
    program for its own K steps (no launches besides the kernel's); dp4a by inline PTX on a GPU, in jnp in interpret
    mode. Tiles default to `TILES` and `STAGES`, K splits to qcommon.default_splits at a target of 2048 programs.
    qmatmul calls it inside its jit."""
    n, k = pw.shape
    if pw.fmt not in FORMATS:
        raise ValueError(f"no int8-activation GEMV for {pw.fmt} (it takes {', '.join(FORMATS)})")
    if x.shape != (1, k):
        raise ValueError(f"the int8-activation GEMV takes one row of x of {k} columns, got {x.shape}")
    bn, cols, warps = TILES
    block_n, columns, num_warps = block_n or bn, columns or cols, num_warps or warps
    xb = x_blocks(pw.fmt, x[0])
    step, steps, splits = k_steps(pw.fmt, n, k, block_n, columns, splits, target=2048)
    words = weight_words(pw)
    names = tuple(sorted(words))
    tiles = pl.cdiv(n, block_n)
    out = pl.pallas_call(
        functools.partial(_gemv_int8_kernel, pw.fmt, n, step, steps, block_n, names, not interpret),
        out_shape=jax.ShapeDtypeStruct((splits, 1, tiles * block_n), jnp.float32),
        grid=(tiles, splits),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages or STAGES),
        interpret=interpret,
        name=f"gemv_int8_{pw.fmt.lower()}",
    )(xb, *(words[name] for name in names))
    return sum_splits(out, 1, n)
