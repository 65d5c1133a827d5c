"""qmatmul products for Nsight Compute to profile: occupancy, registers, DRAM throughput and stalls.

    ncu --clock-control none --kernel-name regex:'qmatmul|mma_int8' --launch-count 6 --section SpeedOfLight \
        --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        python scripts/qmatmul_ncu.py [--products 23:bf16 23:int8] > ncu.txt

Each product runs twice (the first compiles), by default ffn_gate (Q4_K 17408 x 5120) at M = 1 and M = 32 and
ffn_down (Q6_K 5120 x 17408) at M = 1; `--products M:KERNEL ...` profiles ffn_gate at M tokens through the bf16
tensor-core kernel, the int8 one (mma_int8.py), the bf16 one reading x through `plane_view` (`view`) instead, or the
Mosaic GPU kernel (`mgpu`, qmatmul_mgpu.py, Hopper only). ncu replays a kernel many times over the same weights, so
part of them comes from the L2 (50 MB on an H100): its durations are optimistic; the occupancy, register and stall
figures are what it is for.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_jax.testing.random_weights import random_qtensor  # noqa: E402
from pallas_kernels import qmatmul as qm  # noqa: E402
from pallas_kernels import qmatmul_mgpu  # noqa: E402

PRODUCTS = [("Q4_K", 17408, 5120, 1, {}), ("Q4_K", 17408, 5120, 32, {}), ("Q6_K", 5120, 17408, 1, {})]
KERNELS = {"bf16": {"int8_mma": False, "x_view": False}, "int8": {"int8_mma": True},
           "view": {"int8_mma": False, "x_view": True}, "mgpu": "mgpu"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--products", nargs="+", metavar="M:KERNEL",
                    help=f"ffn_gate at M tokens, KERNEL one of {', '.join(KERNELS)}")
    args = ap.parse_args(argv)
    specs = [spec.split(":") for spec in args.products or ()]
    unknown = sorted({kernel for _, kernel in specs} - set(KERNELS))
    if unknown:
        raise SystemExit(f"unknown kernel(s) {', '.join(unknown)}; the kernels are {', '.join(KERNELS)}")
    products = [("Q4_K", 17408, 5120, int(m), KERNELS[kernel]) for m, kernel in specs] if specs else PRODUCTS
    for fmt, n, k, m, opts in products:
        qt = random_qtensor(jax.random.key(0), fmt, (n, k))
        x = jax.random.normal(jax.random.key(1), (m, k)).astype(jnp.bfloat16)
        if opts == "mgpu":
            product = functools.partial(qmatmul_mgpu.qmatmul, x, qmatmul_mgpu.pack(qt))
        else:
            product = functools.partial(qm.qmatmul, x, qm.pack(qt), **opts)
        for _ in range(2):
            jax.block_until_ready(product())


if __name__ == "__main__":
    main()
