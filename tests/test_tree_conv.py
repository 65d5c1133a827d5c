"""The tree conv kernel (interpret mode on CPU, compiled with -m gpu) against its jnp reference, on the rows the
target's verify and prefill really read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.models import target as T
from pallas_kernels import reference as ref
from pallas_kernels.tree_conv import tree_conv

ON_GPU = jax.default_backend() == "gpu"
KERNEL = 4


def tree_index(seed: int, n: int) -> jax.Array:
    """Conv rows of a random tree of n nodes (parent uniform over earlier nodes or none)."""
    rng = np.random.default_rng(seed)
    parents = np.array([int(rng.integers(-1, i)) if i else -1 for i in range(n)], np.int32)
    return T._conv_index(T.tree_block(jnp.asarray(parents)), KERNEL)


def conv_inputs(seed: int, n: int, channels: int) -> tuple[jax.Array, jax.Array]:
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (KERNEL - 1 + n, channels))
    return x, jax.random.normal(kw, (channels, KERNEL))


@pytest.mark.parametrize("n,channels,block_c", [(1, 16, 16), (5, 48, 32), (23, 300, 64), (33, 64, 64)])
def test_tree_matches_reference(n, channels, block_c):
    """Odd token counts, channels that are not a multiple of the tile (300 over tiles of 64); every output is
    compared, and an unwritten one would be NaN in interpret mode."""
    index = tree_index(n, n)
    x, w = conv_inputs(n, n, channels)
    got = tree_conv(x, index, w, block_c=block_c, interpret=not ON_GPU)
    np.testing.assert_allclose(got, ref.tree_conv(x, index, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 64])
def test_chain_matches_reference(n):
    index = T._conv_index(T.chain_block(n), KERNEL)
    x, w = conv_inputs(7, n, 32)
    got = tree_conv(x, index, w, block_c=16, interpret=not ON_GPU)
    np.testing.assert_allclose(got, ref.tree_conv(x, index, w), rtol=1e-5, atol=1e-5)


def test_bad_shapes_raise():
    x, w = conv_inputs(0, 4, 32)
    with pytest.raises(ValueError, match="does not fit"):
        tree_conv(x, tree_index(0, 4), w[:, :3], interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        tree_conv(x, tree_index(0, 4), w, block_c=48, interpret=True)


@pytest.mark.gpu
def test_real_shapes_on_gpu():
    """The 27B's conv: 10240 channels (q, k, v), a 23-node tree and a 64-token prefill chunk."""
    for index in (tree_index(1, 23), T._conv_index(T.chain_block(64), KERNEL)):
        x, w = conv_inputs(1, index.shape[0], 10240)
        np.testing.assert_allclose(tree_conv(x, index, w), ref.tree_conv(x, index, w), rtol=1e-4, atol=1e-4)
