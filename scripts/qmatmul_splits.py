"""qmatmul with K split over 1, 2, 4 and 8 programs, on the 27B's narrow matrices (and ffn_gate as a control).

    python scripts/qmatmul_splits.py [--out FILE.json]

Each timed call runs the product over enough copies of the weight to be several times the L2. Ratio = GGUF weight
bytes per second over the device-to-device copy rate measured in the same run. A split that does not divide the
K steps is reported as failed (the kernel refuses it).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import copy_rate, environment, median_seconds  # noqa: E402

from dflash_jax.testing.random_weights import random_qtensor  # noqa: E402
from pallas_kernels import qmatmul as qm  # noqa: E402

SHAPES = [("ffn_down", "Q4_K", 5120, 17408), ("ffn_down", "Q6_K", 5120, 17408), ("ssm_out", "Q4_K", 5120, 6144),
          ("attn_gate", "Q4_K", 6144, 5120), ("ssm_alpha", "Q8_0", 48, 5120), ("ffn_gate", "Q4_K", 17408, 5120)]
MIN_BYTES = 512 * 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    copy = copy_rate()
    print(f"copy {copy / 1e12:.2f} TB/s", flush=True)
    rows = []
    for name, fmt, n, k in SHAPES:
        one = random_qtensor(jax.random.key(0), fmt, (n, k))
        reps = max(2, min(32, math.ceil(MIN_BYTES / one.nbytes)))
        weights = [qm.pack(random_qtensor(jax.random.key(i), fmt, (n, k))) for i in range(reps)]
        for m in (1, 32):
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
            ref = qm.qmatmul_reference(x, weights[0])
            for splits in (1, 2, 4, 8):
                label = f"{name} {fmt} M={m} splits={splits}"
                run = jax.jit(lambda x, ws, s=splits: [functools.partial(qm.qmatmul, splits=s)(x, w) for w in ws])
                try:
                    err = float(jnp.linalg.norm(run(x, weights)[0] - ref) / jnp.linalg.norm(ref))
                    t = median_seconds(run, x, weights) / reps
                except ValueError as e:  # a split that does not divide the K steps
                    print(f"{label:40s} failed: {e}", flush=True)
                    continue
                rows.append(dict(matrix=name, fmt=fmt, n=n, k=k, m=m, splits=splits, us=t * 1e6,
                                 ratio=one.nbytes / t / copy, rel_err=err))
                print(f"{label:40s} {t * 1e6:8.1f} us {one.nbytes / t / copy:5.2f} err {err:.1e}", flush=True)
        del weights
    if args.out:
        args.out.write_text(json.dumps(dict(environment(), copy_rate=copy, results=rows), indent=1))


if __name__ == "__main__":
    main()
