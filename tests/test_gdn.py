"""The gated-delta-rule kernels (interpret mode on CPU, compiled with -m gpu) against their jnp references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.testing.trees import random_ancestors
from pallas_kernels import gdn
from pallas_kernels import reference as ref

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
TOL = 1e-5 if INTERPRET else 2e-3  # a GPU bound from when its kernels multiplied in TF32 (3e-4 to 6e-4); float32 now


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def inputs(seed, n, h, dk, dv):
    """Delta-rule inputs as the model makes them: unit keys, scaled unit queries, log-decays <= 0, beta in (0, 1)."""
    ks = jax.random.split(jax.random.key(seed), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (n, h, dk))) * dk ** -0.5
    k = unit(jax.random.normal(ks[1], (n, h, dk)))
    v = jax.random.normal(ks[2], (n, h, dv))
    g = -jax.random.uniform(ks[3], (n, h), maxval=1.5)
    beta = jax.random.uniform(ks[4], (n, h))
    s0 = jax.random.normal(ks[5], (h, dk, dv)) * 0.3
    return q, k, v, g, beta, s0


def random_anc(seed, n):
    return jnp.asarray(random_ancestors(np.random.default_rng(seed), n))


@pytest.mark.parametrize("n", [1, 5, 23, 33])
def test_tree_kernel_matches_reference(n):
    """Outputs unwritten by the kernel would be NaN (interpret mode) and fail the comparison."""
    x = inputs(n, n, 3, 16, 64)
    anc = random_anc(n, n)
    got, want = gdn.gdn_tree(*x, anc, interpret=INTERPRET), ref.gdn_block(*x, anc)
    for name, a, b in zip(("o", "v_new", "gamma"), got, want):
        assert a.shape == b.shape and rel(a, b) < TOL, name


def test_kernels_read_a_layer_of_the_stacked_state():
    """With `layer`, s0 is the stacked state [layers, H, dk, dv] (the decode state's) and that layer is read."""
    *x, s0 = inputs(4, 23, 3, 16, 64)
    anc = random_anc(4, 23)
    stacked = jnp.stack([s0 + 5.0, s0, s0 - 5.0])
    want = ref.gdn_block(*x, s0, anc)
    for got in (ref.gdn_block(*x, stacked, anc, 1), gdn.gdn_tree(*x, stacked, anc, layer=1, interpret=INTERPRET)):
        for name, a, b in zip(("o", "v_new", "gamma"), got, want):
            assert rel(a, b) < TOL, name
    want = ref.gdn_chunked(*x, s0)
    for got in (ref.gdn_chunked(*x, stacked, layer=1), ref.gdn_chunked_blockwise(*x, stacked, layer=1),
                gdn.gdn_chunked(*x, stacked, layer=1, interpret=INTERPRET)):
        assert rel(got[0], want[0]) < TOL and rel(got[1], want[1]) < TOL


@pytest.mark.parametrize("t", [1, 63, 64, 65, 130])
def test_chunked_kernel_matches_reference(t):
    x = inputs(t, t, 2, 16, 32)
    (o, s), (o_ref, s_ref) = gdn.gdn_chunked(*x, interpret=INTERPRET), ref.gdn_chunked(*x)
    assert rel(o, o_ref) < TOL and rel(s, s_ref) < TOL


@pytest.mark.parametrize("n,leaf", [(1, 0), (23, 22), (23, 7)])
def test_commit_kernel_matches_reference_for_every_layer(n, leaf):
    layers, h, dk, dv = 3, 2, 16, 32
    anc = random_anc(n, n)
    ks, vs, gs, s0 = [], [], [], []
    for layer in range(layers):
        x = inputs(10 * n + layer, n, h, dk, dv)
        _, v_new, gamma = ref.gdn_block(*x, anc)
        ks.append(x[1]), vs.append(v_new), gs.append(gamma), s0.append(x[5])
    want = jnp.stack([ref.gdn_path_state(k, v, g, s, anc[leaf], jnp.int32(leaf)) for k, v, g, s in zip(ks, vs, gs, s0)])
    got = gdn.gdn_commit(jnp.stack(s0), jnp.stack(ks), jnp.stack(vs), jnp.stack(gs), anc[leaf], jnp.int32(leaf),
                         interpret=INTERPRET)
    assert rel(got, want) < 1e-5


@pytest.mark.parametrize("sign", [1, -1])
def test_aligned_keys_stay_exact(sign):
    """64 tokens with one key (or alternating +-k), beta 0.95, slow decay: what a repeated token does in real text.
    The chunked reference and kernel must follow the token recurrence (a power-series inverse was off by 1e10)."""
    q, k, v, g, beta, s0 = inputs(7, 64, 2, 16, 32)
    k = jnp.broadcast_to(k[:1], k.shape) * jnp.asarray([sign ** i for i in range(64)], jnp.float32)[:, None, None]
    g, beta = jnp.full_like(g, -0.01), jnp.full_like(beta, 0.95)
    o_rec, s_rec = ref.gdn_recurrent(q, k, v, g, beta, s0)
    o_ref, s_ref = ref.gdn_chunked(q, k, v, g, beta, s0)
    o, s = gdn.gdn_chunked(q, k, v, g, beta, s0, interpret=INTERPRET)
    assert rel(o_ref, o_rec) < 1e-5 and rel(s_ref, s_rec) < 1e-5
    assert rel(o, o_rec) < TOL and rel(s, s_rec) < TOL


@pytest.mark.parametrize("t", [64, 256, 500, 1024])
def test_blockwise_chunked_rule_matches_substitution_and_recurrence(t):
    """reference.gdn_chunked_blockwise, a long prefill chunk's rule (every chunk's WY system solved blockwise, only
    the state carried), against the per-token substitution and the token recurrence; 500 leaves a padded tail."""
    x = inputs(t, t, 2, 16, 32)
    o, s = jax.jit(ref.gdn_chunked_blockwise)(*x)
    for o_ref, s_ref in (ref.gdn_chunked(*x), ref.gdn_recurrent(*x)):
        assert o.shape == o_ref.shape and rel(o, o_ref) < 1e-5 and rel(s, s_ref) < 1e-5


@pytest.mark.parametrize("sign", [1, -1])
def test_blockwise_rule_stays_exact_when_keys_align(sign):
    """256 tokens of one key (or alternating +-k), beta 0.95: the joined blocks' products do not cancel."""
    q, k, v, g, beta, s0 = inputs(8, 256, 2, 16, 32)
    k = jnp.broadcast_to(k[:1], k.shape) * jnp.asarray([sign ** i for i in range(256)], jnp.float32)[:, None, None]
    g, beta = jnp.full_like(g, -0.01), jnp.full_like(beta, 0.95)
    o_rec, s_rec = ref.gdn_recurrent(q, k, v, g, beta, s0)
    o, s = ref.gdn_chunked_blockwise(q, k, v, g, beta, s0)
    assert rel(o, o_rec) < 1e-5 and rel(s, s_rec) < 1e-5


@pytest.mark.parametrize("n", [16, 64, 128])
def test_block_lower_inverse_equals_substitution(n):
    """The UT transform's inverse: 16-row blocks by substitution, joined by products, as substitution over n rows
    gives, for a delta-rule system (beta K K^T under the decay, strictly lower)."""
    _, k, _, g, beta, _ = inputs(n, n, 2, 16, 32)
    gamma = jnp.cumsum(g, axis=0).T  # [H, n]
    below = jnp.tril(jnp.ones((n, n), bool), -1)
    decay = jnp.where(below, jnp.exp(jnp.where(below, gamma[:, :, None] - gamma[:, None, :], 0.0)), 0.0)
    a = beta.T[:, :, None] * jnp.einsum("ihd,jhd->hij", k, k) * decay
    want = ref.unit_lower_inverse(a)
    assert rel(ref.block_lower_inverse(a), want) < 1e-6
    if n == 64:  # 48 rows are three blocks of 16: not joined pairwise
        with pytest.raises(ValueError, match="power of two"):
            ref.block_lower_inverse(a[:, :48, :48])


@pytest.mark.parametrize("n,block", [(16, 4), (32, 8), (32, 16), (64, 16), (64, 8)])
def test_masked_block_inverse_equals_sliced_and_substitution(n, block):
    """The kernel's in-tile form of the blockwise inverse (masks and products only) against the sliced reference and
    full substitution, on a delta-rule system under a random tree's mask and on aligned keys (beta 0.95)."""
    _, k, _, g, beta, _ = inputs(n, n, 2, 16, 32)
    anc = random_anc(n, n)
    gamma = jnp.einsum("ij,jh->hi", anc.astype(jnp.float32), g)
    below = anc & ~jnp.eye(n, dtype=bool)
    decay = jnp.where(below, jnp.exp(jnp.where(below, gamma[:, :, None] - gamma[:, None, :], 0.0)), 0.0)
    aligned = jnp.broadcast_to(k[:1], k.shape)
    for keys, b in ((k, beta), (aligned, jnp.full_like(beta, 0.95))):
        a = b.T[:, :, None] * jnp.einsum("ihd,jhd->hij", keys, keys) * decay
        got = ref.masked_block_lower_inverse(a, block)
        assert rel(got, ref.unit_lower_inverse(a)) < 1e-6
        assert rel(got, ref.block_lower_inverse(a, block)) < 1e-6
    if n == 64:
        with pytest.raises(ValueError, match="power of two"):
            ref.masked_block_lower_inverse(a[:, :48, :48], 16)


@pytest.mark.parametrize("solve_block", [4, 16, 64])
def test_kernel_solve_blocks_match_reference(solve_block):
    """gdn_blocks with other diagonal blocks for its inverse (64: plain substitution), a tree and a prefill."""
    x = inputs(7, 23, 3, 16, 64)
    anc = random_anc(7, 23)
    got = gdn.gdn_tree(*x, anc, interpret=INTERPRET, solve_block=solve_block)
    for name, a, b in zip(("o", "v_new", "gamma"), got, ref.gdn_block(*x, anc)):
        assert rel(a, b) < TOL, name
    x = inputs(8, 100, 2, 16, 32)
    for a, b in zip(gdn.gdn_chunked(*x, interpret=INTERPRET, solve_block=solve_block), ref.gdn_recurrent(*x)):
        assert rel(a, b) < TOL


def one_token_outputs(h, dk, dv, seed=11):
    """gdn_tree of one token (the AR step) with the inverse skipped (`one`, its default there) and with the full
    block, and the reference's."""
    x, anc = inputs(seed, 1, h, dk, dv), jnp.ones((1, 1), bool)
    fast, full = (gdn.gdn_tree(*x, anc, interpret=INTERPRET, one=one) for one in (True, False))
    return fast, full, ref.gdn_block(*x, anc)


def test_one_token_skips_the_inverse_and_gives_the_full_blocks_bits():
    """A = 0 for one real token, so T = I, and U, W taken without their products by T are what the products give."""
    for name, a, b, c in zip(("o", "v_new", "gamma"), *one_token_outputs(3, 16, 64)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), name
        assert rel(a, c) < TOL, name


def test_bad_block_raises():
    x = inputs(0, 24, 2, 16, 32)
    with pytest.raises(ValueError, match="power of two"):
        gdn.gdn_blocks(*x, jnp.tril(jnp.ones((24, 24), bool)), block_n=24, final=True, interpret=True)
    with pytest.raises(ValueError, match="one real token"):
        gdn.gdn_blocks(*inputs(0, 32, 2, 16, 32), jnp.eye(16, dtype=bool), block_n=16, final=True, one=True,
                       interpret=True)


@pytest.mark.gpu
def test_one_token_on_gpu_gives_the_full_blocks_bits():
    """The AR step's delta rule at the 27B's shapes (48 value heads of 128 x 128), compiled: skipping the inverse
    leaves every output bit as the full block computes it, so the AR step's sums stay those of before."""
    for name, a, b, c in zip(("o", "v_new", "gamma"), *one_token_outputs(48, 128, 128)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), name
        assert rel(a, c) < 2e-3, name


@pytest.mark.gpu
def test_real_shapes_on_gpu():
    """The 27B's GDN layer: 48 value heads of 128 x 128; a 23-node tree, a 3-chunk prefill, a 48-layer commit.
    The kernels multiply in TF32 (the reference here in float32): 4.7e-4 measured on one layer."""
    h, dk, dv, n, layers = 48, 128, 128, 23, 48
    x = inputs(1, n, h, dk, dv)
    anc = random_anc(1, n)
    want = ref.gdn_block(*x, anc)
    for name, a, b in zip(("o", "v_new", "gamma"), gdn.gdn_tree(*x, anc), want):
        assert rel(a, b) < 2e-3, name
    for a, b in zip(gdn.gdn_chunked(*inputs(2, 150, h, dk, dv)), ref.gdn_chunked(*inputs(2, 150, h, dk, dv))):
        assert rel(a, b) < 2e-3
    _, v_new, gamma = want
    ssm = jax.random.normal(jax.random.key(3), (layers, h, dk, dv))
    path, leaf = anc[9], jnp.int32(9)
    expect = jax.vmap(lambda s: ref.gdn_path_state(x[1], v_new, gamma, s, path, leaf))(ssm)
    stack = lambda a: jnp.broadcast_to(a, (layers,) + a.shape)  # noqa: E731
    assert rel(gdn.gdn_commit(ssm, stack(x[1]), stack(v_new), stack(gamma), path, leaf), expect) < 2e-3
