"""Where a one-token product's time goes: the GPU kernel times of 12 qmatmul calls from a jax.profiler trace,
against the wall time per product, and a tile and split sweep of the GEMV on the small matrices.

    python scripts/qmatmul_trace.py [--nosweep]

"wall" is the median time of one jitted call of 12 products (each on its own copy of the weight) over 12; "GPU span"
is first kernel start to last kernel end over three traced calls, per product; below it, each kernel on the GPU's
streams with its count and time per product. Wall and span both take in more than the kernels: the calls'
dispatch and the waits for their results, and any gaps between launches. Run it under XLA_FLAGS to compare
runtime settings (the flags are printed first).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import copy_rate, median_seconds, traced_gpu_events  # noqa: E402

from dflash_jax.testing.random_weights import random_qtensor  # noqa: E402
from pallas_kernels import qmatmul as qm  # noqa: E402

SHAPES = [("attn_gate", "Q4_K", 6144, 5120), ("ffn_gate", "Q4_K", 17408, 5120), ("ssm_alpha", "Q8_0", 48, 5120),
          ("ssm_out", "Q4_K", 5120, 6144)]
COPIES = 12


def kernel_times(fn, *args, calls: int = 3) -> tuple[dict[str, tuple[float, float]], float]:
    """({kernel: (launches, us) per call}, span in us per call) from a trace of `calls` calls, on the GPU streams."""
    total, count = collections.Counter(), collections.Counter()
    starts, ends = [], []
    for name, start, duration in traced_gpu_events(fn, *args, calls=calls):
        total[name] += duration / 1e3
        count[name] += 1
        starts.append(start)
        ends.append(start + duration)
    span = (max(ends) - min(starts)) / 1e3 / calls if starts else float("nan")
    return {k: (count[k] / calls, total[k] / calls) for k in total}, span


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nosweep", action="store_true", help="only the traces")
    args = ap.parse_args()
    print("XLA_FLAGS", os.environ.get("XLA_FLAGS"))
    print(f"copy {copy_rate() / 1e12:.2f} TB/s", flush=True)
    for name, fmt, n, k in SHAPES:
        qts = [random_qtensor(jax.random.key(i), fmt, (n, k)) for i in range(COPIES)]
        pws = [qm.pack(q) for q in qts]
        gguf = qts[0].nbytes
        del qts
        x = jax.random.normal(jax.random.key(9), (1, k), jnp.float32)
        products = jax.jit(lambda a, ws: [qm.qmatmul(a, w) for w in ws])
        wall = median_seconds(products, x, pws, iters=20) / COPIES * 1e6
        kernels, span = kernel_times(products, x, pws)
        print(f"\n== {name} {fmt} {n}x{k}: wall {wall:.1f} us per product, GPU span {span / COPIES:.1f} us per "
              f"product, {gguf / 1e6:.1f} MB", flush=True)
        for kn, (c, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:8]:
            print(f"   {kn[:70]:70s} x{c:5.1f} {us / COPIES:8.1f} us per product", flush=True)
        if name == "ffn_gate" or args.nosweep:
            continue
        res = []
        for bn in (8, 16, 32):
            for cols in (256, 512, 1024):
                for sp in (1, 2, 4, 8):
                    run = jax.jit(lambda a, ws, o=dict(block_n=bn, columns=cols, splits=sp):
                                  [qm.qmatmul(a, w, **o) for w in ws])
                    try:
                        res.append((median_seconds(run, x, pws, iters=20) / COPIES * 1e6, bn, cols, sp))
                    except ValueError as e:  # a split that does not divide the K steps
                        print(f"   bn={bn} cols={cols} sp={sp}: {e}")
        res.sort()
        print("   best tiles:", ", ".join(f"bn={b} cols={c} sp={s}: {t:.1f} us" for t, b, c, s in res[:6]))
        print("   worst:", ", ".join(f"bn={b} cols={c} sp={s}: {t:.1f} us" for t, b, c, s in res[-3:]), flush=True)


if __name__ == "__main__":
    main()
