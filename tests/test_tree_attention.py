"""The tree-attention kernel (interpret mode on CPU, compiled with -m gpu) against reference.tree_attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import kv_quant as kvq
from dflash_jax.testing.trees import random_ancestors
from pallas_kernels import reference as ref
from pallas_kernels.tree_attention import (LONG_CACHE, default_block_rows, default_splits, default_stages,
                                          row_bytes, tree_attention)

ON_GPU = jax.default_backend() == "gpu"


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def inputs(seed, n, hq, hkv, d, slots, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (n, hq, d))
    kc, vc = (jax.random.normal(kk, (slots, hkv, d)).astype(dtype) for kk in ks[1:3])
    kb, vb = (jax.random.normal(kk, (n, hkv, d)) for kk in ks[3:5])
    return q, kc, vc, kb, vb


def sliding(n, length, window):
    i = np.arange(n)
    blk = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    return blk, (length + i - window + 1).astype(np.int32)


# (N, Hq, Hkv, d, slots, length, splits, mask): N = 1 and not a power of two; contexts of 0, 1 and odd length; a
# cache smaller than a key block, and one not a multiple of it; more splits than the context needs; a window
CASES = [(1, 4, 2, 32, 40, 0, None, "tree"), (5, 6, 2, 32, 40, 1, None, "tree"), (23, 6, 1, 64, 300, 211, 4, "tree"),
         (7, 4, 1, 16, 100, 77, 9, "tree"), (16, 8, 2, 32, 130, 97, 3, "causal"), (8, 4, 2, 16, 70, 45, 2, "sliding"),
         (16, 4, 4, 16, 64, 64, 1, "full")]


def block_mask(kind: str, n: int, length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(the block's mask [n, n], each query's first prefix slot [n]) of a case's kind."""
    if kind == "sliding":
        return sliding(n, length, window=5)
    blk = {"tree": lambda: random_ancestors(rng, n), "causal": lambda: np.tril(np.ones((n, n), bool)),
           "full": lambda: np.ones((n, n), bool)}[kind]()
    return blk, np.zeros(n, np.int32)


@pytest.mark.parametrize("n,hq,hkv,d,slots,length,splits,kind", CASES)
def test_kernel_matches_reference(n, hq, hkv, d, slots, length, splits, kind):
    """Unwritten partials would be NaN (interpret mode fills fresh outputs with NaN) and poison every row."""
    q, kc, vc, kb, vb = inputs(n * slots, n, hq, hkv, d, slots)
    blk, lo = block_mask(kind, n, length, np.random.default_rng(n + slots))
    args = (q, kc, vc, jnp.int32(length), kb, vb, jnp.asarray(blk), jnp.asarray(lo))
    got = tree_attention(*args, splits=splits, interpret=not ON_GPU)
    assert got.shape == q.shape and bool(jnp.all(jnp.isfinite(got)))
    assert rel(got, ref.tree_attention(*args)) < 1e-2  # q, k, v and the probabilities in bf16


@pytest.mark.parametrize("n,hq,hkv,d,slots,length,splits,kind", CASES + [(200, 4, 2, 16, 700, 500, None, "causal")])
def test_blockwise_reference_matches_the_one_pass_reference(n, hq, hkv, d, slots, length, splits, kind):
    """reference.tree_attention_blockwise (a long prefill chunk's) in blocks of 32 slots, the last one clamped to the
    cache's end, against the one-pass softmax: contexts of 0 and 1 slot, odd lengths, a window, stacked caches."""
    q, kc, vc, kb, vb = inputs(n * slots, n, hq, hkv, d, slots)
    blk, lo = block_mask(kind, n, length, np.random.default_rng(n + slots))
    stacked = [jnp.stack([c * 2.0, c]) for c in (kc, vc)]
    args = (q, *stacked, jnp.int32(length), kb, vb, jnp.asarray(blk), jnp.asarray(lo))
    got = jax.jit(ref.tree_attention_blockwise, static_argnames=("layer", "block"))(*args, layer=1, block=32)
    assert rel(got, ref.tree_attention(*args, layer=1)) < 1e-6


def test_bf16_cache_and_slots_past_length_are_ignored():
    """Slots at or past `length` hold garbage (here: huge values) that must not leak in; the cache may be bf16."""
    n, slots, length = 5, 96, 50
    q, kc, vc, kb, vb = inputs(7, n, 4, 2, 32, slots, jnp.bfloat16)
    kc, vc = (c.at[length:].set(1e4) for c in (kc, vc))
    blk = jnp.asarray(random_ancestors(np.random.default_rng(0), n))
    args = (q, kc, vc, jnp.int32(length), kb, vb, blk, jnp.zeros(n, jnp.int32))
    got = tree_attention(*args, splits=3, interpret=not ON_GPU)
    assert rel(got, ref.tree_attention(*args)) < 1e-2


@pytest.mark.parametrize("slots", [40, 130])  # smaller than a key block (padded), and not a multiple of one
def test_layer_of_stacked_caches(slots):
    """With `layer`, the kernel reads that layer of stacked [layers, S, Hkv, d] caches (the target's and drafter's
    decode state) as the reference does; the other layers hold garbage that must not leak in."""
    n, length, layers, layer = 7, slots - 9, 3, 1
    q, kc, vc, kb, vb = inputs(slots, n, 4, 2, 32, slots)
    kc_all, vc_all = (jnp.full((layers,) + c.shape, 1e4, c.dtype).at[layer].set(c) for c in (kc, vc))
    blk = jnp.asarray(random_ancestors(np.random.default_rng(slots), n))
    lo = jnp.zeros(n, jnp.int32)
    want = ref.tree_attention(q, kc, vc, jnp.int32(length), kb, vb, blk, lo)
    stacked = (q, kc_all, vc_all, jnp.int32(length), kb, vb, blk, lo)
    assert rel(ref.tree_attention(*stacked, layer), want) == 0.0
    assert rel(tree_attention(*stacked, layer=layer, splits=2, interpret=not ON_GPU), want) < 1e-2
    with pytest.raises(ValueError, match="give stacked caches"):
        tree_attention(q, kc, vc, jnp.int32(length), kb, vb, blk, lo, layer=0, interpret=not ON_GPU)


def test_bad_shapes_raise():
    q, kc, vc, kb, vb = inputs(0, 4, 6, 4, 32, 64)
    with pytest.raises(ValueError, match="shapes do not fit"):
        tree_attention(q, kc, vc, jnp.int32(3), kb, vb, jnp.ones((4, 4), bool), jnp.zeros(4, jnp.int32))


def test_default_splits():
    assert [default_splits(s) for s in (40, 1024, 1025, 4096 + 24, 32768 + 24, 262144)] == [1, 1, 2, 5, 32, 32]


def test_default_block_rows_grow_with_the_cache():
    assert [default_block_rows(s) for s in (40, 4096 + 64, LONG_CACHE - 1, LONG_CACHE, 262144)] == [32, 32, 32, 64, 64]


def test_64_row_tiles_and_three_stages_match_the_reference():
    """The long-cache tile (64 rows: 23 tokens x 6 heads = 138 rows, the last tile ragged) and pipeline depth."""
    n, slots, length = 23, 200, 151
    q, kc, vc, kb, vb = inputs(3, n, 6, 1, 32, slots)
    blk = jnp.asarray(random_ancestors(np.random.default_rng(3), n))
    args = (q, kc, vc, jnp.int32(length), kb, vb, blk, jnp.zeros(n, jnp.int32))
    got = tree_attention(*args, splits=2, block_rows=64, num_stages=3, interpret=not ON_GPU)
    assert rel(got, ref.tree_attention(*args)) < 1e-2


def test_three_stages_while_a_stage_fits_64_kib():
    """bfloat16 caches of the 27B's heads and float32 ones of the drafter's take 3 stages; the 27B's float32 caches
    (128 KiB a stage) take 2, which fit the SM's shared memory; its block types (q8_0: 8 blocks of 34 bytes a row)
    take 3 (scripts/results/attn_smem_sm90.txt)."""
    stages = lambda block_k, kind, d: default_stages(block_k, 2 * row_bytes(kvq.empty(kind, (1, d))))  # noqa: E731
    pairs = (("bf16", 256), ("f32", 128), ("bf16", 128), ("f32", 256))
    assert [stages(64, kind, d) for kind, d in pairs] == [3, 3, 3, 2]
    assert stages(32, "f32", 256) == 3
    assert [stages(64, kind, 256) for kind in ("q8_0", "q4_0", "rq3_0")] == [3, 3, 3]
    assert row_bytes(kvq.empty("q8_0", (1, 256))) == 272 and row_bytes(kvq.empty("rq3_0", (1, 256))) == 112


@pytest.mark.gpu
@pytest.mark.parametrize("who,n,hq,hkv,d,context,kind,dtype", [
    ("target verify", 23, 24, 4, 256, 4096, "tree", jnp.bfloat16),
    ("target verify", 23, 24, 4, 256, 32768, "tree", jnp.bfloat16),
    ("target prefill", 64, 24, 4, 256, 3000, "causal", jnp.bfloat16),
    ("target prefill, float32 cache", 64, 24, 4, 256, 3000, "causal", jnp.float32),
    ("target verify, float32 cache", 23, 24, 4, 256, 32768, "tree", jnp.float32),
    ("drafter full", 16, 32, 8, 128, 4096, "full", jnp.bfloat16),
    ("drafter full", 16, 32, 8, 128, 32768, "full", jnp.bfloat16),
    ("drafter sliding", 16, 32, 8, 128, 4096, "sliding", jnp.bfloat16)])
def test_real_shapes_on_gpu(who, n, hq, hkv, d, context, kind, dtype):
    rng = np.random.default_rng(context + n)
    slots = context + 64
    q, kc, vc, kb, vb = inputs(context, n, hq, hkv, d, slots, dtype)
    lo = np.zeros(n, np.int32)
    blk = {"tree": lambda: random_ancestors(rng, n), "causal": lambda: np.tril(np.ones((n, n), bool)),
           "full": lambda: np.ones((n, n), bool)}.get(kind, lambda: None)()
    if kind == "sliding":
        blk, lo = sliding(n, context - 5, window=2048)
    args = (q, kc, vc, jnp.int32(context - 5), kb, vb, jnp.asarray(blk), jnp.asarray(lo))
    assert rel(tree_attention(*args), ref.tree_attention(*args)) < 1e-2, who


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_token_sees_the_same_in_a_chain_as_alone(dtype):
    """The last token of a 9-token chain verified on top of 150 committed slots, and the same token alone after the
    other 8 were committed (AR): the same keys, split otherwise between the cache and the block and over other
    prefix splits. With `exact` the outputs agree to float32 summation order; one bf16 term for the softmax weights
    (exact=False) rounds them against another running maximum and differs by about bf16's precision."""
    n, length, slots = 9, 150, 256
    q, kc, vc, kb, vb = inputs(7, n, 6, 2, 64, slots, dtype)
    kb, vb = kb.astype(dtype), vb.astype(dtype)  # the block's keys as the cache will hold them (models/target.py)
    chain = jnp.asarray(np.tril(np.ones((n, n), bool)))
    lo = jnp.zeros(n, jnp.int32)
    kc_ar, vc_ar = kc.at[length:length + n - 1].set(kb[:-1]), vc.at[length:length + n - 1].set(vb[:-1])
    one = jnp.ones((1, 1), bool)
    got = {}
    for exact in (True, False):
        opts = dict(interpret=not ON_GPU, exact=exact, splits=3)
        tree = tree_attention(q, kc, vc, jnp.int32(length), kb, vb, chain, lo, **opts)[-1]
        alone = tree_attention(q[-1:], kc_ar, vc_ar, jnp.int32(length + n - 1), kb[-1:], vb[-1:], one, lo[:1],
                               **opts)[0]
        got[exact] = rel(alone, tree)
    assert got[True] < 2e-6 and got[False] > 1e-4, got


@pytest.mark.parametrize("n,kind,length,slots", [(200, "causal", 150, 400), (100, "tree", 0, 200),
                                                 (130, "sliding", 70, 256)])
def test_a_long_chunk_reads_its_keys_a_tile_at_a_time(n, kind, length, slots):
    """A prefill chunk longer than a key tile (64): the block program reads its keys a tile at a time, as the prefix
    programs read the cache, and matches the reference; the causal chunk's last token sees what it sees alone after
    the others were committed (exact numerics)."""
    q, kc, vc, kb, vb = inputs(n, n, 4, 2, 32, slots)
    blk, lo = block_mask(kind, n, length, np.random.default_rng(n))
    args = (q, kc, vc, jnp.int32(length), kb, vb, jnp.asarray(blk), jnp.asarray(lo))
    got = tree_attention(*args, interpret=not ON_GPU)
    assert got.shape == q.shape and rel(got, ref.tree_attention(*args)) < 1e-2  # bf16 products
    if kind == "causal":
        kc_ar, vc_ar = kc.at[length:length + n - 1].set(kb[:-1]), vc.at[length:length + n - 1].set(vb[:-1])
        alone = tree_attention(q[-1:], kc_ar, vc_ar, jnp.int32(length + n - 1), kb[-1:], vb[-1:],
                               jnp.ones((1, 1), bool), jnp.asarray(lo[:1]), interpret=not ON_GPU)
        assert rel(alone[0], got[-1]) < 5e-6  # measured 2.3e-6 over 350 keys (9 tokens: under 2e-6, above)
