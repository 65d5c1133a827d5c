"""Where the GDN kernels' time goes on the GPU: one 27B GDN layer (48 heads of 128 x 128, a 23-node tree) and the
48-layer commit, timed under variants of dot precision, state columns per program and warps.

    python scripts/gdn_probe.py > scripts/results/gdn_probe_<device>.txt

Each timed call runs the kernel over 16 layers' inputs (separate arrays) so that dispatch is a small part of it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import copy_rate, environment, gdn_layer_inputs, median_seconds  # noqa: E402

from pallas_kernels import gdn  # noqa: E402
from pallas_kernels import reference as ref  # noqa: E402

LAYERS, H, DK, DV, N = 16, 48, 128, 128, 23  # 16 layers' states: 50 MB, the H100's L2



def main() -> None:
    print(environment(), flush=True)
    copy = copy_rate()
    n_pad = 32
    xs, ssm = gdn_layer_inputs(0, LAYERS, n_pad, H, DK, DV)
    anc = jnp.tril(jnp.ones((n_pad, n_pad), bool))
    with jax.default_matmul_precision("highest"):
        want = ref.gdn_block(*(xs[0][k] for k in ("q", "k", "v", "g", "beta")), ssm[0], anc)[0]
    print(f"copy {copy / 1e12:.2f} TB/s; state read per layer {ssm[0].nbytes / 1e6:.1f} MB "
          f"= {ssm[0].nbytes / copy * 1e6:.1f} us at the copy rate", flush=True)
    for prec in ("f32", "tf32x3", "tf32"):
        for block_v in (16, 32, 128):
            for warps in (4, 8):
                if prec == "f32" and block_v != 16:
                    continue  # measured before: 97-800 us per layer, slowest with few warps
                run = jax.jit(lambda xs, ssm, bv=block_v, w=warps: [gdn.gdn_blocks(
                    x["q"], x["k"], x["v"], x["g"], x["beta"], ssm[i], anc, block_n=n_pad, final=False,
                    block_v=bv, num_warps=w, precision=prec)[0] for i, x in enumerate(xs)])
                try:
                    err = float(jnp.linalg.norm(run(xs, ssm)[0] - want) / jnp.linalg.norm(want))
                    t = median_seconds(run, xs, ssm) / LAYERS
                except Exception as e:
                    print(f"verify {prec:8s} block_v={block_v:3d} warps={warps}: {type(e).__name__} {str(e)[:150]}")
                    continue
                print(f"verify {prec:8s} block_v={block_v:3d} warps={warps}: {t * 1e6:7.1f} us/layer  err {err:.1e}",
                      flush=True)
    k = jnp.stack([x["k"][:N] for x in xs])
    vn = jnp.stack([x["v"][:N] for x in xs])
    gm = jnp.stack([jnp.cumsum(x["g"][:N], 0) for x in xs])
    path, leaf = jnp.ones(N, bool), jnp.int32(N - 1)
    for block_v in (16, 32, 128):
        for warps in (4, 8):
            run = jax.jit(lambda s, bv=block_v, w=warps: gdn.gdn_commit(s, k, vn, gm, path, leaf, block_v=bv,
                                                                         num_warps=w, precision="tf32x3"))
            t = median_seconds(run, ssm)
            print(f"commit block_v={block_v:3d} warps={warps}: {t * 1e6:7.1f} us for {LAYERS} layers "
                  f"(state read + write floor {2 * ssm.nbytes / copy * 1e6:.0f} us)", flush=True)
    noop = jax.jit(lambda s: s * 1.0)
    print(f"elementwise pass over the state: {median_seconds(noop, ssm) * 1e6:.0f} us", flush=True)


if __name__ == "__main__":
    main()
