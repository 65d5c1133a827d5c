"""Which tree-attention tiles launch on this GPU: the kernel at the 27B's and the drafter's heads for 1, 23 and 64
query tokens, three cache sizes, 32/64 rows a program and 2/3 pipeline stages, bfloat16 caches (the benchmark's); a
tile whose shared memory exceeds the SM's fails at launch (RESOURCE_EXHAUSTED). scripts/attn_smem.py counts the
shared memory of the float32 ones too, on a CPU.

    python scripts/attn_fit_probe.py > scripts/results/attn_fit_h200.txt
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import attention_heads  # noqa: E402

from pallas_kernels.tree_attention import tree_attention  # noqa: E402


def main() -> None:
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    heads = attention_heads()
    for (name, (hq, hkv, d)), n, slots in itertools.product(heads.items(), (1, 23, 64), (128, 4160, 33280)):
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (n, hq, d), jnp.bfloat16)
        cache = jax.random.normal(keys[1], (1, slots, hkv, d), jnp.bfloat16)
        blk = jax.random.normal(keys[2], (n, hkv, d), jnp.bfloat16)
        mask = jnp.tril(jnp.ones((n, n), bool))
        row = []
        for rows, stages in itertools.product((32, 64), (2, 3)):
            try:
                out = tree_attention(q, cache, cache, jnp.int32(slots), blk, blk, mask, jnp.zeros(n, jnp.int32),
                                     layer=0, block_rows=rows, num_stages=stages)
                out.block_until_ready()
                row.append(f"{rows}x{stages} ok")
            except Exception as e:  # noqa: BLE001 - the launch error is what this probe reports
                msg = str(e).split("\n")[0]
                row.append(f"{rows}x{stages} FAIL({msg[msg.find('requested'):][:40]})")
        print(f"{name:8s} n={n:2d} slots={slots:5d}: " + "; ".join(row), flush=True)


if __name__ == "__main__":
    main()
