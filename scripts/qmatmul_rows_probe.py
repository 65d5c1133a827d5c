"""Products of 16 and 32 activation rows (the tree verify): qmatmul's tensor-core kernel against variants of it.

    python scripts/qmatmul_rows_probe.py [swap|modes|tiles]   # time a family of variants on a GPU
    python scripts/qmatmul_rows_probe.py check      # the variants against the reference in interpret mode (CPU)

swap: the weight tile is the product's left operand, out^T [rows of W, M] = W_tile [rows, cols] @ x^T [cols, M],
with x stored transposed, so the tensor cores' wide side (64 per warp group on Hopper) is W's rows and the narrow
side the 16-32 tokens; the shipped kernel has the tokens on the wide side.
modes (Q4_K): the shipped kernel's loop and tiles with the tile dequantized four ways: full (plane_tile in jnp, as
qmatmul did before its inline PTX), noscale (nibbles converted to bf16, no scale arithmetic: what layout and
conversion alone cost), bf16 (the scale arithmetic in jnp on bf16 arrays), asm (inline PTX that turns 4 bytes into
4 bf16 weights of a plane with packed bf16x2 arithmetic, Q4K_ASM: scale and offset rounded to bf16 first, a second
rounding); beside qmatmul as shipped (inline PTX in float32, qmatmul.plane_tile_bf16) and with asm=False.
tiles: the shipped kernel on other tiles (rows of W, columns per step, warps), for Q5_K at 32 and 64 rows.
Each timed call runs several copies of the weight (more bytes than the L2). "wall" is the median time of a call over
its copies; "kernel" the summed GPU kernel time of a traced call over its copies (benchlib.kernel_seconds), which
leaves out dispatch and waits. "of copy" is GGUF weight bytes per kernel second over the copy rate.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import copy_rate, kernel_seconds, median_seconds  # noqa: E402

from dflash_jax.testing.random_weights import random_qtensor  # noqa: E402
from pallas_kernels import qmatmul as qm  # noqa: E402
from pallas_kernels.tiles import dot_tile  # noqa: E402


def _swap_kernel(fmt, n, step, steps, block_n, names, *refs):
    x_ref, *w_refs, o_ref = refs  # x_ref [planes, K / planes, M]
    w = dict(zip(names, w_refs))
    r0, split = pl.program_id(0) * block_n, pl.program_id(1)
    row_ok = (r0 + jnp.arange(block_n)) < n
    n_planes, width, m_pad = x_ref.shape[0], x_ref.shape[1] // w_refs[0].shape[1], x_ref.shape[2]

    def body(i, acc):
        i = split * steps + i
        get = qm.tile_reader(w, r0, row_ok, block_n, i * step, step)
        for plane in range(n_planes):
            if fmt == "BF16":
                tile = get("w")
            else:
                tile = qm.plane_tile(fmt, plane, get).reshape(block_n, -1).astype(jnp.bfloat16)
            xt = x_ref[plane, pl.ds(i * step * width, step * width), :]
            acc = acc + jnp.dot(tile, xt, preferred_element_type=jnp.float32)
        return acc

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((block_n, m_pad), jnp.float32))
    o_ref[split, pl.ds(r0, block_n), :] = acc


@functools.partial(jax.jit, static_argnames=("block_n", "columns", "splits", "num_warps", "num_stages", "interpret"))
def qmatmul_swap(x, pw, block_n=64, columns=512, splits=None, num_warps=4, num_stages=3, interpret=False):
    m, k = x.shape
    n, _ = pw.shape
    m_pad = dot_tile(m)
    step = qm.units_per_step(pw.fmt, k, columns)
    total = k // qm.unit(pw.fmt, k) // step
    splits = splits or qm.default_splits(n, total, block_n)
    if total % splits:
        raise ValueError(f"{total} K steps do not split {splits} ways")
    xb = jnp.zeros((m_pad, k), jnp.bfloat16).at[:m].set(x.astype(jnp.bfloat16))
    xp = xb[:, qm.plane_columns(pw.fmt, k)].transpose(1, 2, 0)  # [planes, K / planes, M]
    names = tuple(sorted(pw.data))
    tiles = pl.cdiv(n, block_n)
    out = pl.pallas_call(
        functools.partial(_swap_kernel, pw.fmt, n, step, total // splits, block_n, names),
        out_shape=jax.ShapeDtypeStruct((splits, tiles * block_n, m_pad), jnp.float32),
        grid=(tiles, splits),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"qmatmul_swap_{pw.fmt.lower()}",
    )(xp, *(pw.data[nm] for nm in names))
    return jnp.sum(out, axis=0)[:n, :m].T


# ---- where the time of a Q4_K tile goes: the shipped kernel's loop with its dequantization swapped out ----
# PTX for the 4 quant bytes in $2 -> 4 bf16 weights of one nibble plane ({shift}: 0 low, 4 high): the nibbles
# spread into the low bytes of bf16 halves whose high byte is 0x43 (each reads 128 + q exactly), 128 subtracted,
# then q * scale - offset in one bf16x2 fma, with scale ($3-$4) and negated offset ($5-$6) rounded to bf16 first.
# (One call per plane: jax's Pallas does not lower the primitive with several results.)
Q4K_ASM = """{{
.reg .b32 m, t, k;
mov.b32 k, 0x43004300;
shr.u32 m, $2, {shift};
and.b32 m, m, 0x0F0F0F0F;
prmt.b32 t, m, k, 0x5150;
sub.rn.bf16x2 t, t, k;
fma.rn.bf16x2 $0, t, $3, $5;
prmt.b32 t, m, k, 0x5352;
sub.rn.bf16x2 t, t, k;
fma.rn.bf16x2 $1, t, $4, $6;
}}"""


def _q4k_planes(mode, get):
    """The two bf16 plane tiles [rows, units, 4, 32] of a Q4_K tile, dequantized the `mode` way."""
    if mode == "full":
        return [qm.plane_tile("Q4_K", p, get).astype(jnp.bfloat16) for p in range(2)]
    q = get("qs")
    if mode == "noscale":  # nibbles only: the layout and conversion cost without the scale arithmetic
        q = q.astype(jnp.int32)
        return [((q >> (4 * p)) & 0xF).astype(jnp.bfloat16) for p in range(2)]
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    shape = q.shape
    scale = [jnp.broadcast_to((f32(get("d"))[..., None] * f32(get("sc", p)))[..., None], shape).astype(jnp.bfloat16)
             for p in range(2)]
    neg = [jnp.broadcast_to((-f32(get("dmin"))[..., None] * f32(get("mn", p)))[..., None], shape)
           .astype(jnp.bfloat16) for p in range(2)]
    if mode == "bf16":  # the same arithmetic as asm, written in jnp on bf16 arrays
        q = q.astype(jnp.int32)
        return [((q >> (4 * p)) & 0xF).astype(jnp.bfloat16) * scale[p] + neg[p] for p in range(2)]
    return [plt.elementwise_inline_asm(Q4K_ASM.format(shift=4 * p), args=[q, scale[p], neg[p]],
                                       constraints="=r,=r,r,r,r,r,r", pack=4,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.bfloat16)])[0]
            for p in range(2)]


def _mode_kernel(mode, n, step, steps, block_n, names, *refs):
    x_ref, *w_refs, o_ref = refs
    w = dict(zip(names, w_refs))
    r0, split = pl.program_id(0) * block_n, pl.program_id(1)
    row_ok = (r0 + jnp.arange(block_n)) < n
    m_pad, width = x_ref.shape[1], x_ref.shape[2] // w_refs[0].shape[1]

    def body(i, acc):
        i = split * steps + i
        get = qm.tile_reader(w, r0, row_ok, block_n, i * step, step)
        for plane, tile in enumerate(_q4k_planes(mode, get)):
            xt = x_ref[plane, :, pl.ds(i * step * width, step * width)]
            acc = acc + jax.lax.dot_general(xt, tile.reshape(block_n, -1), (((1,), (1,)), ((), ())),
                                            preferred_element_type=jnp.float32)
        return acc

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((m_pad, block_n), jnp.float32))
    o_ref[split, :, pl.ds(r0, block_n)] = acc


@functools.partial(jax.jit, static_argnames=("mode", "block_n", "columns", "num_warps", "interpret"))
def qmatmul_mode(x, pw, mode="full", block_n=None, columns=None, num_warps=None, interpret=False):
    """The shipped Q4_K kernel's loop with the dequantization of `mode` (full, noscale, bf16, asm)."""
    m, k = x.shape
    n, _ = pw.shape
    m_pad = dot_tile(m)
    bn, cols, nw = qm.default_tiles(m_pad, n, pw.fmt)
    block_n, columns, num_warps = block_n or bn, columns or cols, num_warps or nw
    step = qm.units_per_step(pw.fmt, k, columns)
    total = k // qm.unit(pw.fmt, k) // step
    splits = qm.default_splits(n, total, block_n)
    xb = jnp.zeros((m_pad, k), jnp.bfloat16).at[:m].set(x.astype(jnp.bfloat16))
    xp = xb[:, qm.plane_columns(pw.fmt, k)].transpose(1, 0, 2)
    names = tuple(sorted(pw.data))
    tiles = pl.cdiv(n, block_n)
    out = pl.pallas_call(
        functools.partial(_mode_kernel, mode, n, step, total // splits, block_n, names),
        out_shape=jax.ShapeDtypeStruct((splits, m_pad, tiles * block_n), jnp.float32),
        grid=(tiles, splits),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=3),
        interpret=interpret, name=f"qmatmul_{mode}_q4_k",
    )(xp, *(pw.data[nm] for nm in names))
    return jnp.sum(out, axis=0)[:m, :n]


def mode_variants(fmt, n, k, m):
    out = [("qmatmul asm=False", functools.partial(qm.qmatmul, asm=False))]
    if fmt == "Q4_K":
        out += [(f"mode={mode}", functools.partial(qmatmul_mode, mode=mode))
                for mode in ("full", "noscale", "bf16", "asm")]
    return out


def check() -> None:
    """The swap and mode variants (interpret mode; not the asm modes, which run only on a GPU) against the reference."""
    for fmt, n, k, m in (("Q4_K", 40, 1024, 23), ("Q6_K", 72, 1024, 9), ("F16", 24, 64, 5)):
        pw = qm.pack(random_qtensor(jax.random.key(0), fmt, (n, k)))
        x = jax.random.normal(jax.random.key(1), (m, k))
        ref = qm.qmatmul_reference(x, pw)
        for kw in (dict(block_n=64, columns=256), dict(block_n=16, columns=256, splits=2 if k >= 512 else 1)):
            got = qmatmul_swap(x, pw, interpret=True, **kw)
            err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
            print(fmt, m, kw, "rel err", f"{err:.1e}")
            assert err < 1e-2, err
    pw = qm.pack(random_qtensor(jax.random.key(0), "Q4_K", (40, 1024)))  # the asm mode runs only on a GPU
    x = jax.random.normal(jax.random.key(1), (23, 1024))
    err = float(jnp.max(jnp.abs(qmatmul_mode(x, pw, interpret=True) - qm.qmatmul_reference(x, pw))))
    print("mode=full abs err", f"{err:.1e}")
    assert err < 1e-2 * float(jnp.max(jnp.abs(qm.qmatmul_reference(x, pw)))), err


def variants(fmt, n, k, m):
    out = []
    for bn in (64, 128):
        for cols in (256, 512):
            for nw in (4, 8):
                if m == 16 and (bn, nw) != (64, 4):
                    continue
                for sp in (None, 4) if n < 8192 else (None,):
                    name = f"swap bn={bn} cols={cols} w={nw} sp={sp or 'auto'}"
                    out.append((name, functools.partial(qmatmul_swap, block_n=bn, columns=cols, num_warps=nw,
                                                        splits=sp)))
    return out


def tile_variants(fmt, n, k, m):
    return [(f"tiles bn={bn} cols={cols} w={nw}",
             functools.partial(qm.qmatmul, block_n=bn, columns=cols, num_warps=nw))
            for bn, cols, nw in ((32, 256, 4), (64, 256, 4), (64, 256, 8), (32, 512, 4), (128, 256, 8))]


FAMILIES = {  # name: (variants, cases of (tag, fmt, N, K, copies), token counts)
    "swap": (variants, [("ffn_gate", "Q4_K", 17408, 5120, 12), ("ffn_down", "Q6_K", 5120, 17408, 10),
                        ("attn_qkv", "Q5_K", 10240, 5120, 16), ("ssm_out", "Q4_K", 5120, 6144, 24)], (32, 16)),
    "modes": (mode_variants, [("ffn_gate", "Q4_K", 17408, 5120, 12), ("ffn_down", "Q4_K", 5120, 17408, 12),
                              ("ffn_down", "Q6_K", 5120, 17408, 10), ("attn_q", "Q4_K", 12288, 5120, 16)], (32, 16)),
    "tiles": (tile_variants, [("attn_qkv", "Q5_K", 10240, 5120, 16)], (32, 64)),
}


def main(family: str) -> None:
    variants_of, cases, ms = FAMILIES[family]
    copy = copy_rate()
    print(f"copy {copy / 1e12:.2f} TB/s", flush=True)
    rows = []
    for tag, fmt, n, k, ncopy in cases:
        qts = [random_qtensor(jax.random.key(i), fmt, (n, k)) for i in range(ncopy)]
        pws = [qm.pack(q) for q in qts]
        gguf = qts[0].nbytes
        del qts
        for m in ms:
            x = jax.random.normal(jax.random.key(99), (m, k), jnp.float32)
            ref = qm.qmatmul_reference(x, pws[0])
            for name, fn in [("qmatmul (shipped)", qm.qmatmul)] + variants_of(fmt, n, k, m):
                run = jax.jit(lambda a, ws, fn=fn: [fn(a, w) for w in ws])
                try:
                    err = float(jnp.max(jnp.abs(fn(x, pws[0]) - ref)) / jnp.max(jnp.abs(ref)))
                    wall = median_seconds(run, x, pws, iters=10) / ncopy
                    kern = kernel_seconds(run, x, pws) / ncopy
                except Exception as e:  # a variant that does not compile is a finding, not a reason to stop
                    print(f"{tag} M={m} {name:40s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                rows.append((f"{tag} {fmt} M={m}", name, wall * 1e6, kern * 1e6, gguf / kern / copy, err))
                print(f"{tag} {fmt} M={m} {name:40s} wall {wall * 1e6:7.1f} us kernel {kern * 1e6:7.1f} us "
                      f"{gguf / kern / copy:5.2f} of copy err {err:.1e}", flush=True)
    print("\ncase                     variant                                   wall us  kernel us  of copy")
    for r in sorted(rows, key=lambda r: (r[0], r[3])):
        print(f"{r[0]:24s} {r[1]:40s} {r[2]:8.1f} {r[3]:10.1f} {r[4]:8.2f}")


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "swap"
    check() if which == "check" else main(which)
