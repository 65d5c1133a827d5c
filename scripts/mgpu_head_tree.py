"""Whether a DDTree built in one jitted function from logits that pass through a Mosaic GPU kernel's head is the tree
of the same logits built apart (a GPU check of a failure found and fixed; see scripts/results/mgpu_head_tree_h100.txt).

    python scripts/mgpu_head_tree.py --fmt Q6_K --rows 248320   # the 27B's output head

The logits are the benchmarks' forced ones (testing/oracle.py: noise, the sequence's token raised by 12) plus 1e-3
times a random weight's product with x (as ForcedDrafter adds a real drafter's): the tree's tokens follow the
sequence. "plain" builds the tree on that sum in one jit; "barrier" puts an optimization barrier between the two
parts and the sum; "row-major head" and "row-major sum" hold the head's product, or the sum, to the row-major layout
(jax.experimental.layout): the kernel's output is [N, tokens] transposed. The rest narrow it down: the top 1 of a
bare `lax.top_k` and the argmax of the sum in the jit; the raise written as a one-hot sum instead of oracle_logits'
scatter; the tree of the forced logits alone in a jit that also runs the head; the tree with a plain [4, N, 16] array
summed and transposed as the kernel's output is (no Mosaic kernel); the tree of the sum returned from one jit built
in another; last, a bare `lax.top_k` of a column-major jit argument. Each is run twice. A tree is checked on its
root and its top-1 chain (nodes 0-15): its further nodes, rank-2 and rank-3 siblings of near-equal noise, may come
in another order when 1e-3 of the head moves their log-probabilities.

On an H100 (jax 0.11.2) the trees came out wrong until tree.top_log_probs held its logits row-major: XLA's GPU
top-k kernel read the column-major sum as row-major. The bare `lax.top_k` variant still shows that.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout, with_layout_constraint
from jax.sharding import SingleDeviceSharding

from dflash_jax.config import EngineConfig
from dflash_jax.engine import step as S
from dflash_jax.testing import synthetic
from dflash_jax.testing.oracle import oracle_logits
from pallas_kernels import qmatmul as qm


ROW_MAJOR = Layout((0, 1))


def boosted(sequence: jax.Array, position: jax.Array, vocab_size: int) -> jax.Array:
    """oracle_logits at error rate 0 (the same noise and raised tokens) with the raise as a one-hot sum, no scatter."""
    pos = position + jnp.arange(1, 16)
    true = sequence[pos]
    keys = jax.vmap(lambda p: jax.random.fold_in(jax.random.PRNGKey(0), p))(pos)
    noise = jax.vmap(lambda k: jax.random.normal(jax.random.split(k, 3)[0], (vocab_size,)))(keys)
    return noise + jnp.where(jnp.arange(vocab_size) == true[:, None], 12.0, 0.0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fmt", choices=("Q4_K", "Q6_K"), default="Q6_K")
    ap.add_argument("--rows", type=int, default=248320, help="the head's rows (the vocabulary)")
    ap.add_argument("--cols", type=int, default=5120, help="the head's columns (the hidden size)")
    args = ap.parse_args(argv)
    v = args.rows
    qm.MGPU_LAYOUT, qm.MGPU_FORMATS = "only", ("Q4_K", "Q6_K")
    w = qm.pack(synthetic.random_matrix(jax.random.key(0), args.fmt, (v, args.cols)))
    ecfg = EngineConfig(mode="ddtree", budget=22, max_ctx=256)
    seq = jnp.asarray(np.random.default_rng(5).integers(0, v, 320), jnp.int32)
    pos, root = jnp.int32(64), jnp.int32(7)
    forced = lambda s: oracle_logits(s, pos, 15, v, jnp.float32(0), 0)  # noqa: E731
    x = jax.random.normal(jax.random.key(1), (15, args.cols), jnp.float32)
    true = np.asarray(seq[65:80])  # the raised token at each depth: every row's top 1
    want = np.concatenate([[7], true])  # the tree's root and its top-1 chain, nodes 0-15 (chain_seed)
    head = lambda x, w: 1e-3 * qm.qmatmul(x, w)  # noqa: E731
    tree = lambda logits: S.step_tree(ecfg, root, logits).tokens[:16]  # noqa: E731
    variants = {  # name: (function of (x, w, seq), what it should give)
        "plain": (lambda x, w, s: tree(forced(s) + head(x, w)), want),
        "barrier": (lambda x, w, s: tree(jnp.add(*jax.lax.optimization_barrier((forced(s), head(x, w))))), want),
        "row-major head": (lambda x, w, s: tree(forced(s) + with_layout_constraint(head(x, w), ROW_MAJOR)), want),
        "row-major sum": (lambda x, w, s: tree(with_layout_constraint(forced(s) + head(x, w), ROW_MAJOR)), want),
        "top_k's top 1": (lambda x, w, s: jax.lax.top_k(forced(s) + head(x, w), 8)[1][:, 0], true),
        "argmax": (lambda x, w, s: jnp.argmax(forced(s) + head(x, w), axis=-1), true),
        "tree beside the head": (lambda x, w, s: (tree(forced(s)), head(x, w))[0], want),
        "one-hot boosts": (lambda x, w, s: tree(boosted(s, pos, v) + head(x, w)), want),
        # no Mosaic kernel: an array shaped as its output, [splits, N, tokens], summed and transposed as qmatmul does
        "tree, a transposed array for the head": (lambda x, w, s: tree(forced(s) + 1e-3 * x.sum(0)[:v, :15].T), want),
    }
    y = jax.random.normal(jax.random.key(2), (4, v, 16), jnp.float32)
    for name, (fn, expected) in variants.items():
        got = [np.asarray(jax.jit(fn)(y if "array" in name else x, w, seq)) for _ in range(2)]
        print(args.fmt, v, name, ["OK" if (g == expected).all() else f"WRONG {g[:6]}" for g in got], flush=True)
    logits = jax.jit(lambda x, w, s: forced(s) + head(x, w))(x, w, seq)  # the sum returned, then a tree of it
    ok = (np.asarray(jax.jit(tree)(logits)) == want).all()
    print(args.fmt, v, "tree of the returned sum", "OK" if ok else "WRONG", flush=True)
    column_major = Format(Layout((1, 0)), SingleDeviceSharding(jax.devices()[0]))
    arg = jax.device_put(np.asarray(logits), column_major)
    top = jax.jit(lambda a: jax.lax.top_k(a, 8)[1][:, 0], in_shardings=column_major)(arg)
    print(args.fmt, v, "lax.top_k's top 1 of a column-major argument",
          "OK" if (np.asarray(top) == true).all() else "WRONG", flush=True)


if __name__ == "__main__":
    main()
