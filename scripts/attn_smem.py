"""Shared memory of tree-attention tiles as Triton compiles them for sm_90, on a CPU: the 27B's and the drafter's
heads, bfloat16 and float32 caches (and the target's in the block types q8_0, q4_0 and rq3_0), 32/64 rows a program,
2/3 pipeline stages, and which one the kernel's defaults take. A tile over the SM's 227 KiB (232448 bytes) fails to
launch. `stack` is cuobjdump's STACK: bytes of local memory a thread takes, registers spilled to it.

    pip install triton        # the Triton compiler, with ptxas (Linux x86-64 wheels)
    python scripts/attn_smem.py --out scripts/results/attn_smem_sm90.txt

As in qmatmul_sass.py, pip's Triton is not the one inside jaxlib: on an H200 jaxlib's asked 283136 bytes for the
27B's float32 caches at 32 rows and 3 stages, where pip's counts 282624.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import attention_heads  # noqa: E402
from qmatmul_sass import compile_sm90, lowered_triton  # noqa: E402

from dflash_jax import kv_quant as kvq  # noqa: E402
from pallas_kernels import tree_attention as ta  # noqa: E402

SM_SHARED = 232448
TOKENS, SLOTS = 23, 33280


def triton_ir(hq: int, hkv: int, d: int, kind: str, **opts) -> tuple[str, int, int]:
    """(Triton IR in MLIR's generic form, num_warps, num_stages) of the kernel for a 23-token tree over 32K slots of
    a cache in KV type `kind` (K and V)."""
    q = jnp.ones((TOKENS, hq, d), jnp.float32)
    cache, blk = kvq.empty(kind, (1, SLOTS, hkv, d)), kvq.empty(kind, (TOKENS, hkv, d))
    run = jax.jit(lambda *a: ta.tree_attention(*a, layer=0, **opts))
    return lowered_triton(run, q, cache, cache, jnp.int32(SLOTS), blk, blk, jnp.ones((TOKENS, TOKENS), bool),
                          jnp.zeros(TOKENS, jnp.int32))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import triton

    lines = [f"tree attention, {TOKENS} tokens over {SLOTS} slots, sm_90 (triton {triton.__version__}), jax "
             f"{jax.__version__}; default: the tile "
             "tree_attention takes without options at 32 and 64 rows",
             f"{'heads':8s} {'cache':6s} {'rows':>4s} {'stages':>6s} {'smem':>7s} {'fits':>5s} {'default':>7s} "
             f"{'stack':>6s}"]
    heads = attention_heads()
    kinds = {"target": ("bf16", "f32", "q8_0", "q4_0", "rq3_0"), "drafter": ("bf16", "f32")}
    for name, (hq, hkv, d) in heads.items():
        for kind, rows, stages in itertools.product(kinds[name], (32, 64), (2, 3)):
            _, _, usage, shared = compile_sm90(*triton_ir(hq, hkv, d, kind, block_rows=rows, num_stages=stages))
            cache = kvq.empty(kind, (1, d))
            default = stages == ta.default_stages(64, 2 * ta.row_bytes(cache))
            stack = re.search(r"STACK:(\d+)", usage).group(1)
            lines.append(f"{name:8s} {kind:6s} {rows:4d} {stages:6d} {shared:7d} "
                         f"{str(shared <= SM_SHARED):>5s} {'yes' if default else '':>7s} {stack:>6s}")
            print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
