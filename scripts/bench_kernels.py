"""Kernel benchmarks on the GPU, as ratios to the copy rate measured in the same run (issue 5, DESIGN.md).

    python scripts/bench_kernels.py --out scripts/results/kernels_<device>.json [--sweep]

qmatmul: every 27B matrix shape in its Q4_K_M type, at M = 1 and M = 32 tokens, against XLA's dequantize-then-dot
on the same weights. Rate = the weight's GGUF bytes / time (the packed layout reads up to 2.8% more; both are
listed). Each timed call runs the product over enough copies of the weight to be several times the L2, so the
weights stream from HBM and dispatch is a small part of the time. `--sweep` also times tile variants.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import copy_rate, environment, median_seconds  # noqa: E402

from dflash_jax.quant import dequantize  # noqa: E402
from dflash_jax.testing.random_weights import random_qtensor  # noqa: E402
from pallas_kernels import qmatmul as qm  # noqa: E402

# (name, fmt, N (out), K (in)) of the 27B's matrices; ffn_down and attn_qkv come in two types in Q4_K_M files.
SHAPES = [
    ("ffn_gate/up", "Q4_K", 17408, 5120),
    ("ffn_down", "Q4_K", 5120, 17408),
    ("ffn_down", "Q6_K", 5120, 17408),
    ("attn_qkv", "Q4_K", 10240, 5120),
    ("attn_qkv", "Q5_K", 10240, 5120),
    ("attn_gate", "Q4_K", 6144, 5120),
    ("ssm_out", "Q4_K", 5120, 6144),
    ("attn_q", "Q4_K", 12288, 5120),
    ("attn_output", "Q4_K", 5120, 6144),
    ("ssm_alpha", "Q8_0", 48, 5120),
    ("output", "Q6_K", 248320, 5120),
    ("drafter fc", "BF16", 5120, 25600),
]
MIN_BYTES = 512 * 2**20  # stream at least this much per timed call (H100 L2: 50 MB)


def _copies(fmt: str, n: int, k: int):
    one = random_qtensor(jax.random.key(0), fmt, (n, k))
    reps = max(2, min(64, math.ceil(MIN_BYTES / one.nbytes)))
    return [random_qtensor(jax.random.key(i), fmt, (n, k)) for i in range(reps)], one.nbytes


def bench_qmatmul(ms: list[int], copy: float, sweep: bool, only: set[str] | None = None) -> list[dict]:
    rows = []
    for name, fmt, n, k in SHAPES:
        if only and f"{name}:{fmt}" not in only:
            continue
        qts, gguf_bytes = _copies(fmt, n, k)
        packed = [qm.pack(q) for q in qts]
        for m in ms:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
            ref = qm.qmatmul_reference(x, packed[0])
            variants = [dict()]
            if sweep:
                variants += [dict(block_n=bn, columns=c, num_warps=nw)
                             for bn in (16, 32, 64) for c in (256, 512, 1024) for nw in (4, 8)]
            for opts in variants:
                try:
                    run = jax.jit(lambda x, ws, o=opts: [qm.qmatmul(x, w, **o) for w in ws])
                    out = run(x, packed)[0]
                    err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
                    t = median_seconds(run, x, packed) / len(packed)
                except Exception as e:  # a tile that does not compile is a result of the sweep, not a failure
                    print(f"  {name} {fmt} M={m} {opts}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                rows.append(dict(kernel="qmatmul", matrix=name, fmt=fmt, n=n, k=k, m=m, **(opts or {"tile": "default"}),
                                 us=t * 1e6, gguf_bytes=gguf_bytes, packed_bytes=packed[0].nbytes,
                                 rate=gguf_bytes / t, ratio=gguf_bytes / t / copy, rel_err=err))
                print(f"  {name:12s} {fmt} M={m:2d} {str(opts or 'default'):45s} {t*1e6:8.1f} us "
                      f"{gguf_bytes / t / 1e12:5.2f} TB/s  {gguf_bytes / t / copy:5.2f} of copy  err {err:.1e}",
                      flush=True)
            if not sweep or m == ms[0]:
                xla = jax.jit(lambda x, ws: [jnp.dot(x, dequantize(w).astype(jnp.bfloat16).T,
                                                     preferred_element_type=jnp.float32) for w in ws])
                t = median_seconds(xla, x, qts) / len(qts)
                rows.append(dict(kernel="xla_dequant_dot", matrix=name, fmt=fmt, n=n, k=k, m=m, us=t * 1e6,
                                 gguf_bytes=gguf_bytes, rate=gguf_bytes / t, ratio=gguf_bytes / t / copy))
                print(f"  {name:12s} {fmt} M={m:2d} {'XLA dequantize-then-dot':45s} {t*1e6:8.1f} us "
                      f"{gguf_bytes / t / 1e12:5.2f} TB/s  {gguf_bytes / t / copy:5.2f} of copy", flush=True)
        del qts, packed
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="results JSON")
    ap.add_argument("--sweep", action="store_true", help="also time tile variants of qmatmul")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 32], help="token counts for qmatmul")
    ap.add_argument("--only", nargs="+", help="matrices to run, as NAME:FMT (e.g. ffn_down:Q6_K)")
    args = ap.parse_args()
    env = environment()
    copy = copy_rate()
    print(f"{env}\ncopy rate {copy / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = bench_qmatmul(args.m, copy, args.sweep, set(args.only or ()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(env, copy_rate=copy, results=rows), indent=1))
    print("\nqmatmul, default tiles (ratio = GGUF weight bytes/s over the copy rate)")
    print(f"{'matrix':12s} {'fmt':5s} {'N':>6s} {'K':>6s} " + " ".join(f"{'M=' + str(m):>13s}" for m in args.m)
          + "   XLA M=" + str(args.m[0]))
    for name, fmt, n, k in SHAPES:
        if args.only and f"{name}:{fmt}" not in args.only:
            continue
        cells = []
        for m in args.m:
            r = next((r for r in rows if r["kernel"] == "qmatmul" and r["matrix"] == name and r["fmt"] == fmt
                      and r["m"] == m and r.get("tile") == "default"), None)
            cells.append(f"{r['us']:6.1f}us {r['ratio']:4.2f}" if r else f"{'-':>13s}")
        x = next((r for r in rows if r["kernel"] == "xla_dequant_dot" and r["matrix"] == name and r["fmt"] == fmt
                  and r["m"] == args.m[0]), None)
        print(f"{name:12s} {fmt:5s} {n:6d} {k:6d} " + " ".join(cells) + (f"   {x['ratio']:4.2f}" if x else ""))


if __name__ == "__main__":
    main()
