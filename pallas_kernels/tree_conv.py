"""The causal depthwise conv of the GDN layers along each token's path in a tree, then SiLU, as a Pallas GPU kernel.

Token n's output channel c is silu(sum_k x[index[n, k], c] * w[c, k]), where x = concat(committed conv inputs,
the block's pre-conv inputs) and index [N, K] holds the rows along n's path (its ancestors at depth - K+1 .. depth,
or committed rows past the block's start); a prefill chunk is the chain case. One program owns `block_c` channels
and walks the tokens, loading the K rows each one reads by their index, so it reads only the rows it uses. The
reference is `reference.tree_conv`. Pallas Triton backend; `interpret=True` runs it on CPU for the tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.tiles import dot_tile


def _kernel(kernel: int, n: int, x_ref, idx_ref, w_ref, o_ref):
    w = [w_ref[:, k] for k in range(kernel)]  # w_ref [block_c, K]: the weight as the model holds it

    def token(i, carry):
        acc = sum(x_ref[idx_ref[k, i], :] * w[k] for k in range(kernel))
        o_ref[i, :] = acc * jax.nn.sigmoid(acc)
        return carry

    jax.lax.fori_loop(0, n, token, 0)


@functools.partial(jax.jit, static_argnames=("block_c", "num_warps", "interpret"))
def tree_conv(conv_in: jax.Array, index: jax.Array, weight: jax.Array, *, block_c: int = 128, num_warps: int = 4,
              interpret: bool = False) -> jax.Array:
    """silu(depthwise conv along paths): conv_in [R, C], index [N, K] int, weight [C, K] -> [N, C] float32."""
    r, c = conv_in.shape
    n, kernel = index.shape
    if weight.shape != (c, kernel):
        raise ValueError(f"weight {weight.shape} does not fit conv_in {conv_in.shape} and index {index.shape}")
    if block_c < 16 or block_c & (block_c - 1):
        raise ValueError(f"block_c must be a power of two, at least 16; got {block_c}")
    # Triton blocks are powers of two: pad rows, tokens, lags and channels (padded tokens read row 0 and are
    # dropped, padded lags are never read, padded channels have weight 0)
    c_pad = pl.cdiv(c, block_c) * block_c
    r_pad, n_pad, k_pad = dot_tile(r), dot_tile(n), 1 << max(0, (kernel - 1).bit_length())
    x = jnp.pad(conv_in.astype(jnp.float32), ((0, r_pad - r), (0, c_pad - c)))
    idx = jnp.pad(index.astype(jnp.int32).T, ((0, k_pad - kernel), (0, n_pad - n)))
    # the weight as the model holds it, [C, K]: a transposed copy was an XLA launch a layer every step
    w = jnp.pad(weight.astype(jnp.float32), ((0, c_pad - c), (0, k_pad - kernel)))
    out = pl.pallas_call(
        functools.partial(_kernel, kernel, n),
        out_shape=jax.ShapeDtypeStruct((n_pad, c_pad), jnp.float32),
        grid=(c_pad // block_c,),
        in_specs=[pl.BlockSpec((r_pad, block_c), lambda i: (0, i)), pl.BlockSpec((k_pad, n_pad), lambda i: (0, 0)),
                  pl.BlockSpec((block_c, k_pad), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((n_pad, block_c), lambda i: (0, i)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="tree_conv",
    )(x, idx, w)
    return out[:n, :c]
