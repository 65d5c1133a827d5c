"""DDTree on the device (specs/dflash_ddtree.md §3, specs/lucebox.md §2.5): draft logits -> the tree to verify.

Best-first expansion over the draft's per-depth top-K log-probabilities: a candidate is (joint log-prob w, parent,
depth, rank); popping one appends a node and pushes its next sibling and its first child. The candidate pool is a
fixed array (each pop adds at most two), so the whole build is one `fori_loop` with static shapes. Node 0 is the
root; nodes are numbered in insertion order, so a parent always precedes its children.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    """A tree of N = budget + 1 nodes (node 0 the root); nodes the build could not fill are marked invalid."""

    tokens: jax.Array  # [N] int32, tokens[0] = the root token
    parents: jax.Array  # [N] int32, -1 for the root; invalid nodes hang off the root
    depths: jax.Array  # [N] int32, 0 for the root
    valid: jax.Array  # [N] bool
    logw: jax.Array  # [N] float32 joint draft log-prob of the node's prefix (0 for the root)


def top_log_probs(logits: jax.Array, k: int, spmd: bool = False) -> tuple[jax.Array, jax.Array]:
    """Per depth: the top-k log-probabilities (full-vocabulary normalisation) and their token ids, best first
    (`spmd`: in a program over several devices, `build_tree`)."""
    # XLA's GPU top-k kernel (__gpu$TopK) reads its operand as row-major whatever its layout; logits summed from the
    # Mosaic kernel's transposed [V, tokens] head product reached it column-major and gave another vocabulary's top-k
    # (H100, jax 0.11.2: scripts/mgpu_head_tree.py)
    logits = with_layout_constraint(logits.astype(jnp.float32), Layout(tuple(range(logits.ndim))))
    # the barrier keeps XLA on CPU from rewriting top_k as a full sort of the vocabulary (38 ms for 15 x 8192 on
    # two cores, against 0.5 ms) when a caller slices its outputs (the chain seed's lp[:, 0])
    if spmd:  # XLA's CPU TopkDecomposer crashes on a barrier of top_k's pair in a multi-device program (jax 0.10.2)
        values, ids = jax.lax.top_k(logits, k)
        values, ids = jax.lax.optimization_barrier(values), jax.lax.optimization_barrier(ids)
    else:
        values, ids = jax.lax.optimization_barrier(jax.lax.top_k(logits, k))
    return values - jax.nn.logsumexp(logits, axis=-1, keepdims=True), ids.astype(jnp.int32)


def build_tree(root: jax.Array, logits: jax.Array, budget: int, topk: int, chain_seed: bool, spmd: bool = False
               ) -> Tree:
    """The DDTree of `budget` nodes below root from draft logits [L, V] (row d-1 is the distribution at depth d).

    chain_seed inserts the top-1 chain (depths 1..min(L, budget)) first and queues its rank-1 siblings, as the C++
    engine does; without it this is the paper's builder (the heap starts at depth 1, rank 0). `spmd`: the tree is
    built inside a program over several devices (dflash_jax/parallel.py), which needs another form of its top-k.
    """
    depth_limit = logits.shape[0]
    lp, ids = top_log_probs(logits, topk, spmd)
    n = budget + 1
    pool = 2 * budget + depth_limit + 1
    chain = min(depth_limit, budget) if chain_seed else 0

    nodes = dict(tokens=jnp.zeros(n, jnp.int32).at[0].set(root), parents=jnp.full(n, -1, jnp.int32).at[1:].set(0),
                 depths=jnp.zeros(n, jnp.int32).at[1:].set(1), valid=jnp.zeros(n, bool).at[0].set(True),
                 logw=jnp.zeros(n, jnp.float32))
    cand = dict(w=jnp.zeros(pool, jnp.float32), parent=jnp.zeros(pool, jnp.int32),
                depth=jnp.ones(pool, jnp.int32), rank=jnp.zeros(pool, jnp.int32), live=jnp.zeros(pool, bool))

    def push(cand, count, ok, w, parent, depth, rank):
        i = jnp.where(ok, count, pool)  # out of range: dropped
        cand = {key: cand[key].at[i].set(val, mode="drop")
                for key, val in dict(w=w, parent=parent, depth=depth, rank=rank, live=True).items()}
        return cand, count + ok.astype(jnp.int32)

    def place(nodes, at, token, parent, depth, w):
        new = dict(tokens=token, parents=parent, depths=depth, valid=True, logw=w)
        return {key: nodes[key].at[at].set(new[key]) for key in nodes}

    count = jnp.int32(0)
    if chain:
        cum = jnp.cumsum(lp[:, 0])
        for d in range(1, chain + 1):
            nodes = place(nodes, d, ids[d - 1, 0], d - 1, d, cum[d - 1])
            if topk > 1:
                cand, count = push(cand, count, jnp.bool_(True), cum[d - 1] - lp[d - 1, 0] + lp[d - 1, 1], d - 1, d, 1)
    else:
        cand, count = push(cand, count, jnp.bool_(True), lp[0, 0], 0, 1, 0)

    def pop(node, carry):
        nodes, cand, count = carry
        score = jnp.where(cand["live"], cand["w"], -jnp.inf)
        best = jnp.argmax(score)  # ties: the earliest pushed
        best = jnp.where(cand["live"][best], best, jnp.argmax(cand["live"]))
        ok = cand["live"][best]
        w, parent, depth, rank = cand["w"][best], cand["parent"][best], cand["depth"][best], cand["rank"][best]
        cand = {**cand, "live": cand["live"].at[best].set(False)}
        placed = place(nodes, node, ids[depth - 1, rank], parent, depth, w)
        nodes = jax.tree.map(lambda a, b: jnp.where(ok, a, b), placed, nodes)
        sibling_w = w - lp[depth - 1, rank] + lp[depth - 1, jnp.minimum(rank + 1, topk - 1)]
        cand, count = push(cand, count, ok & (rank + 1 < topk), sibling_w, parent, depth, rank + 1)
        child_w = w + lp[jnp.minimum(depth, depth_limit - 1), 0]
        cand, count = push(cand, count, ok & (depth < depth_limit), child_w, node, depth + 1, 0)
        return nodes, cand, count

    nodes, _, _ = jax.lax.fori_loop(chain + 1, n, pop, (nodes, cand, count))
    return Tree(**nodes)


def chain_tree(root: jax.Array, logits: jax.Array) -> Tree:
    """The draft's greedy block as a chain: root then the argmax of each of the L rows."""
    n = logits.shape[0] + 1
    tokens = jnp.concatenate([root[None].astype(jnp.int32), jnp.argmax(logits, axis=-1).astype(jnp.int32)])
    return Tree(tokens=tokens, parents=jnp.arange(n, dtype=jnp.int32) - 1, depths=jnp.arange(n, dtype=jnp.int32),
                valid=jnp.ones(n, bool), logw=jnp.zeros(n, jnp.float32))


def accept(tree: Tree, anc: jax.Array, posterior: jax.Array, max_depth: jax.Array,
           stop_ids: jax.Array) -> jax.Array:
    """The deepest node of the accepted path (greedy walk: a child is taken when its token is the target's choice
    at its parent), cut at max_depth and after a stop token."""
    parent = jnp.maximum(tree.parents, 0)
    parent_token = tree.tokens[parent]
    ok = (tree.valid & (tree.tokens == posterior[parent]) & (tree.depths <= max_depth)
          & ~jnp.isin(parent_token, stop_ids))
    ok = ok.at[0].set(True)
    accepted = ~jnp.any(anc & ~ok[None, :], axis=1)  # every node on the path from the root is ok
    return jnp.argmax(jnp.where(accepted, tree.depths, -1)).astype(jnp.int32)
