"""Where does qmatmul's time go? Times stripped variants of the Q4_K kernel on one 27B shape (17408 x 5120).

    python scripts/qmatmul_probe.py

full:       the shipped kernel (4-D tiles, nibbles, scales, bf16 tile, product)
no_scale:   same tiles and nibbles, no scale/min arithmetic
flat_u8:    the quant bytes as a 2-D [rows, cols] tile converted straight to bf16 (no 4-D tile, no nibbles, no
            reshape), one product per step: the load + convert + product floor at 4.5 bits/weight
flat_bf16:  a 2-D bf16 weight tile, as the dense path (16 bits/weight, rate counted on its own bytes)
splitk:     flat_bf16 with K split over `splits` programs per row band (partials summed by XLA)
gemv:       flat_bf16 at M=1 without a product: a [rows, cols] accumulator of w * x, summed at the end
stages:     flat_bf16 with 2, 4 or 5 pipeline stages
xla_bf16:   XLA's own x @ w.T on the bf16 weights (cuBLAS), the dense yardstick; `one` over one matrix of all copies
xla_rowsum: XLA's row sums of the bf16 weights: a read-only stream with no product
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import copy_rate, median_seconds  # noqa: E402

from dflash_jax.testing.random_weights import random_qtensor  # noqa: E402
from pallas_kernels import qmatmul as qm  # noqa: E402

N, K = 17408, 5120


def flat_kernel(cols, block_n, x_ref, w_ref, o_ref):
    r0 = pl.program_id(0) * block_n

    def body(i, acc):
        w = plt.load(w_ref.at[pl.ds(r0, block_n), pl.ds(i * cols, cols)], eviction_policy="evict_first")
        xt = x_ref[:, pl.ds(i * cols, cols)]
        return acc + jax.lax.dot_general(xt, w.astype(jnp.bfloat16), (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, w_ref.shape[1] // cols, body, jnp.zeros((x_ref.shape[0], block_n), jnp.float32))
    o_ref[:, pl.ds(r0, block_n)] = acc


def flat(x, w, block_n=32, cols=256, num_warps=4):
    return pl.pallas_call(functools.partial(flat_kernel, cols, block_n),
                          out_shape=jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32),
                          grid=(w.shape[0] // block_n,),
                          compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=3))(x, w)


def splitk_kernel(cols, block_n, steps, x_ref, w_ref, o_ref):
    r0, k0 = pl.program_id(0) * block_n, pl.program_id(1) * steps * cols

    def body(i, acc):
        w = plt.load(w_ref.at[pl.ds(r0, block_n), pl.ds(k0 + i * cols, cols)], eviction_policy="evict_first")
        xt = x_ref[:, pl.ds(k0 + i * cols, cols)]
        return acc + jax.lax.dot_general(xt, w.astype(jnp.bfloat16), (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((x_ref.shape[0], block_n), jnp.float32))
    o_ref[0, :, pl.ds(r0, block_n)] = acc


def splitk(x, w, block_n=32, cols=256, splits=4, num_warps=4, num_stages=3):
    steps = w.shape[1] // cols // splits
    part = pl.pallas_call(functools.partial(splitk_kernel, cols, block_n, steps),
                          out_shape=jax.ShapeDtypeStruct((splits, x.shape[0], w.shape[0]), jnp.float32),
                          grid=(w.shape[0] // block_n, splits),
                          in_specs=[pl.BlockSpec(x.shape, lambda i, j: (0, 0)),
                                    pl.BlockSpec(w.shape, lambda i, j: (0, 0))],
                          out_specs=pl.BlockSpec((1, x.shape[0], w.shape[0]), lambda i, j: (j, 0, 0)),
                          compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages))(x, w)
    return part.sum(axis=0)


def gemv_kernel(cols, block_n, x_ref, w_ref, o_ref):
    r0 = pl.program_id(0) * block_n

    def body(i, acc):
        w = plt.load(w_ref.at[pl.ds(r0, block_n), pl.ds(i * cols, cols)], eviction_policy="evict_first")
        return acc + w.astype(jnp.float32) * x_ref[0, pl.ds(i * cols, cols)].astype(jnp.float32)[None, :]

    acc = jax.lax.fori_loop(0, w_ref.shape[1] // cols, body, jnp.zeros((block_n, cols), jnp.float32))
    o_ref[0, pl.ds(r0, block_n)] = jnp.sum(acc, axis=1)


def gemv(x, w, block_n=16, cols=256, num_warps=4):
    return pl.pallas_call(functools.partial(gemv_kernel, cols, block_n),
                          out_shape=jax.ShapeDtypeStruct((1, w.shape[0]), jnp.float32),
                          grid=(w.shape[0] // block_n,),
                          compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=3))(x, w)


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", help="run the variants whose names start with these")
    only = ap.parse_args().only
    copy = copy_rate()
    print(f"copy {copy / 1e12:.2f} TB/s")
    qts = [random_qtensor(jax.random.key(i), "Q4_K", (N, K)) for i in range(12)]
    pws = [qm.pack(q) for q in qts]
    gguf = qts[0].nbytes
    x16 = jax.random.normal(jax.random.key(99), (16, K), jnp.float32).astype(jnp.bfloat16)
    x16h = x16[:, : K // 2]
    u8 = [p.data["qs"].reshape(N, K // 2) for p in pws]
    bf = [jax.random.normal(jax.random.key(i), (N // 4, K), jnp.float32).astype(jnp.bfloat16) for i in range(12)]
    rows = []

    def t(name, fn, args, nbytes):
        if only and not any(name.startswith(o) for o in only):
            return
        f = jax.jit(lambda a, ws: [fn(a, w) for w in ws])
        try:
            s = median_seconds(f, *args) / len(args[1])
        except Exception as e:  # a variant that does not compile is a finding, not a reason to stop
            print(f"{name:40s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            return
        rows.append((name, s * 1e6, nbytes / s / copy))
        print(f"{name:40s} {s * 1e6:8.1f} us {nbytes / s / copy:5.2f} of copy", flush=True)

    x1 = x16[:1]
    for bn in (32, 64):
        t(f"full M=1 bn={bn}", functools.partial(qm.qmatmul, block_n=bn, columns=256), (x1, pws), gguf)
    for bn, c, nw in ((32, 256, 4), (64, 256, 4), (64, 512, 4), (128, 256, 4), (128, 512, 8), (64, 1024, 4)):
        t(f"flat_u8 bn={bn} cols={c} w={nw}", functools.partial(flat, block_n=bn, cols=c, num_warps=nw),
          (x16h, u8), u8[0].nbytes)
    for bn, c in ((32, 256), (64, 256), (64, 512)):
        t(f"flat_bf16 bn={bn} cols={c}", functools.partial(flat, block_n=bn, cols=c), (x16, bf), bf[0].nbytes)
    for stages in (2, 4, 5):
        t(f"stages={stages} bf16 bn=32 cols=256", functools.partial(splitk, splits=1, num_stages=stages), (x16, bf),
          bf[0].nbytes)
    for bn, c, sp in ((32, 256, 2), (32, 256, 4), (64, 256, 4), (64, 512, 2), (128, 256, 4), (128, 128, 8)):
        t(f"splitk bf16 bn={bn} cols={c} splits={sp}", functools.partial(splitk, block_n=bn, cols=c, splits=sp),
          (x16, bf), bf[0].nbytes)
    for bn, c, nw in ((16, 256, 4), (32, 256, 4), (64, 128, 4), (16, 512, 4), (32, 512, 8)):
        t(f"gemv bf16 M=1 bn={bn} cols={c} w={nw}", functools.partial(gemv, block_n=bn, cols=c, num_warps=nw),
          (x16[:1], bf), bf[0].nbytes)
    t("xla_bf16 M=1", lambda a, w: a @ w.T, (x16[:1], bf), bf[0].nbytes)
    t("xla_bf16 M=16", lambda a, w: a @ w.T, (x16, bf), bf[0].nbytes)
    t("xla_rowsum", lambda a, w: jnp.sum(w, axis=1, dtype=jnp.float32), (x16[:1], bf), bf[0].nbytes)
    if not only or any("xla_bf16 one".startswith(o) or o.startswith("xla_bf16 one") for o in only):
        one = [jnp.concatenate(bf)]
        t("xla_bf16 one M=1", lambda a, w: a @ w.T, (x16[:1], one), one[0].nbytes)
        t("xla_rowsum one", lambda a, w: jnp.sum(w, axis=1, dtype=jnp.float32), (x16[:1], one), one[0].nbytes)
    print("\nprobe                                       us   of copy")
    for r in rows:
        print(f"{r[0]:40s} {r[1]:8.1f} {r[2]:5.2f}")


if __name__ == "__main__":
    main()
