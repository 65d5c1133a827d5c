"""The tree-attention kernel over caches in the block types (dflash_jax/kv_quant.py), K and V each in its own type:
interpret mode against reference.tree_attention over the dequantized cache, a token's output alone (AR) and inside a
bigger block, the Triton lowering of each type at the 27B's shapes (no GPU needed), and the GPU kernel (-m gpu)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import kv_quant as kvq
from dflash_jax.quant import Unsupported
from dflash_jax.testing.trees import random_ancestors
from pallas_kernels import reference as ref
from pallas_kernels.tree_attention import tree_attention

ON_GPU = jax.default_backend() == "gpu"
BF16 = 1e-2  # the kernel rounds q, the decoded k and v and the probabilities to bf16 (as tests/test_tree_attention.py)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@functools.partial(jax.jit, static_argnums=(1, 2))
def rows(key, shape, kind):
    """Random rows [..., d] as a cache in `kind` holds them (a float array, or KVBlocks)."""
    return kvq.stored(jax.random.normal(key, shape), kvq.empty(kind, shape))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6, 7))
def stacked(key, layers, layer, slots, hkv, d, kind, length):
    """A stacked cache [layers, slots, hkv, d] in `kind`: random rows in `layer`; slots at or past `length` and the
    other layers hold large values, which must not leak in."""
    x = jnp.full((layers, slots, hkv, d), 1e3).at[layer, :length].set(jax.random.normal(key, (length, hkv, d)))
    return kvq.stored(x, kvq.empty(kind, x.shape))


@functools.partial(jax.jit, static_argnums=1)
def dequantized(x, layer=None):
    return kvq.readable(x, layer).astype(jnp.float32)


reference = jax.jit(ref.tree_attention)


def mask(kind, n, length, rng):
    """(blk_mask [n, n], prefix_lo [n]) of a tree, a causal chunk, or a sliding window of 5 (prefix_lo > 0)."""
    if kind == "tree":
        return random_ancestors(rng, n), np.zeros(n, np.int32)
    i = np.arange(n)
    if kind == "causal":
        return i[None, :] <= i[:, None], np.zeros(n, np.int32)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 5), (length + i - 4).astype(np.int32)


# (K type, V type, N, Hq, Hkv, d, slots, length, splits, mask): each block type, K and V of different types (one
# rotated and one not, either way round; a float K beside a rotated V), GQA, more splits than keys need, a cache
# smaller than a key block (padded) and ones not a multiple of it; a prefill chunk longer than a key tile
CASES = [("q8_0", "q4_0", 130, 4, 2, 32, 256, 100, 2, "causal"),
         ("q8_0", "q8_0", 7, 4, 2, 64, 130, 123, 3, "tree"),
         ("q4_0", "q4_0", 6, 6, 2, 32, 40, 33, 2, "sliding"),
         ("rq3_0", "rq3_0", 5, 4, 1, 64, 100, 77, 4, "tree"),
         ("q8_0", "q4_0", 8, 4, 2, 32, 70, 70, 1, "causal"),
         ("rq3_0", "q8_0", 6, 4, 2, 64, 70, 61, 2, "tree"),
         ("f16", "rq3_0", 5, 4, 2, 32, 64, 50, 2, "tree")]


@pytest.mark.parametrize("k_kind,v_kind,n,hq,hkv,d,slots,length,splits,blk", CASES)
def test_kernel_matches_the_reference_over_the_dequantized_cache(k_kind, v_kind, n, hq, hkv, d, slots, length,
                                                                 splits, blk):
    """Layer 1 of stacked caches; the block's rows in the cache's types, as models/target.py passes them."""
    layers, layer = 2, 1
    ks = jax.random.split(jax.random.key(slots + n), 5)
    q = jax.random.normal(ks[0], (n, hq, d))
    kc, vc = (stacked(kk, layers, layer, slots, hkv, d, kind, length) for kk, kind in ((ks[1], k_kind),
                                                                                      (ks[2], v_kind)))
    kb, vb = rows(ks[3], (n, hkv, d), k_kind), rows(ks[4], (n, hkv, d), v_kind)
    blk_mask, lo = (jnp.asarray(a) for a in mask(blk, n, length, np.random.default_rng(n)))
    want = reference(q, dequantized(kc, layer), dequantized(vc, layer), jnp.int32(length), dequantized(kb),
                              dequantized(vb), blk_mask, lo)
    got = tree_attention(q, kc, vc, jnp.int32(length), kb, vb, blk_mask, lo, layer=layer, splits=splits,
                         interpret=not ON_GPU)
    assert got.shape == q.shape and bool(jnp.all(jnp.isfinite(got)))
    assert rel(got, want) < BF16


@pytest.mark.parametrize("k_kind,v_kind", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("rq3_0", "rq3_0"),
                                           ("q8_0", "rq3_0")])
def test_a_token_sees_the_same_in_a_chain_as_alone(k_kind, v_kind):
    """The last token of a 9-token chain verified on top of 150 committed slots, and the same token alone after the
    other 8 were committed (AR): the same blocks, read by the block program in one case and by the prefix programs
    (over other split boundaries) in the other, decode alike, so the outputs agree to float32 summation order."""
    n, length, slots, hkv, d = 9, 150, 256, 2, 64
    ks = jax.random.split(jax.random.key(7), 5)
    q = jax.random.normal(ks[0], (n, 6, d))
    kc, vc = rows(ks[1], (slots, hkv, d), k_kind), rows(ks[2], (slots, hkv, d), v_kind)
    kb, vb = rows(ks[3], (n, hkv, d), k_kind), rows(ks[4], (n, hkv, d), v_kind)
    commit = lambda c, b: jax.tree.map(lambda x, y: x.at[length:length + n - 1].set(y[:-1]), c, b)  # noqa: E731
    last = lambda b: jax.tree.map(lambda x: x[-1:], b)  # noqa: E731
    opts = dict(interpret=not ON_GPU, splits=3)
    lo = jnp.zeros(n, jnp.int32)
    chain = tree_attention(q, kc, vc, jnp.int32(length), kb, vb, jnp.tril(jnp.ones((n, n), bool)), lo, **opts)[-1]
    alone = tree_attention(q[-1:], commit(kc, kb), commit(vc, vb), jnp.int32(length + n - 1), last(kb), last(vb),
                           jnp.ones((1, 1), bool), lo[:1], **opts)[0]
    assert rel(alone, chain) < 2e-6


def test_block_rows_must_be_in_the_caches_type():
    """Float rows for the block beside a block-type cache would be decoded otherwise than the prefix's: refused."""
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (4, 4, 32))
    kc = rows(ks[1], (64, 2, 32), "q8_0")
    kb = rows(ks[2], (4, 2, 32), "q8_0")
    args = (jnp.int32(10), kb, kvq.readable(kb), jnp.ones((4, 4), bool), jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match=r"the block's values \(float\) must be in the cache's type \(q8_0\)"):
        tree_attention(q, kc, kc, *args, interpret=True)


def test_a_head_dim_of_blocks_not_a_power_of_two_is_refused():
    """q8_0 takes a head_dim of 96 (the reference reads it), the kernel's tiles of 3 blocks a row do not: Unsupported,
    which the commands report in one line (a NotImplementedError)."""
    q = jnp.ones((2, 2, 96))
    kc, kb = kvq.empty("q8_0", (64, 1, 96)), kvq.empty("q8_0", (2, 1, 96))
    with pytest.raises(Unsupported, match="power of two .* this model's head_dim is 96"):
        tree_attention(q, kc, kc, jnp.int32(3), kb, kb, jnp.ones((2, 2), bool), jnp.zeros(2, jnp.int32),
                       interpret=True)


def cache_shape(kind, lead, hkv=4, d=256):
    return jax.eval_shape(lambda: kvq.empty(kind, (*lead, hkv, d)))


@pytest.mark.parametrize("k_kind,v_kind", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("rq3_0", "rq3_0"),
                                           ("q8_0", "q4_0")])
@pytest.mark.parametrize("n", [23, 1, 512])
def test_lowers_to_triton_at_the_27b_shapes(k_kind, v_kind, n):
    """The 27B's verify (23 tokens, 24 query and 4 KV heads of 256), one AR token and a 512-token prefill chunk over
    16 stacked layers of 4096 slots: the kernel lowers for CUDA without a GPU, so an op the Triton lowering lacks (a concatenate, a gather)
    fails here, not first on the device."""
    run = jax.jit(lambda q, kc, vc, length, kb, vb, blk, lo, layer: tree_attention(q, kc, vc, length, kb, vb, blk, lo,
                                                                                  layer=layer))
    args = (jax.ShapeDtypeStruct((n, 24, 256), jnp.float32), cache_shape(k_kind, (16, 4096)),
            cache_shape(v_kind, (16, 4096)), jax.ShapeDtypeStruct((), jnp.int32), cache_shape(k_kind, (n,)),
            cache_shape(v_kind, (n,)), jax.ShapeDtypeStruct((n, n), jnp.bool_), jax.ShapeDtypeStruct((n,), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.int32))
    hlo = run.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count('name = "tree_attention"') == 1


@pytest.mark.gpu
@pytest.mark.parametrize("k_kind,v_kind,n,context", [
    ("q8_0", "q8_0", 23, 4096), ("q4_0", "q4_0", 23, 4096), ("rq3_0", "rq3_0", 23, 4096), ("q8_0", "q4_0", 23, 4096),
    ("q8_0", "q8_0", 1, 4096), ("q4_0", "q4_0", 23, 32768), ("rq3_0", "rq3_0", 23, 32768)])
def test_real_shapes_on_gpu(k_kind, v_kind, n, context):
    """The 27B's heads over 16 stacked layers (layer 5 read), a tree of n tokens, against the reference over the
    dequantized layer."""
    layers, layer, slots, length = 16, 5, context + 64, context - 5
    ks = jax.random.split(jax.random.key(context + n), 5)
    q = jax.random.normal(ks[0], (n, 24, 256))
    kc, vc = (stacked(kk, layers, layer, slots, 4, 256, kind, length) for kk, kind in ((ks[1], k_kind),
                                                                                      (ks[2], v_kind)))
    kb, vb = rows(ks[3], (n, 4, 256), k_kind), rows(ks[4], (n, 4, 256), v_kind)
    blk_mask = jnp.asarray(random_ancestors(np.random.default_rng(n), n))
    lo = jnp.zeros(n, jnp.int32)
    want = reference(q, dequantized(kc, layer), dequantized(vc, layer), jnp.int32(length), dequantized(kb),
                              dequantized(vb), blk_mask, lo)
    got = tree_attention(q, kc, vc, jnp.int32(length), kb, vb, blk_mask, lo, layer=layer)
    assert rel(got, want) < BF16
