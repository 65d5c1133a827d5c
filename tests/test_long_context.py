"""Contexts past 2^16 tokens (issue 43, item 3): RoPE angles at position 262,143 and attention over caches of more
than 65,536 slots, the Pallas kernel's split over the KV length included, against float64 numpy references. Tiny
heads keep it fast on a CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.models.layers import rope, rope_turns
from pallas_kernels import reference as ref
from pallas_kernels.tree_attention import tree_attention

ON_GPU = jax.default_backend() == "gpu"
POSITIONS = np.array([0, 1, 4095, 4096, 65535, 65536, 65537, 131071, 200003, 262143, 262144, 2**24 + 3, 2**31 - 1])


def rope64(x: np.ndarray, pos: np.ndarray, rope_dim: int, theta: float) -> np.ndarray:
    """NeoX RoPE in float64."""
    half = rope_dim // 2
    angle = pos.astype(np.float64)[:, None] * (1.0 / theta ** (np.arange(0, rope_dim, 2) / rope_dim))
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
    x = x.astype(np.float64)
    x1, x2 = x[..., :half], x[..., half:rope_dim]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rope_dim:]], axis=-1)


@pytest.mark.parametrize("rope_dim,head_dim,theta", [(64, 64, 1e7), (16, 32, 1e6), (32, 32, 1e4)])
def test_rope_far_positions_match_float64(rope_dim, head_dim, theta):
    """A float32 pos * inv_freq is off by 4.6e-3 here at 262,143 (half an ulp of the angle); the angle is exact."""
    x = np.random.default_rng(rope_dim).standard_normal((len(POSITIONS), 2, head_dim)).astype(np.float32)
    got = np.asarray(rope(jnp.asarray(x), jnp.asarray(POSITIONS, jnp.int32), rope_dim, theta))
    np.testing.assert_allclose(got, rope64(x, POSITIONS, rope_dim, theta), rtol=0, atol=5e-6)


def test_rope_turns_are_reduced_angles():
    """Turns are pos * inv_freq / 2pi mod 1 in [-0.5, 0.5], within a few float32 ulps of 1."""
    turns = np.asarray(rope_turns(jnp.asarray(POSITIONS, jnp.int32), 64, 1e7))
    exact = POSITIONS.astype(np.float64)[:, None] * (1.0 / 1e7 ** (np.arange(0, 64, 2) / 64)) / (2 * np.pi)
    err = turns - (exact - np.round(exact))
    assert np.all(np.abs(turns) <= 0.5)
    assert np.max(np.abs(err - np.round(err))) < 1e-6


def test_rope_relative_position_far_out():
    """Scores depend on the distance only: a query and key 7 apart score the same at 10 and past 2^18."""
    rng = np.random.default_rng(1)
    q, k = (jnp.asarray(rng.standard_normal((1, 1, 64)), jnp.float32) for _ in range(2))

    def score(p):
        return float(jnp.sum(rope(q, jnp.array([p + 7]), 64, 1e7) * rope(k, jnp.array([p]), 64, 1e7)))

    assert score(262136) == pytest.approx(score(10), abs=2e-5)


SLOTS = 70_001  # past 2^16, not a multiple of the kernel's key block (64)
HEADS, KV_HEADS, D = 2, 1, 16
MARKED = (65_535, 65_536, 65_537, 69_000, 70_000)  # slots whose keys the queries match


def long_cache(seed: int = 0):
    """Caches [SLOTS, 1, 16] of small random keys, but for keys along the one query direction at the MARKED slots,
    scoring 8 apart (so the best one a query sees carries its output) and in no order of slot, so that both the
    length and a window's first slot decide which one that is; the marked values are 4, 5, ... ."""
    rng = np.random.default_rng(seed)
    k = (0.1 * rng.standard_normal((SLOTS, KV_HEADS, D))).astype(np.float32)
    v = rng.standard_normal((SLOTS, KV_HEADS, D)).astype(np.float32)
    u = rng.standard_normal(D)
    u = 4.0 * u / np.linalg.norm(u)  # |u|^2 = 16 = d: a score of c for a key c u / 4
    q = np.broadcast_to(u, (3, HEADS, D)).astype(np.float32)
    for j, (s, c) in enumerate(zip(MARKED, (8, 40, 24, 32, 16))):
        k[s, 0] = c * u / 4.0
        v[s, 0] = 4.0 + j
    kb = (0.1 * rng.standard_normal((3, KV_HEADS, D))).astype(np.float32)
    vb = rng.standard_normal((3, KV_HEADS, D)).astype(np.float32)
    return q, k, v, kb, vb


def attention64(q, k, v, length, kb, vb, blk, lo):
    """Float64 numpy tree attention: query i sees slots lo[i] <= s < length and block keys where blk[i]."""
    n, hq, d = q.shape
    out = np.zeros((n, hq, d))
    slot = np.arange(k.shape[0])
    for i in range(n):
        seen = (slot >= lo[i]) & (slot < length)
        keys = np.concatenate([k[seen], kb[blk[i]]]).astype(np.float64)
        vals = np.concatenate([v[seen], vb[blk[i]]]).astype(np.float64)
        for h in range(hq):
            s = keys[:, h * KV_HEADS // hq] @ q[i, h].astype(np.float64) / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, h] = p @ vals[:, h * KV_HEADS // hq] / p.sum()
    return out


# (length, prefix_lo per query): a length past 2^16 that is no multiple of any split's chunk; one that ends between
# marked slots; the whole cache; windows that start past 2^16 (the drafter's sliding layers)
LENGTHS = [(65_537, (0, 0, 0)), (69_999, (0, 65_536, 65_537)), (SLOTS, (0, 65_000, 69_001))]


@pytest.mark.parametrize("length,lo", LENGTHS)
def test_reference_attention_past_2_16(length, lo):
    q, k, v, kb, vb = long_cache()
    blk = np.tril(np.ones((3, 3), bool))
    args = (q, k, v, length, kb, vb, blk, np.array(lo, np.int32))
    got = ref.tree_attention(*map(jnp.asarray, args))
    want = attention64(*args)
    assert np.all(want > 3.9)  # a marked slot carries every output
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("splits", [7, 32])
def test_kernel_split_past_2_16(splits):
    """The kernel's split over the KV length (interpret mode): chunks of cdiv(length, splits) rounded up to the key
    block, a last block read ending at the cache's end, lengths and window starts past 2^16."""
    q, k, v, kb, vb = long_cache(splits)
    blk = np.tril(np.ones((3, 3), bool))
    run = jax.jit(lambda length, lo: tree_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), length,
                                                    jnp.asarray(kb), jnp.asarray(vb), jnp.asarray(blk), lo,
                                                    splits=splits, block_rows=16, interpret=not ON_GPU))
    for length, lo in LENGTHS:
        lo = np.array(lo, np.int32)
        got = np.asarray(run(jnp.int32(length), jnp.asarray(lo)))
        want = attention64(q, k, v, length, kb, vb, blk, lo)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-2)  # q and k in bf16
