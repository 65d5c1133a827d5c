"""One-token (M = 1) products without tensor cores: the variants that chose qmatmul's GEMV, against the shipped kernel.

    python scripts/qmatmul_gemv_probe.py generic     # plane_tile GEMV over tiles, accumulators, warps and splits
    python scripts/qmatmul_gemv_probe.py grouped     # a Q4_K-only GEMV that sums each 32-column group first
    python scripts/qmatmul_gemv_probe.py check       # both against the reference in interpret mode (CPU)

generic: each program owns `block_n` rows and walks K `S` units a step; per plane it dequantizes the tile with
`qmatmul.plane_tile` and multiplies it by the activations in the tile's own shape, accumulating either the whole
product tile (full=1, summed once after the loop: what qmatmul ships) or its row sums (full=0).
grouped (Q4_K): low and high nibbles times the activations summed per 32-column group, the group sums times the
6-bit scales, the mins through the activations' group sums (computed once per call), so no per-weight scale
arithmetic; magic=1 converts nibbles to float by the 2^23 bit trick instead of a conversion instruction.
Each timed call runs 12 (or more) copies of the weight; "of copy" is GGUF weight bytes/s over the copy rate.
When the shipped kernel ran through the tensor cores at M = 1, "qmatmul (shipped)" rows were that kernel.
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
from benchlib import copy_rate, median_seconds  # noqa: E402

from dflash_jax.testing.random_weights import random_qtensor  # noqa: E402
from pallas_kernels import qmatmul as qm  # noqa: E402

MAGIC = 0x4B000000


def to_f32(q, magic):
    if magic:
        return jax.lax.bitcast_convert_type(q | MAGIC, jnp.float32) - 8388608.0
    return q.astype(jnp.float32)


def _kernel(S, steps, BN, magic, x_ref, xs_ref, qs_ref, sc_ref, mn_ref, d_ref, dmin_ref, o_ref):
    r0, split = pl.program_id(0) * BN, pl.program_id(1)
    rows = pl.ds(r0, BN)

    def body(i, acc):
        u = pl.ds((split * steps + i) * S, S)
        q = plt.load(qs_ref.at[rows, u], eviction_policy="evict_first").astype(jnp.int32)  # [BN,S,4,32]
        xl = x_ref[0, u]  # [S,4,32]
        xh = x_ref[1, u]
        gl = jnp.sum(to_f32(q & 15, magic) * xl[None], axis=3)  # [BN,S,4]
        gh = jnp.sum(to_f32(q >> 4, magic) * xh[None], axis=3)
        sc0 = plt.load(sc_ref.at[rows, u, jnp.int32(0)]).astype(jnp.float32)  # [BN,S,4]
        sc1 = plt.load(sc_ref.at[rows, u, jnp.int32(1)]).astype(jnp.float32)
        mn0 = plt.load(mn_ref.at[rows, u, jnp.int32(0)]).astype(jnp.float32)
        mn1 = plt.load(mn_ref.at[rows, u, jnp.int32(1)]).astype(jnp.float32)
        s = jnp.sum(sc0 * gl + sc1 * gh, axis=2)  # [BN,S]
        m = jnp.sum(mn0 * xs_ref[0, u][None] + mn1 * xs_ref[1, u][None], axis=2)
        d = plt.load(d_ref.at[rows, u]).astype(jnp.float32)
        dmin = plt.load(dmin_ref.at[rows, u]).astype(jnp.float32)
        return acc + d * s - dmin * m

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((BN, S), jnp.float32))
    o_ref[split, 0, rows] = jnp.sum(acc, axis=1)


@functools.partial(jax.jit, static_argnames=("block_n", "S", "splits", "num_warps", "num_stages", "magic",
                                             "interpret"))
def gemv_q4k(x, pw, block_n=16, S=1, splits=1, num_warps=4, num_stages=3, magic=True, interpret=False):
    n, k = pw.shape
    nb = k // 256
    xf = x.astype(jnp.bfloat16).astype(jnp.float32)[0].reshape(nb, 4, 2, 32)  # col 64p + 32nib + l
    xp = xf.transpose(2, 0, 1, 3)  # [nib, nb, 4, 32]
    xs = xp.sum(-1)  # [nib, nb, 4]
    steps = nb // S // splits
    if steps * S * splits != nb:
        raise ValueError(f"{nb} super-blocks do not split into {splits} x {S}")
    names = ("qs", "sc", "mn", "d", "dmin")
    out = pl.pallas_call(
        functools.partial(_kernel, S, steps, block_n, magic),
        out_shape=jax.ShapeDtypeStruct((splits, 1, n), jnp.float32),
        grid=(n // block_n, splits),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="gemv_q4k",
    )(xp, xs, *(pw.data[nm] for nm in names))
    return out.sum(axis=0)


def check():
    qt = random_qtensor(jax.random.key(0), "Q4_K", (64, 1024))
    pw = qm.pack(qt)
    x = jax.random.normal(jax.random.key(1), (1, 1024))
    ref = qm.qmatmul_reference(x, pw)
    for kw in (dict(block_n=16, S=1), dict(block_n=8, S=2, splits=2, magic=False)):
        got = gemv_q4k(x, pw, interpret=True, **kw)
        err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
        print(kw, "rel err", err)
        assert err < 1e-5, err


# ---- generic GEMV through plane_tile (any format): what qmatmul ships ----
def _gen_kernel(fmt, n, step, steps, BN, names, full_acc, *refs):
    x_ref, *w_refs, o_ref = refs
    w = dict(zip(names, w_refs))
    r0, split = pl.program_id(0) * BN, pl.program_id(1)
    rows = pl.ds(r0, BN)
    row_ok = (r0 + jnp.arange(BN)) < n
    n_planes = x_ref.shape[0]
    shape = (BN, step) + qm.UNIT_SHAPE[fmt]

    def body(i, acc):
        i = split * steps + i
        get = qm.tile_reader(w, r0, row_ok, BN, i * step, step)
        for plane in range(n_planes):
            tile = qm.plane_tile(fmt, plane, get)
            xt = x_ref[plane, pl.ds(i * step, step)]
            prod = tile * xt[None]
            if full_acc:
                acc = acc + prod
            else:
                while prod.ndim > 1:
                    prod = jnp.sum(prod, axis=-1)
                acc = acc + prod
        return acc

    acc0 = jnp.zeros(shape if full_acc else (BN,), jnp.float32)
    acc = jax.lax.fori_loop(0, steps, body, acc0)
    while acc.ndim > 1:
        acc = jnp.sum(acc, axis=-1)
    o_ref[split, 0, rows] = acc


@functools.partial(jax.jit, static_argnames=("block_n", "S", "splits", "num_warps", "num_stages", "full_acc",
                                             "interpret"))
def gemv_gen(x, pw, block_n=16, S=1, splits=1, num_warps=4, num_stages=3, full_acc=True, interpret=False):
    n, k = pw.shape
    units = k // qm.unit(pw.fmt, k)
    xb = x.astype(jnp.bfloat16).astype(jnp.float32)[0]
    cols = qm.plane_columns(pw.fmt, k)
    xp = xb[cols].reshape((cols.shape[0], units) + qm.UNIT_SHAPE[pw.fmt])
    steps = units // S // splits
    assert steps * S * splits == units, (units, S, splits)
    names = tuple(sorted(pw.data))
    tiles = pl.cdiv(n, block_n)
    out = pl.pallas_call(
        functools.partial(_gen_kernel, pw.fmt, n, S, steps, block_n, names, full_acc),
        out_shape=jax.ShapeDtypeStruct((splits, 1, tiles * block_n), jnp.float32),
        grid=(tiles, splits),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"gemv_{pw.fmt.lower()}",
    )(xp, *(pw.data[nm] for nm in names))
    return out.sum(axis=0)[:, :n]


def check_gen():
    for fmt, (n, k) in (("Q4_K", (40, 1024)), ("Q5_K", (24, 1024)), ("Q6_K", (40, 1024)), ("Q8_0", (24, 2048)),
                        ("F16", (24, 64))):
        pw = qm.pack(random_qtensor(jax.random.key(0), fmt, (n, k)))
        x = jax.random.normal(jax.random.key(1), (1, k))
        ref = qm.qmatmul_reference(x, pw)
        for kw in (dict(block_n=16, S=1), dict(block_n=8, S=2, splits=2, full_acc=False)):
            got = gemv_gen(x, pw, interpret=True, **kw)
            err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
            print(fmt, kw, "rel err", err)
            assert err < 1e-5, err


def sweep(cases, variants) -> None:
    """Time the shipped qmatmul and each (name, fn) of `variants(fmt, n, k)` on `cases` of (fmt, (n, k), copies)."""
    copy = copy_rate()
    print(f"copy {copy / 1e12:.2f} TB/s", flush=True)
    rows = []
    for fmt, (n, k), ncopy in cases:
        qts = [random_qtensor(jax.random.key(i), fmt, (n, k)) for i in range(ncopy)]
        pws = [qm.pack(q) for q in qts]
        gguf = qts[0].nbytes
        del qts
        x = jax.random.normal(jax.random.key(99), (1, k), jnp.float32)
        ref = qm.qmatmul_reference(x, pws[0]) if n < 100000 else None
        tag = f"{fmt} {n}x{k}"
        for name, fn in [("qmatmul (shipped)", qm.qmatmul)] + variants(fmt, n, k):
            run = jax.jit(lambda a, ws, fn=fn: [fn(a, w) for w in ws])
            try:
                err = -1.0 if ref is None else float(jnp.max(jnp.abs(fn(x, pws[0]) - ref)) / jnp.max(jnp.abs(ref)))
                s = median_seconds(run, x, pws, iters=20) / len(pws)
            except Exception as e:  # a variant that does not compile is a finding, not a reason to stop
                print(f"{tag} {name:44s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            rows.append((tag, name, s * 1e6, gguf / s / copy, err))
            print(f"{tag:18s} {name:44s} {s * 1e6:8.1f} us {gguf / s / copy:5.2f} of copy  err {err:.1e}",
                  flush=True)
    print("\nshape              variant                                          us   of copy")
    for r in sorted(rows, key=lambda r: (r[0], r[2])):
        print(f"{r[0]:18s} {r[1]:44s} {r[2]:8.1f} {r[3]:5.2f}")


def grouped_variants(fmt, n, k):
    out = [("xla rowsum of qs bytes",
            lambda a, w: jnp.sum(w.data["qs"].reshape(w.shape[0], -1), axis=1, dtype=jnp.int32))]
    for magic in ((True, False) if n > 10000 else (True,)):
        for bn in (8, 16, 32, 64):
            for S in (1, 2):
                for nw in (2, 4, 8):
                    for sp in ((1,) if n > 10000 else (1, 2, 4)):
                        if bn * S * 128 > 16384 or (bn == 64 and nw == 2):
                            continue
                        out.append((f"gemv magic={int(magic)} bn={bn} S={S} w={nw} sp={sp}",
                                    functools.partial(gemv_q4k, block_n=bn, S=S, num_warps=nw, splits=sp,
                                                      magic=magic)))
    return out


def generic_variants(fmt, n, k):
    units, out = k // 256, []
    if fmt == "Q4_K":
        for bn, S, nw, sp in ((8, 2, 4, 1), (8, 2, 2, 2), (16, 2, 4, 2), (8, 1, 2, 4)):
            if units % (S * sp) == 0:
                out.append((f"grouped bn={bn} S={S} w={nw} sp={sp}",
                            functools.partial(gemv_q4k, block_n=bn, S=S, num_warps=nw, splits=sp, magic=False)))
    for full in (True, False):
        for bn in (8, 16, 32):
            for S in (1, 2):
                for nw in (2, 4):
                    for sp in ((1,) if n > 10000 else (2, 4)):
                        if units % (S * sp) == 0:
                            out.append((f"gen full={int(full)} bn={bn} S={S} w={nw} sp={sp}",
                                        functools.partial(gemv_gen, block_n=bn, S=S, num_warps=nw, splits=sp,
                                                          full_acc=full)))
    return out


def check_all():
    check()
    check_gen()


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "generic"
    if which == "check":
        check_all()
    elif which == "grouped":
        sweep([("Q4_K", (17408, 5120), 12), ("Q4_K", (5120, 17408), 12)], grouped_variants)
    else:
        sweep([("Q4_K", (17408, 5120), 12), ("Q4_K", (5120, 17408), 12), ("Q6_K", (5120, 17408), 10),
               ("Q5_K", (10240, 5120), 16), ("Q4_K", (5120, 6144), 24), ("Q6_K", (248320, 5120), 2)],
              generic_variants)
