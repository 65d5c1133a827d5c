"""Does a Mosaic GPU (Pallas:MGPU) kernel stream 4-bit weights faster than the Triton tensor-core kernel at 16-32
tokens? A probe, not a shipped kernel: weights [N, K] as int8 or int4, x [T, K] bf16, out [N, T] = W x^T in float32,
beside qmatmul's Q4_K kernel on a weight of the same shape.

Variants (KEY=VALUE,...): `wtype` int8 | int4; `scaled=1` gives each row and 32 columns (a Q4_K sub-block) a scale
and an offset, w = q s + o, applied per element from shared memory (`_scale_rows`), or with `sub=1` per 32-column
slice as row vectors, each slice its own wgmma of K = 32; `codes=1` (with sub) makes s and o in the kernel from
Q4_K's own fields (6-bit scales and mins per sub-block, float16 d and dmin per super-block: 4.625 bits a weight,
2.8 % over the GGUF's 4.5) with the quants stored as q - 8 in int4; `math` f32 | bf16 | f16 is the dtype the
scale arithmetic runs in (f16 also multiplies x in float16); `wgs=2` gives a program two compute warpgroups sharing
each x tile and a third issuing the copies (`emit_pipeline_warp_specialized`); `splits`, `stages`, `block_k`.

    python scripts/mgpu_probe.py --out FILE.json   # on a GPU (Hopper): time the variants and qmatmul's Q4_K kernel
    python scripts/mgpu_probe.py --lower           # lower every variant for CUDA on a CPU (no GPU): catches tracing
                                                   # and layout errors before a device run

The kernel follows the form of tokamax's quantized ragged dot for Hopper: one warpgroup per program owns 64 rows
of W; `emit_pipeline` streams [64, block_k] weight tiles and [T, block_k] x tiles into shared memory by TMA
(`stages` in flight); the weight tile is converted in registers and is the wgmma's A operand (from registers), x^T
in shared memory its B operand, so the tokens are wgmma's N (any multiple of 8) and x never passes through
registers. K may split over programs (`splits`), whose partial products XLA adds.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import copy_rate, environment, kernel_seconds, parse_options  # noqa: E402

GROUP = 32  # columns sharing a scale and an offset (a Q4_K sub-block)


def _scale_rows(w, s_ref, o_ref, col0: int):
    """w [rows, cols] (WGMMA layout) times s_ref[row, (col0 + col) // GROUP] plus o_ref's: per-element scales read
    from shared memory through the lower-level FragmentedArray API (Pallas has no broadcast for this)."""
    from jax._src.lib.mlir.dialects import arith, memref
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.Layout.WGMMA),
                       return_type=plgpu.ShapeDtypeStruct(w.shape, s_ref.dtype, plgpu.Layout.WGMMA))
    def scaled(_, s_smem, o_smem, wf):
        def one(val, idx):
            g = arith.divui(arith.addi(idx[1], mgpu_utils.c(col0, idx[1].type)), mgpu_utils.c(GROUP, idx[1].type))
            return arith.addf(arith.mulf(val, memref.load(s_smem, (idx[0], g))), memref.load(o_smem, (idx[0], g)))
        return wf.foreach(one, create_array=True)

    return scaled(s_ref, o_ref, w.astype(s_ref.dtype))


def _sub_block(wq, s_ref, o_ref, j: int, math: str):
    """Columns [32 j, 32 j + 32) of the int4 tile wq [rows, cols] as bf16 weights q * s + o, with s and o the rows'
    scale and offset of that sub-block (s_ref, o_ref [cols / 32, rows]): in float32 rounded once ("f32") or in
    bf16 ("bf16", each op rounded)."""
    row = plgpu.Layout.WGMMA.reduce(1)
    s = plgpu.load(s_ref.at[j], (), layout=row)
    o = plgpu.load(o_ref.at[j], (), layout=row)
    q = wq[:, j * GROUP:(j + 1) * GROUP].astype(jnp.bfloat16)
    if math == "f32":
        q, s, o = q.astype(jnp.float32), s.astype(jnp.float32), o.astype(jnp.float32)
    out = q * jax.lax.broadcast_in_dim(s, q.shape, [0]) + jax.lax.broadcast_in_dim(o, q.shape, [0])
    return out.astype(jnp.bfloat16)


def _codes_rows(codes_ref, dd_ref, math: str):
    """The 8 sub-blocks' (scale, offset) row vectors of a 256-column step, made from Q4_K's own fields: codes_ref
    [16, rows] uint8 (8 sub-block scales, 8 mins), dd_ref [2, rows] float16 (d, dmin). The int4 tile holds q - 8,
    so w = d sc (q - 8) + (8 d sc - dmin m); s and o are made in float32 and taken in the dtype `math` names."""
    row = plgpu.Layout.WGMMA.reduce(1)
    f32 = jnp.float32
    d = plgpu.load(dd_ref.at[0], (), layout=row).astype(f32)
    dmin = plgpu.load(dd_ref.at[1], (), layout=row).astype(f32)
    out = []
    for j in range(8):
        s = d * plgpu.load(codes_ref.at[j], (), layout=row).astype(f32)
        o = 8.0 * s - dmin * plgpu.load(codes_ref.at[8 + j], (), layout=row).astype(f32)
        out.append((s.astype(MATH_DTYPE[math]), o.astype(MATH_DTYPE[math])))
    return out


MATH_DTYPE = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def _codes_block(wq, so, j: int, math: str):
    """Columns [32 j, 32 j + 32) of the int4 tile as weights q * s + o (so: `_codes_rows`), in the dtype `math`
    names, given to the product as bf16 (float16 for "f16")."""
    s, o = so[j]
    q = wq[:, j * GROUP:(j + 1) * GROUP].astype(jnp.bfloat16)
    if math != "bf16":
        q = q.astype(MATH_DTYPE[math])
    out = q * jax.lax.broadcast_in_dim(s, q.shape, [0]) + jax.lax.broadcast_in_dim(o, q.shape, [0])
    return out.astype(jnp.float16 if math == "f16" else jnp.bfloat16)


def mgpu_matmul(w, x, s=None, o=None, *, block_n: int = 64, block_k: int = 256, stages: int = 4, splits: int = 1,
                sub: int = 0, math: str = "bf16", wgs: int = 1, codes: int = 0):
    """W [N, K] (int8/int4; times s plus o per row and GROUP columns when given, [N, K / GROUP] bf16) @ x^T ->
    [N, T] float32, x [T, K] bf16. `sub`: scales applied per 32-column slice as row vectors, each slice its own
    wgmma of K = 32 (s, o then [K / GROUP, N]); else per element from shared memory (`_scale_rows`). `wgs`: compute
    warpgroups per program (2: 2 x block_n rows sharing each x tile, with a third warpgroup issuing the copies)."""
    n, k = w.shape
    t = x.shape[0]
    scaled = s is not None
    wbits, xbits = jnp.iinfo(w.dtype).bits, 16
    if math == "f16":
        x = x.astype(jnp.float16)
    sw_w = plgpu.find_swizzle(wbits * block_k, "lhs")
    sw_x = 64 if sub else plgpu.find_swizzle(xbits * block_k, "rhs")
    we, xe = sw_w * 8 // wbits, sw_x * 8 // xbits
    ksteps = k // block_k // splits
    rows = block_n * wgs
    if k % (block_k * splits) or n % rows or t % 8:
        raise ValueError(f"shape {n}x{k}, T={t} does not tile by {rows}x{block_k}, {splits} splits")

    def mma(acc_ref, w_smem, x_smem, so_smem, r):
        wr = w_smem[r]
        if sub and scaled:
            so_r = [ref.at[:, r] for ref in so_smem]
            rows_so = _codes_rows(*so_r, math) if codes else None
            for j in range(block_k // GROUP):
                a = _codes_block(wr, rows_so, j, math) if codes else _sub_block(wr, *so_r, j, math)
                plgpu.wgmma(acc_ref, a, x_smem.at[:, j * GROUP:(j + 1) * GROUP].T)
                plgpu.wgmma_wait(1)
            return
        for j in range(block_k // xe):
            ks = slice(j * xe, (j + 1) * xe)
            a = _scale_rows(wr[:, ks], *(ref.at[r] for ref in so_smem), j * xe) if scaled else wr[:, ks].astype(
                jnp.bfloat16)
            plgpu.wgmma(acc_ref, a, x_smem.at[:, ks].T)
            plgpu.wgmma_wait(1)

    def specs(ni, si):
        out = [plgpu.BlockSpec((rows, block_k), lambda ki: (ni, si * ksteps + ki),
                               transforms=(plgpu.TilingTransform((8, we)), plgpu.SwizzleTransform(sw_w)),
                               delay_release=1),
               plgpu.BlockSpec((t, block_k), lambda ki: (0, si * ksteps + ki),
                               transforms=(plgpu.TilingTransform((8, xe)), plgpu.SwizzleTransform(sw_x)),
                               delay_release=1)]
        if scaled:
            if codes:
                out += [plgpu.BlockSpec((16, rows), lambda ki: (si * ksteps + ki, ni), delay_release=1),
                        plgpu.BlockSpec((2, rows), lambda ki: (si * ksteps + ki, ni), delay_release=1)]
            elif sub:
                out += [plgpu.BlockSpec((block_k // GROUP, rows), lambda ki: (si * ksteps + ki, ni),
                                        delay_release=1)] * 2
            else:
                out += [plgpu.BlockSpec((rows, block_k // GROUP), lambda ki: (ni, si * ksteps + ki),
                                        delay_release=1)] * 2
        return out

    def store(acc, o_gmem, o_smem, ni, si, r0):
        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, pl.ds(ni * rows + r0, block_n)])
        plgpu.wait_smem_to_gmem(0)

    def body(*refs):
        w_gmem, x_gmem, *so, o_gmem, o_smem = refs
        ni, si = jax.lax.axis_index("n"), jax.lax.axis_index("k")

        def compute(acc_ref):
            def step(_, w_smem, x_smem, *so_smem):
                mma(acc_ref, w_smem, x_smem, so_smem, slice(None))
            plgpu.emit_pipeline(step, grid=(ksteps,), in_specs=specs(ni, si), max_concurrent_steps=stages)(
                w_gmem, x_gmem, *so)
            return acc_ref[...]

        store(pl.run_scoped(compute, plgpu.ACC((block_n, t))), o_gmem, o_smem.at[0], ni, si, 0)

    def body_ws(*refs):
        w_gmem, x_gmem, *so, o_gmem, o_smem = refs
        ni, si = jax.lax.axis_index("n"), jax.lax.axis_index("k")

        def make(pipeline_body, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                pipeline_body, grid=(ksteps,), memory_registers=40, in_specs=specs(ni, si), wg_axis="wg",
                num_compute_wgs=wgs, max_concurrent_steps=stages, compute_context=compute_context)

        ignore = lambda *_, **__: None

        @functools.partial(pl.run_scoped, allocs=make(ignore, ignore).get_allocations(w_gmem, x_gmem, *so),
                           collective_axes="wg")
        def _scope(allocs):
            wg = jax.lax.axis_index("wg")
            r = pl.ds(wg * block_n, block_n)

            def context(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((block_n, t), jnp.float32))
                def _acc(acc_ref):
                    eval_pipeline(acc_ref)
                    store(acc_ref[...], o_gmem, o_smem.at[wg], ni, si, wg * block_n)

            def step(_, w_smem, x_smem, *rest):
                *so_smem, acc_ref = rest
                mma(acc_ref, w_smem, x_smem, so_smem, r)
                return acc_ref

            make(step, context)(w_gmem, x_gmem, *so, allocations=allocs)

    extra = dict(num_threads=wgs + 1, thread_name="wg") if wgs > 1 else {}
    out = plgpu.kernel(body_ws if wgs > 1 else body, out_type=jax.ShapeDtypeStruct((splits, n, t), jnp.float32),
                       grid=(n // rows, splits), grid_names=("n", "k"),
                       scratch_types=[plgpu.SMEM((wgs, block_n, t), jnp.float32)], **extra)
    out = out(w, x, *((s, o) if scaled else ()))
    return out.sum(0)


def reference(w, x, s=None, o=None, sub=0, codes=0):
    """What `mgpu_matmul` computes, in float32 (with `scaled` and no `codes`, the weights rounded to bf16 once)."""
    wf = w.astype(jnp.float32)
    if codes:
        nsb = s.shape[0] // 16
        c = s.reshape(nsb, 16, -1).astype(jnp.float32)
        dd = o.reshape(nsb, 2, -1).astype(jnp.float32)
        sc = (dd[:, :1] * c[:, :8]).transpose(2, 0, 1).reshape(w.shape[0], -1)  # [N, K / 32]
        mn = (dd[:, 1:] * c[:, 8:]).transpose(2, 0, 1).reshape(w.shape[0], -1)
        # not rounded: the error is the kernel's
        wf = wf * jnp.repeat(sc, GROUP, 1) + jnp.repeat(8 * sc - mn, GROUP, 1)
        return jnp.dot(wf, x.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    if s is not None:
        if sub:
            s, o = s.T, o.T
        wf = wf * jnp.repeat(s.astype(jnp.float32), GROUP, 1) + jnp.repeat(o.astype(jnp.float32), GROUP, 1)
        wf = wf.astype(jnp.bfloat16).astype(jnp.float32)
    return jnp.dot(wf, x.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)


def inputs(key, n, k, t, wtype, scaled, sub=0, codes=0):
    """(w, x, (s, o) or (codes, d and dmin) or ()) of a variant: random quants, Gaussian x."""
    kw, kx, ks, ko = jax.random.split(key, 4)
    lo, hi = (-8, 8) if wtype == "int4" else (-128, 128)
    w = jax.random.randint(kw, (n, k), lo, hi, jnp.int8).astype(jnp.int4 if wtype == "int4" else jnp.int8)
    x = jax.random.normal(kx, (t, k), jnp.float32).astype(jnp.bfloat16)
    so = ()
    if scaled:
        so = (jax.random.uniform(ks, (n, k // GROUP), jnp.float32, 0.5, 1.5).astype(jnp.bfloat16),
              jax.random.normal(ko, (n, k // GROUP), jnp.float32).astype(jnp.bfloat16))
        if sub:
            so = tuple(a.T for a in so)
        if codes:  # Q4_K's fields: 6-bit scales and mins per sub-block, float16 d and dmin per super-block
            so = (jax.random.randint(ks, (k // 256 * 16, n), 0, 64, jnp.int32).astype(jnp.uint8),
                  (jax.random.uniform(ko, (k // 256 * 2, n), jnp.float32, 0.5, 1.5) / 64).astype(jnp.float16))
    return w, x, so


# the structure (first run, scripts/results/mgpu_probe_structure_h200.txt) and Q4_K's fields in three arithmetics
VARIANTS = ["wtype=int8", "wtype=int4", "wtype=int4,scaled=1,splits=4",
            "wtype=int4,scaled=1,sub=1,codes=1,splits=4", "wtype=int4,scaled=1,sub=1,codes=1,math=f32,splits=4",
            "wtype=int4,scaled=1,sub=1,codes=1,math=f16,splits=4,stages=3"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--lower", action="store_true")
    ap.add_argument("--shape", default="17408x5120")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 24, 32])
    ap.add_argument("--variants", nargs="+", default=VARIANTS)
    ap.add_argument("--copies", type=int, default=4)
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    rows = []
    if not args.lower:
        copy = copy_rate()
        print(f"copy rate {copy / 1e12:.2f} TB/s", flush=True)
    for t in args.tokens:
        for text in args.variants:
            opts = parse_options(text)
            wtype, scaled = opts.pop("wtype", "int4"), bool(opts.pop("scaled", 0))
            layout = dict(sub=opts.get("sub", 0), codes=opts.get("codes", 0))
            if args.lower:
                w, x, so = inputs(jax.random.key(0), 256, 1024, t, wtype, scaled, **layout)
                fn = jax.jit(functools.partial(mgpu_matmul, **opts))
                try:
                    fn.trace(w, x, *so).lower(lowering_platforms=("cuda",))
                    print(f"T={t} {text}: lowers", flush=True)
                except Exception as e:  # a variant that does not lower is the probe's finding
                    print(f"T={t} {text}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            try:
                w, x, so = inputs(jax.random.key(1), 512, 2048, t, wtype, scaled, **layout)
                got = jax.jit(functools.partial(mgpu_matmul, **opts))(w, x, *so)
                ref = reference(w, x, *so, **layout)
                err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
                ws = [inputs(jax.random.key(2 + c), n, k, t, wtype, scaled, **layout) for c in range(args.copies)]
                run = jax.jit(lambda ws, o=opts: [mgpu_matmul(w, x, *so, **o) for w, x, so in ws])
                sec = kernel_seconds(run, ws) / args.copies
            except Exception as e:  # a variant that fails is the probe's finding
                print(f"T={t} {text}: {type(e).__name__}: {str(e)[:400]}", flush=True)
                continue
            meta = (n * k / 256 * 20 if opts.get("codes") else 4 * n * k / GROUP) if scaled else 0
            wbytes = n * k * (1 if wtype == "int8" else 0.5) + meta
            r = dict(t=t, variant=text, us=sec * 1e6, bytes=wbytes, ratio=wbytes / sec / copy, rel_err=err)
            rows.append(r)
            print(f"T={t:2d} {text:40s} {r['us']:7.1f} us  {wbytes / 1e6:6.1f} MB  {r['ratio']:.2f} of copy  "
                  f"err {err:.1e}", flush=True)
        if not args.lower:  # qmatmul's Q4_K tensor-core kernel on the same shape, for comparison
            from dflash_jax.testing.synthetic import random_matrix
            from pallas_kernels import qmatmul as qm
            pws = [qm.pack(random_matrix(jax.random.key(10 + c), "Q4_K", (n, k))) for c in range(args.copies)]
            x = jax.random.normal(jax.random.key(0), (t - 1 if t == 24 else t, k), jnp.float32).astype(jnp.bfloat16)
            run = jax.jit(lambda x, pws: [qm.qmatmul(x, pw) for pw in pws])
            sec = kernel_seconds(run, x, pws) / args.copies
            gguf = n * k * 4.5 / 8
            rows.append(dict(t=x.shape[0], variant="qmatmul Q4_K", us=sec * 1e6, bytes=gguf, ratio=gguf / sec / copy))
            print(f"T={x.shape[0]:2d} {'qmatmul Q4_K (Triton)':40s} {sec * 1e6:7.1f} us  {gguf / 1e6:6.1f} MB  "
                  f"{gguf / sec / copy:.2f} of copy", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(**environment(), copy_rate=copy, shape=[n, k], results=rows),
                                             indent=1))


if __name__ == "__main__":
    main()
