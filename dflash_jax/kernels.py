"""The kernel switch: `impl="reference"` runs the plain-jnp paths, `impl="pallas"` the Pallas GPU kernels.

Matrices: with `impl="pallas"` every Q4_K/Q5_K/Q6_K/Q8_0 matrix of `SMALL_ROWS` rows or more is repacked once at
load into the qmatmul layout (pallas_kernels/qmatmul.py) and `linear` dispatches on that type; smaller ones are
dequantized to float32 for XLA's product; dense weights stay with XLA's product, which
measured faster than the kernel's dense path (README, Kernels). Attention (pallas_kernels/tree_attention.py), the
tree conv (pallas_kernels/tree_conv.py) and the gated delta rule (pallas_kernels/gdn.py) take `impl` as a static
argument, which the models thread through from the loaded target. On a CPU the Pallas kernels run in interpret
mode (slow; for tests).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.quant import QTensor, dequantize
from dflash_jax.quant import linear as reference_linear
from pallas_kernels import gdn
from pallas_kernels import qmatmul as qm
from pallas_kernels import reference as ref
from pallas_kernels.tree_attention import tree_attention as _tree_attention_kernel
from pallas_kernels.tree_conv import tree_conv as _tree_conv_kernel

IMPLS = ("reference", "pallas")


def default_impl() -> str:
    """`pallas` when JAX runs on a GPU, `reference` otherwise."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def resolve_impl(impl: str) -> str:
    """`auto` -> default_impl(); anything else must be one of IMPLS."""
    if impl == "auto":
        return default_impl()
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of auto, {', '.join(IMPLS)}; got {impl!r}")
    return impl


DENSE_LIMIT = 1 << 30  # bytes of float32 matrices the reference path keeps dequantized (see prepare_matrices)
# Quantized matrices with fewer rows than this stay out of the Pallas kernels, dequantized to float32 at load (the
# 27B's 48-row ssm_alpha and ssm_beta, 0.9 MB each so): less than one of the kernels' 64-row tiles, a product took
# 14.5 us on an H100 in the DDTree-22 step's profile (1.39 ms of its 18.3 for 96 of them, plus x padded for each;
# scripts/results/gpu_step_profile_mgpu_h100.txt), latency rather than bytes; XLA's dot takes a few
SMALL_ROWS = 64


def prepare_matrices(params: Any, impl: str, skip: tuple[str, ...] = (), dense_limit: int = DENSE_LIMIT) -> Any:
    """The parameter pytree with its stored matrices (QTensors) in the layout `impl` computes with.

    For `pallas`, each QTensor in a format the kernel streams becomes a PackedWeight (the QTensor is dropped). For
    `reference`, when all of them fit in `dense_limit` bytes as float32, each is dequantized once here: the reference
    product dequantizes at every call otherwise, which is most of a small model's step on a CPU (the products are
    the same). Top-level entries named in `skip` (e.g. the embedding table, read by row) are left alone.
    """
    is_leaf = lambda x: isinstance(x, QTensor)  # noqa: E731
    kept = {name: value for name, value in params.items() if name not in skip}
    if resolve_impl(impl) == "reference":
        stored = [x for x in jax.tree.leaves(kept, is_leaf=is_leaf) if isinstance(x, QTensor)]
        if not stored or sum(4 * int(np.prod(x.shape)) for x in stored) > dense_limit:
            return params
        convert = lambda x: dequantize(x) if isinstance(x, QTensor) else x  # noqa: E731
    else:
        convert = lambda x: prepare_matrix(x, impl)  # noqa: E731
    return {name: (jax.tree.map(convert, value, is_leaf=is_leaf) if name in kept else value)
            for name, value in params.items()}


def prepare_matrix(x: Any, impl: str) -> Any:
    """One tensor in the layout `impl` computes with (for `pallas`, a quantized QTensor -> PackedWeight, or float32
    below `SMALL_ROWS` rows)."""
    if resolve_impl(impl) == "pallas" and isinstance(x, QTensor) and x.fmt in qm.QUANTIZED_FORMATS:
        return dequantize(x) if x.shape[0] < SMALL_ROWS else qm.pack(x.fmt, x.shape, x.data)
    return x


def _interpret() -> bool:
    return jax.default_backend() != "gpu"


def linear(x: jax.Array, w: Any) -> jax.Array:
    """x [..., in] @ w.T -> float32, for a dense array, a QTensor (reference) or a PackedWeight (Pallas)."""
    if not isinstance(w, qm.PackedWeight):
        return reference_linear(x, w)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    parts = [qm.qmatmul(rows[i:i + qm.M_MAX], w, interpret=_interpret()) for i in range(0, rows.shape[0], qm.M_MAX)]
    out = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
    return out.reshape(*lead, w.shape[0])


def tree_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, length: jax.Array, k_blk: jax.Array,
                   v_blk: jax.Array, blk_mask: jax.Array, prefix_lo: jax.Array, impl: str,
                   layer: int | None = None) -> jax.Array:
    """A block's attention over the committed prefix and its own keys (reference.tree_attention for the args);
    with `layer`, the caches are stacked and the kernel reads that layer in place."""
    args = (q, k_cache, v_cache, length, k_blk, v_blk, blk_mask, prefix_lo)
    if resolve_impl(impl) == "reference":
        return ref.tree_attention(*args, layer)
    return _tree_attention_kernel(*args, layer=layer, interpret=_interpret())


def tree_conv(conv_in: jax.Array, index: jax.Array, weight: jax.Array, impl: str) -> jax.Array:
    """silu of the causal depthwise conv along each token's path (reference.tree_conv for the args)."""
    if resolve_impl(impl) == "reference":
        return ref.tree_conv(conv_in, index, weight)
    return _tree_conv_kernel(conv_in, index, weight, interpret=_interpret())


def gdn_tree(q, k, v, g, beta, s0, anc, impl: str, layer: int | None = None
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The gated delta rule over a verified block: (o, v_new, gamma), as reference.gdn_block; with `layer`, s0 is
    the stacked state and the kernel reads that layer in place."""
    if resolve_impl(impl) == "reference":
        return ref.gdn_block(q, k, v, g, beta, s0, anc, layer)
    return gdn.gdn_tree(q, k, v, g, beta, s0, anc, layer=layer, interpret=_interpret())


def gdn_chunked(q, k, v, g, beta, s0, impl: str, layer: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The causal gated delta rule of a prefill in chunks of 64: (o, final state), as reference.gdn_chunked; with
    `layer`, s0 is the stacked state and the kernel reads that layer in place."""
    if resolve_impl(impl) == "reference":
        return ref.gdn_chunked(q, k, v, g, beta, s0, layer=layer)
    return gdn.gdn_chunked(q, k, v, g, beta, s0, layer=layer, interpret=_interpret())


def gdn_commit(ssm: jax.Array, k: list[jax.Array], v_new: list[jax.Array], gamma: list[jax.Array],
               path: jax.Array, leaf: jax.Array, impl: str) -> jax.Array:
    """Every GDN layer's state after the accepted path: ssm [L, H, dk, dv] and per-layer verify outputs."""
    if resolve_impl(impl) == "reference":
        k, v_new, gamma = jnp.stack(k), jnp.stack(v_new), jnp.stack(gamma)

        # a loop over the layers updates the state in place: a stack of new layers is a second state, and unrolled
        # reads of ssm[i] beside writes of it made XLA copy the whole state
        def layer(i: jax.Array, ssm: jax.Array) -> jax.Array:
            return ssm.at[i].set(ref.gdn_path_state(k[i], v_new[i], gamma[i], ssm[i], path, leaf))

        return jax.lax.fori_loop(0, ssm.shape[0], layer, ssm)
    return gdn.gdn_commit(ssm, jnp.stack(k), jnp.stack(v_new), jnp.stack(gamma), path, leaf,
                          interpret=_interpret())
