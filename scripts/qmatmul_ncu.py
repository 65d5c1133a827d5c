"""qmatmul products for Nsight Compute to profile: occupancy, registers, DRAM throughput and stalls.

    ncu --clock-control none --kernel-name regex:'qmatmul|gemv' --launch-count 6 --section SpeedOfLight \
        --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        python scripts/qmatmul_ncu.py [--products 23:triton 23:mgpu] > ncu.txt

Each product runs twice (the first compiles), by default ffn_gate (Q4_K 17408 x 5120) at M = 1 (the int8 GEMV) and
M = 32 (the Triton tensor-core kernel) and ffn_down (Q6_K 5120 x 17408) at M = 1; `--products M:LAYOUT ...` profiles
ffn_gate at M tokens in the Triton layout (`triton`: the GEMV or the tensor-core kernel) or the Mosaic GPU one
(`mgpu`, qmatmul_mgpu.py, Hopper only). ncu replays a kernel many times over the same weights, so part of them comes
from the L2 (50 MB on an H100): its durations are optimistic; the occupancy, register and stall figures are what it
is for.
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

PRODUCTS = [("Q4_K", 17408, 5120, 1, "off"), ("Q4_K", 17408, 5120, 32, "off"), ("Q6_K", 5120, 17408, 1, "off")]
LAYOUTS = {"triton": "off", "mgpu": "only"}  # qmatmul.pack's `mgpu`


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--products", nargs="+", metavar="M:LAYOUT",
                    help=f"ffn_gate at M tokens, LAYOUT one of {', '.join(LAYOUTS)}")
    args = ap.parse_args(argv)
    specs = [spec.split(":") for spec in args.products or ()]
    unknown = sorted({layout for _, layout in specs} - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"unknown layout(s) {', '.join(unknown)}; the layouts are {', '.join(LAYOUTS)}")
    products = [("Q4_K", 17408, 5120, int(m), LAYOUTS[layout]) for m, layout in specs] if specs else PRODUCTS
    for fmt, n, k, m, layout in products:
        qt = random_qtensor(jax.random.key(0), fmt, (n, k))
        x = jax.random.normal(jax.random.key(1), (m, k)).astype(jnp.bfloat16)
        product = functools.partial(qm.qmatmul, x, qm.pack(qt.fmt, qt.shape, qt.data, mgpu=layout))
        for _ in range(2):
            jax.block_until_ready(product())


if __name__ == "__main__":
    main()
