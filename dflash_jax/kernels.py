"""The kernel switch: every model function takes a KernelConfig (dflash_jax/config.py) and calls its kernels here.

`impl="reference"` runs the plain-jnp paths, `impl="pallas"` the Pallas GPU kernels (in interpret mode on a CPU, for
tests). Matrices: with pallas every Q4_K/Q5_K/Q6_K/Q8_0 matrix of `small_rows` rows or more is repacked once at
load into the kernels' layout (pallas_kernels/qmatmul.py, with the Mosaic GPU layout where `mgpu` asks for it) and
`linear` dispatches on that type; smaller ones are dequantized to float32 for XLA's product; dense weights (the
drafter's) stay with XLA's product. Attention (pallas_kernels/tree_attention.py), the tree conv
(pallas_kernels/tree_conv.py) and the gated delta rule (pallas_kernels/gdn.py) follow `impl`. The configuration is a
static argument of every jitted caller, so each configuration compiles its own functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import kv_quant as kvq
from dflash_jax.config import PREFILL_BLOCK, KernelConfig
from dflash_jax.quant import QTensor, dequantize
from dflash_jax.quant import linear as reference_linear
from pallas_kernels import gdn
from pallas_kernels import qmatmul as qm
from pallas_kernels import reference as ref
from pallas_kernels import tree_attention_mgpu
from pallas_kernels.tree_attention import tree_attention as tree_attention_kernel
from pallas_kernels.tree_conv import tree_conv as tree_conv_kernel

REFERENCE = KernelConfig()  # the plain-jnp paths: the default of the model functions, and the CPU's
DENSE_LIMIT = 1 << 30  # bytes of float32 matrices the reference path keeps dequantized (see prepare_matrices)


def prepare_matrices(params: Any, kcfg: KernelConfig, skip: tuple[str, ...] = (),
                     dense_limit: int = DENSE_LIMIT) -> Any:
    """The parameter pytree with its stored matrices (QTensors) in the layout `kcfg` computes with.

    For pallas, each QTensor in a format the kernels stream becomes a PackedWeight (`prepare_matrix`). For reference,
    when all of them fit in `dense_limit` bytes as float32, each is dequantized once here: the reference product
    dequantizes at every call otherwise, which is most of a small model's step on a CPU (the products are the same).
    Top-level entries named in `skip` (e.g. the embedding table, read by row) are left alone.
    """
    is_leaf = lambda x: isinstance(x, QTensor)  # noqa: E731
    kept = {name: value for name, value in params.items() if name not in skip}
    if kcfg.impl == "reference":
        stored = [x for x in jax.tree.leaves(kept, is_leaf=is_leaf) if isinstance(x, QTensor)]
        if not stored or sum(4 * int(np.prod(x.shape)) for x in stored) > dense_limit:
            return params
        convert = lambda x: dequantize(x) if isinstance(x, QTensor) else x  # noqa: E731
    else:
        convert = lambda x: prepare_matrix(x, kcfg)  # noqa: E731
    return {name: (jax.tree.map(convert, value, is_leaf=is_leaf) if name in kept else value)
            for name, value in params.items()}


def prepare_matrix(x: Any, kcfg: KernelConfig) -> Any:
    """One tensor in the layout `kcfg` computes with: for pallas, a quantized QTensor becomes a PackedWeight (in the
    Mosaic GPU layout too, or only, as `kcfg.mgpu` says), or float32 below `kcfg.small_rows` rows (the 27B's 48-row
    ssm_alpha and ssm_beta: a latency rather than a bandwidth problem, which XLA's product serves better)."""
    if kcfg.impl != "pallas" or not isinstance(x, QTensor) or x.fmt not in qm.QUANTIZED_FORMATS:
        return x
    if x.shape[0] < kcfg.small_rows:
        return dequantize(x)
    return qm.pack(x.fmt, x.shape, x.data, mgpu=kcfg.mgpu)


def linear(x: jax.Array, w: Any, kcfg: KernelConfig) -> jax.Array:
    """x [..., in] @ w.T -> float32, for a dense array, a QTensor (reference) or a PackedWeight (the Pallas kernels,
    laid out for `kcfg` at load).

    With exact numerics every route rounds its operands the same way at any number of rows (docs/architecture.md,
    "Numerics"): the kernels as their module says; with pallas a bf16 matrix (the drafter's) multiplies x rounded to
    bf16, float32 accumulation; other dense products are exact float32 (XLA's default on a GPU is TF32 for many
    rows, which a one-row product does not use). "fast" leaves dense products at XLA's default precision."""
    if not isinstance(w, qm.PackedWeight):
        if not kcfg.exact:
            return reference_linear(x, w, precision=None)
        if kcfg.impl == "pallas" and getattr(w, "dtype", None) == jnp.bfloat16:
            return jnp.einsum("...i,oi->...o", x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
        return reference_linear(x, w)
    product = lambda rows: [qm.qmatmul(rows, w, interpret=kcfg.interpret, exact=kcfg.exact)]  # noqa: E731
    return _row_blocks(x, product, (w.shape[0],))[0]


def _row_blocks(x: jax.Array, product, widths: tuple[int, ...]) -> list[jax.Array]:
    """x [..., K] through `product` (rows [<= qmatmul.M_MAX, K] -> a list of [rows, N_j]) a block of M_MAX rows at a
    time: the outputs [..., N_j], N_j in `widths`."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    parts = [product(rows[i:i + qm.M_MAX]) for i in range(0, rows.shape[0], qm.M_MAX)]
    return [(parts[0][j] if len(parts) == 1 else jnp.concatenate([p[j] for p in parts], axis=0)).reshape(*lead, n)
            for j, n in enumerate(widths)]


def linears(x: jax.Array, ws: Sequence[Any], kcfg: KernelConfig) -> list[jax.Array]:
    """[linear(x, w, kcfg) for w in ws], bit for bit, with the weights that share a `qmatmul.launch_key` (the Mosaic
    GPU layout, one format and K: an MLP's gate and up, an attention's q and k) multiplied in one launch each."""
    groups: dict[tuple, list[int]] = {}
    for i, w in enumerate(ws):
        key = qm.launch_key(w) if isinstance(w, qm.PackedWeight) else None
        groups.setdefault(key if key is not None else ("alone", i), []).append(i)
    out: list[Any] = [None] * len(ws)
    for idx in groups.values():
        if len(idx) == 1:
            out[idx[0]] = linear(x, ws[idx[0]], kcfg)
            continue
        pws = tuple(ws[i] for i in idx)
        product = lambda rows: qm.qmatmul_many(rows, pws, interpret=kcfg.interpret, exact=kcfg.exact)  # noqa: E731
        for i, y in zip(idx, _row_blocks(x, product, tuple(pw.shape[0] for pw in pws))):
            out[i] = y
    return out


def tree_attention(q: jax.Array, k_cache: jax.Array | kvq.KVBlocks, v_cache: jax.Array | kvq.KVBlocks,
                   length: jax.Array, k_blk: jax.Array | kvq.KVBlocks, v_blk: jax.Array | kvq.KVBlocks,
                   blk_mask: jax.Array, prefix_lo: jax.Array, kcfg: KernelConfig, layer: int | None = None
                   ) -> jax.Array:
    """A block's attention over the committed prefix and its own keys (reference.tree_attention for the args);
    with `layer`, the caches are stacked and the kernel reads that layer in place. Keys and values may each be in a
    block type (kv_quant.KVBlocks), the block's rows in their cache's type: the reference dequantizes them (the cache
    one layer at a time), the kernel decodes each tile as it loads it, the block's rows as the cache's."""
    if kcfg.impl == "reference":
        if isinstance(k_cache, kvq.KVBlocks) or isinstance(v_cache, kvq.KVBlocks):
            k_cache, v_cache, layer = kvq.readable(k_cache, layer), kvq.readable(v_cache, layer), None
        k_blk, v_blk = kvq.readable(k_blk), kvq.readable(v_blk)
        # a prefill chunk past one block scores the cache blockwise ([heads, N, slots] at once would be 3 GiB for
        # 1024 tokens at 32K); a verified tree and a 64-token chunk keep the one-pass softmax the parity tests hold
        attend = ref.tree_attention_blockwise if q.shape[0] > PREFILL_BLOCK else ref.tree_attention
        return attend(q, k_cache, v_cache, length, k_blk, v_blk, blk_mask, prefix_lo, layer)
    if kcfg.mgpu_attention and tree_attention_mgpu.supports(q, k_cache, v_cache, k_blk, v_blk):
        return tree_attention_mgpu.tree_attention(q, k_cache, v_cache, length, k_blk, v_blk, blk_mask, prefix_lo,
                                                  layer=layer, exact=kcfg.exact, interpret=kcfg.interpret)
    return tree_attention_kernel(q, k_cache, v_cache, length, k_blk, v_blk, blk_mask, prefix_lo, layer=layer,
                                 interpret=kcfg.interpret, exact=kcfg.exact)


def chunk_attention(q: jax.Array, k_all: jax.Array | kvq.KVBlocks, v_all: jax.Array | kvq.KVBlocks,
                    length: jax.Array, k_chunk: jax.Array | kvq.KVBlocks, v_chunk: jax.Array | kvq.KVBlocks,
                    kcfg: KernelConfig, layer: int | None = None) -> jax.Array:
    """A prefill chunk's causal attention over the committed prefix and itself (`tree_attention` with a causal mask
    and every query seeing the whole prefix); its rows must already be written in the caches at slots length..
    (models/target.py writes before it reads).

    The kernel takes a chunk of more than PREFILL_BLOCK tokens as consecutive chunks of PREFILL_BLOCK, each the call a
    chunk of that size makes (the earlier blocks' rows read from the cache), so that a position's output does not
    depend on the chunk size: the kernels round their operands to bf16, which turns any other summation order into
    a relative 1e-4 of the logits (docs/architecture.md, "Numerics")."""
    n = q.shape[0]
    if kcfg.impl == "reference" or n <= PREFILL_BLOCK:
        return tree_attention(q, k_all, v_all, length, k_chunk, v_chunk, jnp.tril(jnp.ones((n, n), bool)),
                              jnp.zeros(n, jnp.int32), kcfg, layer)
    causal, lo = jnp.tril(jnp.ones((PREFILL_BLOCK, PREFILL_BLOCK), bool)), jnp.zeros(PREFILL_BLOCK, jnp.int32)

    def block(_, xs):
        start, q_b, k_b, v_b = xs
        return None, tree_attention(q_b, k_all, v_all, length + start, k_b, v_b, causal, lo, kcfg, layer)

    starts = jnp.arange(0, n, PREFILL_BLOCK, dtype=jnp.int32)
    _, o = jax.lax.scan(block, None, (starts, *jax.tree.map(_blocks, (q, k_chunk, v_chunk))))
    return o.reshape(q.shape)


def _blocks(x: jax.Array) -> jax.Array:
    """Rows [T, ...] as [T / PREFILL_BLOCK, PREFILL_BLOCK, ...] (T a multiple of the block: a prefill chunk's)."""
    if x.shape[0] % PREFILL_BLOCK:
        raise ValueError(f"{x.shape[0]} rows are not a multiple of the prefill block ({PREFILL_BLOCK})")
    return x.reshape(-1, PREFILL_BLOCK, *x.shape[1:])


def tree_conv(conv_in: jax.Array, index: jax.Array, weight: jax.Array, kcfg: KernelConfig) -> jax.Array:
    """silu of the causal depthwise conv along each token's path (reference.tree_conv for the args)."""
    if kcfg.impl == "reference":
        return ref.tree_conv(conv_in, index, weight)
    return tree_conv_kernel(conv_in, index, weight, interpret=kcfg.interpret)


def gdn_tree(q, k, v, g, beta, s0, anc, kcfg: KernelConfig, layer: int | None = None
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The gated delta rule over a verified block: (o, v_new, gamma), as reference.gdn_block; with `layer`, s0 is
    the stacked state and the kernel reads that layer in place."""
    if kcfg.impl == "reference":
        return ref.gdn_block(q, k, v, g, beta, s0, anc, layer)
    return gdn.gdn_tree(q, k, v, g, beta, s0, anc, layer=layer, interpret=kcfg.interpret, exact=kcfg.exact)


def gdn_chunked(q, k, v, g, beta, s0, kcfg: KernelConfig, layer: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The causal gated delta rule of a prefill in blocks of PREFILL_BLOCK: (o, state after the chunk), as
    reference.gdn_chunked; with `layer`, s0 is the stacked state, the kernel reads that layer in place and the state
    returned is the stack with that layer updated. The reference runs a longer prefill chunk blockwise
    (reference.gdn_chunked_blockwise: no dependent substitution step per token); one block keeps the substitution,
    whose logits the parity tests hold. The kernel runs a longer chunk as consecutive blocks, each the call a chunk
    of one block makes, for the reason `chunk_attention` gives."""
    if kcfg.impl == "reference":
        solve = ref.gdn_chunked_blockwise if q.shape[0] > PREFILL_BLOCK else ref.gdn_chunked
        o, s = solve(q, k, v, g, beta, s0, PREFILL_BLOCK, layer=layer)
        return o, (s if layer is None else s0.at[layer].set(s))

    def block(state, xs):
        o, s = gdn.gdn_chunked(*xs, state, layer=layer, interpret=kcfg.interpret, exact=kcfg.exact)
        return (s if layer is None else state.at[layer].set(s)), o

    if q.shape[0] <= PREFILL_BLOCK:
        state, o = block(s0, (q, k, v, g, beta))
        return o, state
    state, o = jax.lax.scan(block, s0, tuple(map(_blocks, (q, k, v, g, beta))))
    return o.reshape(-1, *o.shape[2:]), state


def gdn_commit(ssm: jax.Array, k: list[jax.Array], v_new: list[jax.Array], gamma: list[jax.Array],
               path: jax.Array, leaf: jax.Array, kcfg: KernelConfig) -> jax.Array:
    """Every GDN layer's state after the accepted path: ssm [L, H, dk, dv] and per-layer verify outputs."""
    if kcfg.impl == "reference":
        k, v_new, gamma = jnp.stack(k), jnp.stack(v_new), jnp.stack(gamma)

        # a loop over the layers updates the state in place: a stack of new layers is a second state, and unrolled
        # reads of ssm[i] beside writes of it made XLA copy the whole state
        def layer(i: jax.Array, ssm: jax.Array) -> jax.Array:
            return ssm.at[i].set(ref.gdn_path_state(k[i], v_new[i], gamma[i], ssm[i], path, leaf))

        return jax.lax.fori_loop(0, ssm.shape[0], layer, ssm)
    return gdn.gdn_commit(ssm, jnp.stack(k), jnp.stack(v_new), jnp.stack(gamma), path, leaf,
                          interpret=kcfg.interpret, exact=kcfg.exact)
