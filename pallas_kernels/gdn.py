"""The gated delta rule over blocks of tokens (DESIGN.md "Gated DeltaNet over a tree"), as Pallas GPU kernels.

`gdn_blocks` runs C blocks of n tokens one after another, each block in the WY form under the ancestor-or-self
mask `anc` [n, n]: a verified tree is one block with the tree's mask (state read, nothing per node written), a
prefill is T/16 blocks with the causal mask and the state carried from block to block in registers. One program
owns one head and `block_v` columns of the state: it reads its S0 columns once, builds A = beta K K^T * decay,
T = (I + A)^-1 (`reference.masked_block_lower_inverse`: `solve_block` dependent substitution steps solve every
diagonal block at once, then products join them), U, W, V' = U - W S0 and O, and writes O (and V' and gamma, which
the commit needs; the final state only when asked). `gdn_commit` applies every GDN layer's path commit in one
launch, updating the stacked state in place: S_a = exp(gamma_a) S0 + sum over the path of
exp(gamma_a - gamma_j) k_j v'_j^T.

The references are `reference.gdn_block`, `reference.gdn_chunked` and `reference.gdn_path_state`. Operands and the
state are float32, and so are the products (`exact`, the default): a verified tree, one token and a prefill chunk
reach a position's state by different products, so only float32 keeps them equal up to the order of the sums. With
exact=False the products run in TF32 on the GPU (4.7e-4 relative error against float32 on a 27B layer; the FMA
units measured 2-3x slower per kernel, scripts/results/gdn_probe_h100.txt), which makes a tree's outputs differ
from AR's. Interpret mode is always float32 (the CPU has no TF32). Pallas Triton backend; `interpret=True` runs it
on CPU for the tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import reference as ref
from pallas_kernels.tiles import dot_tile


def _dot(a: jax.Array, b: jax.Array, precision, ta: bool = False, tb: bool = False) -> jax.Array:
    dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _precision(interpret: bool, exact: bool):
    """The products' precision: float32, or TF32 on the GPU where not `exact` (module docstring)."""
    return jax.lax.Precision.HIGHEST if interpret or exact else jax.lax.Precision.DEFAULT


def _block_v(block_n: int, chunks: int, exact: bool, one: bool = False) -> int:
    """State columns a program: float32 products spill a whole 128-column state out of registers, so exact takes
    32 columns for a block of 16 rows and 64 for more (48 layers on an H200: 6.1 vs 13.7 ms at 23,
    scripts/results/gdn_exact_block_v_h200_nov27.txt), 64 for the AR step's one token, which skips the inverse
    (48 layers: 586 us of kernel time against 887 at 32 columns, the same bits,
    scripts/results/gdn_one_token_tiles_h200_nov28.txt), and 16 where the program loops over a prefill's blocks,
    the state carried in registers (a 64-token chunk's 48 layers: 7.4 ms against 23.1 at 32 columns,
    scripts/results/gdn_prefill_h200_nov28.txt); TF32 runs fastest with the whole state."""
    if not exact:
        return 128
    if chunks > 1:
        return 16
    return 32 if block_n <= 16 and not one else 64


def _solve_block(block_n: int) -> int:
    """Rows of the diagonal blocks the inverse substitutes: 8 for a tree of up to 32 rows (48 layers of a 23-node
    verify on an H200: 4.9 ms, against 7.1 at 16 and 7.2 by plain substitution) and a prefill's 16-token blocks
    (7.4 ms for a 64-token chunk, against 8.5 by plain substitution, scripts/results/gdn_prefill_h200_nov28.txt);
    plain substitution for 64 rows (55 ms, against 60 at 16 and 62 at 8: there the tiles' registers, not the steps,
    set the time; scripts/results/gdn_solve_block_h200_nov28.txt)."""
    return 8 if block_n <= 32 else block_n


# Tokens of a prefill the kernel solves at once, the state carried in registers from one block to the next: 64-row
# WY blocks spill their float32 64 x 64 tiles out of registers. A 64-token chunk's 48 layers on an H200: 7.4 ms in
# 16-token blocks (16 state columns a program), 26.1 ms in 32-token blocks, 51.2 ms in one 64-token block
# (scripts/results/gdn_prefill_h200_nov28.txt).
PREFILL_SUB_BLOCK = 16


def _pick(x: jax.Array, i, axis: int = 0) -> jax.Array:
    """x[i] along axis by a masked sum (Triton tensors cannot be indexed)."""
    at = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis) == i
    return jnp.sum(jnp.where(at, x, 0.0), axis=axis)


# Columns a token's packed operand holds past q, k and v: g, beta, then zeros, so that each row stays 64-byte aligned
PACK_TAIL = 16


def _packed(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, rows: int) -> jax.Array:
    """The kernel's one operand [rows, H, 2 dk + dv + PACK_TAIL] float32: q, k, v, g, beta side by side, zero rows
    past T. One XLA fusion makes it (with the ops that produce the five), where five pads of their own were five
    launches a layer."""
    t, h = g.shape
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    x = jnp.concatenate([f32(q), f32(k), f32(v), f32(g)[..., None], f32(beta)[..., None],
                         jnp.zeros((t, h, PACK_TAIL - 2), jnp.float32)], axis=-1)
    return jnp.pad(x, [(0, rows - t), (0, 0), (0, 0)])


def _blocks_kernel(n: int, chunks: int, block_v: int, solve: int, final: bool, one: bool, dk: int, dv: int,
                   precision, x_ref, anc_ref, layer_ref, s0_ref, *out_refs):
    o_ref, vn_ref, gm_ref = out_refs[:3]
    h, t = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(t * block_v, block_v)
    anc = anc_ref[...] != 0
    incl = anc.astype(jnp.float32)
    eye = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0) == jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    last_path = _pick(incl, n - 1)  # the last token's ancestors and itself: the path the carried state follows

    def block(c, state):  # state [dk, block_v]
        tok = pl.ds(c * n, n)
        q, k = x_ref[tok, h, pl.ds(0, dk)], x_ref[tok, h, pl.ds(dk, dk)]
        v = x_ref[tok, h, pl.ds(2 * dk + t * block_v, block_v)]
        g, beta = x_ref[tok, h, 2 * dk + dv], x_ref[tok, h, 2 * dk + dv + 1]
        gamma = jnp.sum(incl * g[None, :], axis=1)  # log-decay summed along each token's path
        diff = gamma[:, None] - gamma[None, :]
        decay = jnp.where(anc, jnp.exp(jnp.where(anc, diff, 0.0)), 0.0)
        dot = functools.partial(_dot, precision=precision)
        if one:  # one real token, the rest padding (k = beta = 0): A = 0, whose inverse the solve makes exactly I
            tinv = eye.astype(jnp.float32)
        else:
            a = beta[:, None] * dot(k, k, tb=True) * jnp.where(eye, 0.0, decay)
            tinv = ref.masked_block_lower_inverse(a, solve, dot)
        eg = jnp.exp(gamma)
        # the products by T stay for one token too: without them a compiler may fold the row scalings into the next
        # product (XLA does in interpret mode), which rounds otherwise
        u = dot(tinv, beta[:, None] * v)
        w = dot(tinv, (beta * eg)[:, None] * k)
        v_new = u - dot(w, state)
        o = dot(eg[:, None] * q, state) + dot(dot(q, k, tb=True) * decay, v_new)
        o_ref[tok, h, cols] = o
        vn_ref[tok, h, cols] = v_new

        @pl.when(t == 0)
        def _():
            gm_ref[tok, h] = gamma

        if chunks == 1 and not final:  # a verified tree: the state after it is not needed
            return state
        g_last = _pick(gamma, n - 1)
        wts = jnp.where(last_path > 0, jnp.exp(jnp.where(last_path > 0, g_last - gamma, 0.0)), 0.0)
        return jnp.exp(g_last) * state + dot(wts[:, None] * k, v_new, ta=True)

    state = s0_ref[layer_ref[0], h, :, cols]
    if chunks == 1:
        state = block(0, state)
    else:
        state = jax.lax.fori_loop(0, chunks, block, state)
    if final:
        out_refs[3][h, :, cols] = state


@functools.partial(jax.jit, static_argnames=("block_n", "final", "rows", "block_v", "solve_block", "one",
                                             "num_warps", "num_stages", "interpret", "exact"))
def gdn_blocks(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, s0: jax.Array,
               anc: jax.Array, *, block_n: int, final: bool, layer: int | jax.Array | None = None,
               rows: int | None = None, block_v: int | None = None, solve_block: int | None = None,
               one: bool = False, num_warps: int = 8, num_stages: int = 1, interpret: bool = False,
               exact: bool = True):
    """T = C * block_n tokens in C blocks under the mask anc [block_n, block_n] (shapes as reference.gdn_block);
    with `rows`, the inputs' tokens padded with zero tokens to that many (T = rows), in the packing of the operand.

    Returns (o [T, H, dv], v_new [T, H, dv], gamma [T, H]) and, with `final`, the state after the last token of
    the last block along its path [H, dk, dv]. block_n must be a power of two >= 16 (pad with tokens whose
    k, g, beta are 0 and which are nobody's ancestor); `one`: a single block whose first token is its only real one
    (the AR step), which needs no inverse. With `layer` (an operand: one compiled kernel serves every
    layer), s0 is the stacked state [layers, H, dk, dv] and the kernel reads that layer (a slice passed in would be
    copied out first). Default tiles: the fastest of scripts/gdn_probe.py on an H100, block_v by `_block_v`.
    """
    if layer is None:
        s0, layer = s0[None], 0
    if s0.ndim != 4:
        raise ValueError(f"a state {s0.shape} with a layer: give the stacked state [layers, H, dk, dv]")
    t_len, h, dk = q.shape
    dv = v.shape[-1]
    t_len = t_len if rows is None else rows
    if t_len < q.shape[0]:
        raise ValueError(f"rows={rows} is fewer than the {q.shape[0]} tokens given")
    if t_len % block_n or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{t_len} tokens do not split into blocks of a power of two >= 16 (block_n={block_n})")
    block_v = min(block_v or _block_v(block_n, t_len // block_n, exact and not interpret, one), dv)
    solve = solve_block or _solve_block(block_n)
    if dv % block_v or dk % 16:
        raise ValueError(f"value dim {dv} must be a multiple of block_v={block_v}, key dim {dk} of 16")
    if one and t_len != block_n:
        raise ValueError(f"one=True is a single block of one real token, got {t_len // block_n} blocks")
    out_shape = [jax.ShapeDtypeStruct((t_len, h, dv), jnp.float32), jax.ShapeDtypeStruct((t_len, h, dv), jnp.float32),
                 jax.ShapeDtypeStruct((t_len, h), jnp.float32)]
    if final:
        out_shape.append(jax.ShapeDtypeStruct((h, dk, dv), jnp.float32))
    return pl.pallas_call(
        functools.partial(_blocks_kernel, block_n, t_len // block_n, block_v, solve, final, one, dk, dv,
                          _precision(interpret, exact)),
        out_shape=tuple(out_shape),
        grid=(h, dv // block_v),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="gdn_blocks",
    )(_packed(q, k, v, g, beta, t_len), anc.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32),
      s0.astype(jnp.float32))


def gdn_tree(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, s0: jax.Array,
             anc: jax.Array, *, layer: int | jax.Array | None = None, interpret: bool = False, exact: bool = True,
             **tiles) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Verify: the kernel counterpart of reference.gdn_block for N <= 64 tokens (padded to a power of two); with
    `layer`, s0 is the stacked state [layers, H, dk, dv]; `tiles`: gdn_blocks' tuning arguments (benchmarks). One
    token (the AR step) skips the inverse (gdn_blocks' `one`), with the outputs of the full block."""
    n = q.shape[0]
    tiles = {"one": n == 1, **tiles}
    n_pad = dot_tile(n)
    anc_pad = jnp.eye(n_pad, dtype=bool).at[:n, :n].set(anc)  # padding tokens: their own roots
    o, v_new, gamma = gdn_blocks(q, k, v, g, beta, s0, anc_pad, block_n=n_pad, final=False, layer=layer, rows=n_pad,
                                 interpret=interpret, exact=exact, **tiles)
    return o[:n], v_new[:n], gamma[:n]


def gdn_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, s0: jax.Array,
                chunk: int = PREFILL_SUB_BLOCK, *, layer: int | jax.Array | None = None, interpret: bool = False,
                exact: bool = True, **tiles) -> tuple[jax.Array, jax.Array]:
    """Prefill: the kernel counterpart of reference.gdn_chunked; returns (o [T, H, dv], final state). With
    `layer`, s0 is the stacked state [layers, H, dk, dv]; `tiles`: gdn_blocks' tuning arguments (benchmarks)."""
    n = q.shape[0]
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    o, _, _, state = gdn_blocks(q, k, v, g, beta, s0, causal, block_n=chunk, final=True, layer=layer,
                                rows=n + (-n) % chunk, interpret=interpret, exact=exact, **tiles)
    return o[:n], state


def _commit_kernel(block_v: int, precision, leaf_ref, path_ref, k_ref, vn_ref, gm_ref, s0_ref, s_ref):
    layer, h, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(t * block_v, block_v)
    on_path = path_ref[...] != 0  # [n]
    gamma = gm_ref[layer, :, h]
    g_leaf = _pick(gamma, leaf_ref[0])
    wts = jnp.where(on_path, jnp.exp(jnp.where(on_path, g_leaf - gamma, 0.0)), 0.0)
    k = k_ref[layer, :, h, :]
    s_ref[layer, h, :, cols] = (jnp.exp(g_leaf) * s0_ref[layer, h, :, cols]
                                + _dot(wts[:, None] * k, vn_ref[layer, :, h, cols], precision, ta=True))


def _commit_tiles(n: int) -> tuple[int, int]:
    """(state columns, warps) of a commit program: the 27B's 48 layers on an H200 took 137 us for one token on 32
    columns and 4 warps (211 on 32 and 8) and 268 us for a 23-node tree on 16 and 8 (348 on 32 and 8), with the same
    bits (scripts/results/gdn_commit_tiles_h200_nov28.txt)."""
    return (32, 4) if n == 1 else (16, 8)


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "interpret", "exact"))
def gdn_commit(ssm: jax.Array, k: jax.Array, v_new: jax.Array, gamma: jax.Array, path: jax.Array,
               leaf: jax.Array, *, block_v: int | None = None, num_warps: int | None = None, interpret: bool = False,
               exact: bool = True) -> jax.Array:
    """Every layer's state after the accepted path: ssm [L, H, dk, dv] (updated in place where its buffer is not
    needed afterwards, e.g. inside the jitted step), k [L, N, H, dk],
    v_new [L, N, H, dv], gamma [L, N, H] from verify, path [N] bool, leaf [] -> [L, H, dk, dv]; tiles by
    `_commit_tiles` unless given."""
    layers, h, dk, dv = ssm.shape
    n = k.shape[1]
    tiles = _commit_tiles(n)
    block_v, num_warps = min(block_v or tiles[0], dv), num_warps or tiles[1]
    n_pad = dot_tile(n)
    pad = lambda x: jnp.pad(x.astype(jnp.float32), [(0, 0), (0, n_pad - n)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    path = jnp.pad(path, (0, n_pad - n)).astype(jnp.int32)
    return pl.pallas_call(
        functools.partial(_commit_kernel, block_v, _precision(interpret, exact)),
        out_shape=jax.ShapeDtypeStruct(ssm.shape, jnp.float32),
        grid=(layers, h, dv // block_v),
        input_output_aliases={5: 0},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_commit",
    )(jnp.reshape(leaf, (1,)).astype(jnp.int32), path, pad(k), pad(v_new), pad(gamma), ssm)
