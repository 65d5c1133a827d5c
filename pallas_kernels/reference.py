"""Plain-jnp references of the kernels: float32, einsum, no tiling (DESIGN.md "Kernels", specs/qwen35_gguf.md §2).

The gated delta rule is written once for a block of tokens under an ancestor-or-self mask `anc` (DESIGN.md "Gated
DeltaNet over a tree"): a causal chunk is the block whose mask is lower-triangular, a verified tree the block whose
mask follows parent pointers. Symbols follow DESIGN: gamma, A, T, U, W, S0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# every product in exact float32: on a GPU XLA's default is TF32, and only for some shapes
_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def _f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32)


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """(I + a)^-1 for strictly lower-triangular a [..., N, N], by forward substitution: row i of T = (I + a)^-1 is
    e_i - a[i] T, using rows above it only. Written with masks and reductions (no indexing), so the Pallas kernel
    runs the same code on its tile.

    A power series, prod_i (I + (-a)^(2^i)), would need only matmuls, but its intermediate powers grow like binomial
    coefficients when keys align (a run of one repeated token makes a nearly all-beta lower triangle) and cancel
    catastrophically: with N = 64 it returned entries of 4e9 for an inverse bounded by 1. Substitution stays exact.
    """
    n = a.shape[-1]
    a = _f32(a)
    rows = jax.lax.broadcasted_iota(jnp.int32, a.shape, a.ndim - 2)
    cols = jax.lax.broadcasted_iota(jnp.int32, a.shape[-1:], 0)

    def row(i, t):
        a_i = jnp.sum(jnp.where(rows == i, a, 0.0), axis=-2)  # [..., N]: row i of a
        new = (cols == i).astype(jnp.float32) - jnp.sum(a_i[..., :, None] * t, axis=-2)  # e_i - a_i T
        return jnp.where(rows == i, new[..., None, :], t)

    return jax.lax.fori_loop(0, n, row, jnp.zeros_like(a))


def gdn_block(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, s0: jax.Array,
              anc: jax.Array, layer: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gated delta rule over N tokens whose state-sharing is given by an ancestor-or-self mask.

    Args:
      q, k: [N, H, dk] (q already scaled, both L2-normalised); v: [N, H, dv]; g (log-decay <= 0), beta: [N, H];
      s0: [H, dk, dv] state before the block (or stacked [layers, H, dk, dv], of which `layer` is read);
      anc: [N, N] bool, anc[i, j] = j is i or an ancestor of i, with parents before children (lower-triangular).
    Returns:
      o [N, H, dv] (each token's output along its own path), v_new [N, H, dv] (V'), gamma [N, H] (path log-decay).
    """
    if layer is not None:
        s0 = s0[layer]
    q, k, v, g, beta, s0 = map(_f32, (q, k, v, g, beta, s0))
    incl = anc.astype(jnp.float32)
    eye = jnp.eye(anc.shape[0], dtype=jnp.float32)
    strict = incl * (1.0 - eye)
    gamma = _einsum("ij,jh->ih", incl, g)  # sum of g over each token's path, itself included
    diff = gamma[:, None, :] - gamma[None, :, :]  # [i, j, H]: gamma_i - gamma_j
    decay_incl = jnp.where(anc[:, :, None], jnp.exp(jnp.where(anc[:, :, None], diff, 0.0)), 0.0)
    decay_strict = decay_incl * strict[:, :, None]
    A = beta[:, None, :] * _einsum("ihd,jhd->ijh", k, k) * decay_strict  # [i, j, H]
    rhs_u = jnp.moveaxis(beta[:, :, None] * v, 1, 0)  # [H, N, dv]
    rhs_w = jnp.moveaxis((beta * jnp.exp(gamma))[:, :, None] * k, 1, 0)  # [H, N, dk]
    t = unit_lower_inverse(jnp.moveaxis(A, 2, 0))  # T = (I + A)^-1, [H, N, N]
    U, W = (_einsum("hij,hjk->hik", t, r) for r in (rhs_u, rhs_w))  # T (beta V), T (beta exp(gamma) K)
    v_new = U - _einsum("hnk,hkv->hnv", W, s0)  # V' = U - W S0
    qs = _einsum("nhk,hkv->hnv", jnp.exp(gamma)[:, :, None] * q, s0)
    scores = _einsum("ihd,jhd->hij", q, k) * jnp.moveaxis(decay_incl, 2, 0)
    o = qs + _einsum("hij,hjv->hiv", scores, v_new)
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(v_new, 0, 1), gamma


def gdn_path_state(k: jax.Array, v_new: jax.Array, gamma: jax.Array, s0: jax.Array, path: jax.Array,
                   leaf: jax.Array) -> jax.Array:
    """State after the tokens on one root-to-leaf path: exp(gamma_a) S0 + sum_j exp(gamma_a - gamma_j) k_j v'_j^T.

    Args: k [N, H, dk], v_new and gamma from `gdn_block`, s0 [H, dk, dv], path [N] bool (the leaf's ancestors and
    itself), leaf: index of the last token on the path. Returns [H, dk, dv].
    """
    gamma_a = gamma[leaf]  # [H]
    w = jnp.where(path[:, None], jnp.exp(jnp.where(path[:, None], gamma_a[None, :] - gamma, 0.0)), 0.0)
    return jnp.exp(gamma_a)[:, None, None] * _f32(s0) + _einsum("nh,nhk,nhv->hkv", w, _f32(k), v_new)


def gdn_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, s0: jax.Array,
                chunk: int = 64, layer: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Causal gated delta rule in chunks (prefill). Shapes as `gdn_block` with T tokens (`layer` too); returns
    (o, final state).

    T is padded to a multiple of the chunk with tokens that leave the state alone (g = 0, beta = 0, k = 0).
    """
    if layer is not None:
        s0 = s0[layer]
    n = q.shape[0]
    pad = (-n) % chunk
    padded = [jnp.pad(_f32(x), [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in (q, k, v, g, beta)]
    chunks = [x.reshape(-1, chunk, *x.shape[1:]) for x in padded]
    causal = jnp.tril(jnp.ones((chunk, chunk), dtype=bool))
    whole = jnp.ones((chunk,), bool)

    def step(state, xs):
        qc, kc, vc, gc, bc = xs
        o, v_new, gamma = gdn_block(qc, kc, vc, gc, bc, state, causal)
        return gdn_path_state(kc, v_new, gamma, state, whole, chunk - 1), o

    state, o = jax.lax.scan(step, _f32(s0), tuple(chunks))
    return o.reshape(-1, *o.shape[2:])[:n], state


def gdn_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                  s0: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The token-by-token delta rule (the oracle): S <- exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q."""

    def step(state, xs):
        qt, kt, vt, gt, bt = xs  # [H, dk], [H, dk], [H, dv], [H], [H]
        state = jnp.exp(gt)[:, None, None] * state
        delta = bt[:, None] * (vt - _einsum("hkv,hk->hv", state, kt))
        state = state + _einsum("hk,hv->hkv", kt, delta)
        return state, _einsum("hkv,hk->hv", state, qt)

    state, o = jax.lax.scan(step, _f32(s0), tuple(map(_f32, (q, k, v, g, beta))))
    return o, state


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention with grouped KV heads: q [N, Hq, d], k and v [S, Hkv, d], mask [N, S] bool -> [N, Hq, d].

    Query head h reads KV head h // (Hq // Hkv). Scale 1/sqrt(d). Every row must see at least one key.
    """
    n, hq, d = q.shape
    hkv = k.shape[1]
    qg = _f32(q).reshape(n, hkv, hq // hkv, d)
    scores = _einsum("ngrd,sgd->grns", qg, _f32(k)) / jnp.sqrt(jnp.float32(d))
    scores = jnp.where(mask[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return _einsum("grns,sgd->ngrd", probs, _f32(v)).reshape(n, hq, d)


def tree_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, length: jax.Array, k_blk: jax.Array,
                   v_blk: jax.Array, blk_mask: jax.Array, prefix_lo: jax.Array, layer: int | None = None) -> jax.Array:
    """Attention of a block of N tokens over a committed prefix plus the block's own keys (tree_attention.py).

    q [N, Hq, d]; k/v_cache [S, Hkv, d] (or stacked [layers, S, Hkv, d], of which `layer` is read), of which query i
    sees slots prefix_lo[i] <= s < length; k/v_blk [N, Hkv, d], of which query i sees key j where blk_mask[i, j].
    Returns float32 [N, Hq, d].
    """
    if layer is not None:
        k_cache, v_cache = k_cache[layer], v_cache[layer]
    slot = jnp.arange(k_cache.shape[0])
    prefix = (slot[None, :] < length) & (slot[None, :] >= prefix_lo[:, None])
    keys = jnp.concatenate([_f32(k_cache), _f32(k_blk)])
    values = jnp.concatenate([_f32(v_cache), _f32(v_blk)])
    return attention(q, keys, values, jnp.concatenate([prefix, blk_mask], axis=1))


def tree_conv(conv_in: jax.Array, index: jax.Array, weight: jax.Array) -> jax.Array:
    """The causal depthwise conv along each token's path, then SiLU: conv_in [R, C] (committed conv inputs, then
    the block's), index [N, K] (the rows token n reads, oldest first), weight [C, K] -> [N, C] float32."""
    windows = _f32(conv_in)[index]  # [N, K, C]
    return jax.nn.silu(_einsum("nkc,ck->nc", windows, _f32(weight)))
