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


def masked_block_lower_inverse(a: jax.Array, block: int, matmul=None) -> jax.Array:
    """`block_lower_inverse` written with masks, reductions and products over the whole [..., N, N] tile (no
    slicing), so a Pallas kernel runs the same code: step i substitutes row i of every diagonal block at once (those
    rows of a, summed, do not overlap: each lives in its own block's columns), then neighbouring blocks are joined by
    T <- T - T C T, C the part of a below the diagonal between them. `block` >= N is `unit_lower_inverse`."""
    n = a.shape[-1]
    if block >= n:
        return unit_lower_inverse(a)
    if n % block or (n // block) & (n // block - 1):
        raise ValueError(f"{n} rows are not {block} x a power of two")
    matmul = matmul or functools.partial(_einsum, "...ij,...jk->...ik")
    a = _f32(a)
    rows = jax.lax.broadcasted_iota(jnp.int32, a.shape, a.ndim - 2)
    cols = jax.lax.broadcasted_iota(jnp.int32, a.shape, a.ndim - 1)
    col = jax.lax.broadcasted_iota(jnp.int32, a.shape[-1:], 0)
    same = rows // block == cols // block
    a_diag = jnp.where(same, a, 0.0)

    def row(i, t):
        at = rows % block == i
        a_i = jnp.sum(jnp.where(at, a_diag, 0.0), axis=-2)  # row i of every block, in that block's columns
        new = (col % block == i).astype(jnp.float32) - jnp.sum(a_i[..., :, None] * t, axis=-2)
        return jnp.where(at & same, new[..., None, :], t)

    t = jax.lax.fori_loop(0, block, row, jnp.zeros_like(a))
    size = block
    while size < n:
        below = (rows // (2 * size) == cols // (2 * size)) & (rows // size > cols // size)
        t = t - matmul(t, matmul(jnp.where(below, a, 0.0), t))
        size *= 2
    return t


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


SOLVE_BLOCK = 16  # rows of the diagonal blocks `block_lower_inverse` solves by substitution


def _diagonal_blocks(a: jax.Array, size: int) -> jax.Array:
    """The diagonal blocks of a [..., N, N] as [..., N / size, size, size]."""
    return jnp.stack([a[..., i:i + size, i:i + size] for i in range(0, a.shape[-1], size)], axis=-3)


def block_lower_inverse(a: jax.Array, block: int = SOLVE_BLOCK) -> jax.Array:
    """(I + a)^-1 for strictly lower-triangular a [..., N, N], N = block x 2^j: the diagonal blocks of `block` rows
    by forward substitution (`unit_lower_inverse`, all of them at once), then neighbours joined by products,
    [[P, 0], [C, Q]]^-1 = [[P^-1, 0], [-Q^-1 C P^-1, Q^-1]], log2(N / block) times: `block` dependent substitution
    steps instead of N (the UT transform of the FLA kernels). Every joined block is a product of exact inverses, so
    nothing cancels as a power series does (`unit_lower_inverse`)."""
    n = a.shape[-1]
    if n % block or (n // block) & (n // block - 1):
        raise ValueError(f"{n} rows are not {block} x a power of two")
    a = _f32(a)
    t = unit_lower_inverse(_diagonal_blocks(a, block))  # [..., N / block, block, block]
    size = block
    while size < n:
        t = t.reshape(*t.shape[:-3], -1, 2, size, size)
        p_inv, q_inv = t[..., 0, :, :], t[..., 1, :, :]
        c = _diagonal_blocks(a, 2 * size)[..., size:, :size]
        low = -_einsum("...ij,...jk->...ik", q_inv, _einsum("...ij,...jk->...ik", c, p_inv))
        t = jnp.concatenate([jnp.concatenate([p_inv, jnp.zeros_like(low)], axis=-1),
                             jnp.concatenate([low, q_inv], axis=-1)], axis=-2)
        size *= 2
    return t[..., 0, :, :]


def gdn_chunked_blockwise(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, s0: jax.Array,
                          chunk: int = 64, layer: int | None = None) -> tuple[jax.Array, jax.Array]:
    """`gdn_chunked` (same arguments and result) without a dependent step per token: the WY systems of every chunk
    are solved at once, blockwise (`block_lower_inverse`), and U, W and the scores are products over all chunks; only
    the state is carried from chunk to chunk, by products (V' = U - W S, O = exp(gamma) Q S + scores V',
    S' = exp(gamma_last) S + K^T diag(exp(gamma_last - gamma)) V'). A prefill of C chunks then waits on 16
    substitution steps and C state updates rather than 64 C substitution steps."""
    if layer is not None:
        s0 = s0[layer]
    n = q.shape[0]
    pad = (-n) % chunk

    def chunks(x):  # [T, H, ...] -> [C, H, chunk, ...]
        x = jnp.pad(_f32(x), [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return jnp.moveaxis(x.reshape(-1, chunk, *x.shape[1:]), 2, 1)

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    gamma = jnp.cumsum(g, axis=-1)  # [C, H, chunk]: log-decay from the chunk's start, each token included
    diff = gamma[..., :, None] - gamma[..., None, :]
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)  # [C, H, i, j]
    a = beta[..., :, None] * _einsum("chid,chjd->chij", k, k) * jnp.where(jnp.eye(chunk, dtype=bool), 0.0, decay)
    t = block_lower_inverse(a, min(SOLVE_BLOCK, chunk))
    eg = jnp.exp(gamma)
    u = _einsum("chij,chjv->chiv", t, beta[..., None] * v)
    w = _einsum("chij,chjd->chid", t, (beta * eg)[..., None] * k)
    scores = _einsum("chid,chjd->chij", q, k) * decay
    g_last = gamma[..., -1]  # [C, H]
    k_out = jnp.exp(g_last[..., None] - gamma)[..., None] * k  # each token's weight in the chunk's final state

    def step(state, xs):  # state [H, dk, dv]
        u_c, w_c, s_c, q_c, e_c, k_c, g_c = xs
        v_new = u_c - _einsum("hld,hdv->hlv", w_c, state)
        o = _einsum("hld,hdv->hlv", e_c[..., None] * q_c, state) + _einsum("hij,hjv->hiv", s_c, v_new)
        return jnp.exp(g_c)[:, None, None] * state + _einsum("hld,hlv->hdv", k_c, v_new), o

    state, o = jax.lax.scan(step, _f32(s0), (u, w, scores, q, eg, k_out, g_last))
    return jnp.moveaxis(o, 1, 2).reshape(-1, *o.shape[1:2], o.shape[-1])[:n], state


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


KV_BLOCK = 512  # cache slots `tree_attention_blockwise` scores at a time


def tree_attention_blockwise(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, length: jax.Array,
                             k_blk: jax.Array, v_blk: jax.Array, blk_mask: jax.Array, prefix_lo: jax.Array,
                             layer: int | None = None, block: int = KV_BLOCK) -> jax.Array:
    """`tree_attention` (same arguments and result) with the prefix read `block` slots at a time, up to the committed
    length, under an online softmax, then the block's own keys: scores of [Hq, N, block] at a time rather than
    [Hq, N, S + N] (a long prefill chunk over a long context)."""
    if layer is not None:
        k_cache, v_cache = k_cache[layer], v_cache[layer]
    n, hq, d = q.shape
    slots, hkv = k_cache.shape[:2]
    block = min(block, slots)
    qg = _f32(q).reshape(n, hkv, hq // hkv, d) / jnp.sqrt(jnp.float32(d))

    def update(carry, keys, values, visible):  # keys and values [B, Hkv, d], visible [N, B]
        m, l, acc = carry  # [Hkv, r, N], [Hkv, r, N], [Hkv, r, N, d]
        s = jnp.where(visible[None, None], _einsum("ngrd,sgd->grns", qg, _f32(keys)), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        top = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows that have seen no key yet stay at 0
        p = jnp.exp(s - top[..., None])
        alpha = jnp.exp(m - top)
        pv = _einsum("grns,sgd->grnd", p, _f32(values))
        return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

    def prefix_block(b, carry):
        want = b * block
        start = jnp.minimum(want, slots - block)  # the last block ends at the cache's end; slots before want masked
        slot = start + jnp.arange(block)
        visible = (slot[None, :] >= want) & (slot[None, :] < length) & (slot[None, :] >= prefix_lo[:, None])
        keys, values = (jax.lax.dynamic_slice_in_dim(x, start, block) for x in (k_cache, v_cache))
        return update(carry, keys, values, visible)

    shape = (hkv, hq // hkv, n)
    init = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros((*shape, d)))
    carry = jax.lax.fori_loop(0, (length + block - 1) // block, prefix_block, init)
    _, l, acc = update(carry, k_blk, v_blk, blk_mask)
    return jnp.moveaxis(acc / l[..., None], 2, 0).reshape(n, hq, d)


def tree_conv(conv_in: jax.Array, index: jax.Array, weight: jax.Array) -> jax.Array:
    """The causal depthwise conv along each token's path, then SiLU: conv_in [R, C] (committed conv inputs, then
    the block's), index [N, K] (the rows token n reads, oldest first), weight [C, K] -> [N, C] float32."""
    windows = _f32(conv_in)[index]  # [N, K, C]
    return jax.nn.silu(_einsum("nkc,ck->nc", windows, _f32(weight)))
