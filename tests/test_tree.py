"""DDTree builder: the public reference's trees exactly (paper style), properties of the chain-seeded variant."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout
from jax.sharding import SingleDeviceSharding

from dflash_jax.engine.tree import accept, build_tree, chain_tree, top_log_probs
from dflash_jax.models.target import tree_block

from conftest import FIXTURES

build = jax.jit(build_tree, static_argnums=(2, 3, 4))


def cases():
    z = np.load(FIXTURES / "ddtree_cases.npz")
    return [{k[len(f"c{i}_"):]: z[k] for k in z if k.startswith(f"c{i}_")} for i in range(len(z.files) // 6)]


@pytest.mark.parametrize("case", cases(), ids=lambda c: f"L{c['logits'].shape[0]}-V{c['logits'].shape[1]}-B{c['budget']}")
def test_paper_style_tree_equals_reference(case):
    budget, logits = int(case["budget"]), case["logits"]
    tree = build(jnp.int32(7), jnp.asarray(logits), budget, min(budget, logits.shape[1]), False)
    n = len(case["tokens"])
    assert int(tree.valid.sum()) == n + 1
    np.testing.assert_array_equal(np.asarray(tree.tokens)[1:n + 1], case["tokens"])
    np.testing.assert_array_equal(np.asarray(tree.depths)[1:n + 1], case["depths"])
    np.testing.assert_array_equal(np.asarray(tree.parents)[:n + 1], case["parents"])
    np.testing.assert_array_equal(np.asarray(tree_block(tree.parents[:n + 1]).anc), case["visibility"])


def test_reference_cases_are_present():
    assert len(cases()) >= 6, "ddtree_cases.npz has fewer cases than the fixture README lists"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget, topk", [(4, 2), (22, 8), (40, 8), (63, 4)])
def test_chain_seeded_tree_properties(seed, budget, topk):
    rng = np.random.default_rng(seed)
    depth_limit, vocab = 7, 50
    logits = rng.normal(0.0, 2.0, (depth_limit, vocab)).astype(np.float32)
    tree = jax.tree.map(np.asarray, build(jnp.int32(3), jnp.asarray(logits), budget, topk, True))
    lp, ids = map(np.asarray, top_log_probs(jnp.asarray(logits), topk))
    spine = min(depth_limit, budget)
    assert tree.tokens[0] == 3 and tree.parents[0] == -1 and tree.valid.all()
    # the top-1 spine comes first, as nodes 1..spine
    np.testing.assert_array_equal(tree.tokens[1:spine + 1], ids[:spine, 0])
    np.testing.assert_array_equal(tree.parents[1:spine + 1], np.arange(spine))
    for i in range(1, budget + 1):
        p = tree.parents[i]
        assert 0 <= p < i  # parent before child
        assert tree.depths[i] == tree.depths[p] + 1 <= depth_limit
        # the node's log-weight is its parent's plus the log-prob of its token at its depth
        row = tree.depths[i] - 1
        rank = list(ids[row]).index(tree.tokens[i])
        np.testing.assert_allclose(tree.logw[i], tree.logw[p] + lp[row, rank], rtol=1e-5, atol=1e-5)
    # children of one parent have distinct tokens
    pairs = {(int(tree.parents[i]), int(tree.tokens[i])) for i in range(1, budget + 1)}
    assert len(pairs) == budget
    # the extras come best-first: joint log-probability never increases in insertion order
    extras = tree.logw[spine + 1:]
    assert np.all(np.diff(extras) <= 1e-6)
    # and no tree node left out is better than the worst extra: every frontier candidate is at most the last pop
    if len(extras):
        in_tree = {(int(tree.parents[i]), int(tree.tokens[i])): i for i in range(budget + 1)}
        for i in range(budget + 1):
            d = tree.depths[i]
            if d < depth_limit:
                for r in range(topk):
                    if (i, int(ids[d, r])) not in in_tree:
                        assert tree.logw[i] + lp[d, r] <= extras[-1] + 1e-5
                        break


def test_top_log_probs_of_a_column_major_operand():
    """Logits held column-major (as the Mosaic head's transposed product leaves them) give the same top-k: XLA's GPU
    top-k kernel reads a row-major operand whatever the layout, so top_log_probs pins it (run on a GPU too)."""
    logits = np.random.default_rng(0).normal(0.0, 2.0, (15, 5003)).astype(np.float32)
    column_major = Format(Layout((1, 0)), SingleDeviceSharding(jax.devices()[0]))
    lp, ids = jax.jit(lambda x: top_log_probs(x, 8), in_shardings=column_major)(jax.device_put(logits, column_major))
    want = np.argsort(-logits, axis=1, kind="stable")[:, :8]
    np.testing.assert_array_equal(np.asarray(ids), want)
    norm = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(lp), np.take_along_axis(norm, want, 1), rtol=1e-5, atol=1e-5)


def test_budget_larger_than_the_tree_marks_unfilled_nodes_invalid():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32))
    tree = build(jnp.int32(0), logits, 20, 3, False)  # at most 3 + 9 = 12 nodes exist
    assert int(tree.valid.sum()) == 13


def test_accept_walks_the_target_choice_and_cuts():
    tree = chain_tree(jnp.int32(5), jax.nn.one_hot(jnp.array([1, 2, 3]), 8))  # root 5, then 1, 2, 3
    anc = tree_block(tree.parents).anc
    post = jnp.array([1, 2, 9, 0], jnp.int32)  # target agrees with 1 and 2, not 3
    none = jnp.full(8, -1, jnp.int32)
    assert int(accept(tree, anc, post, jnp.int32(10), none)) == 2
    assert int(accept(tree, anc, post, jnp.int32(1), none)) == 1  # n_gen cut
    stop_at_1 = none.at[0].set(1)
    assert int(accept(tree, anc, post, jnp.int32(10), stop_at_1)) == 1  # nothing accepted after a stop token


@pytest.mark.parametrize("budget, seeded", [(4, False), (7, False), (8, True), (22, True)])
def test_the_default_seeds_the_chain_only_past_the_draft_depth(budget, seeded):
    """EngineConfig's chain_seed None: within the draft's depth a seeded tree would be the top-1 chain alone, so the
    paper's builder is used there; past it, the C++ engine's seeded builder."""
    from dflash_jax.config import EngineConfig
    from dflash_jax.engine.step import step_tree

    depth = min(7, budget)
    logits = jnp.asarray(np.random.default_rng(1).normal(0.0, 1.0, (depth, 50)).astype(np.float32))
    ecfg = EngineConfig(budget=budget, topk=4)
    assert ecfg.seeds_chain(depth) == seeded
    assert EngineConfig(budget=budget, chain_seed=not seeded).seeds_chain(depth) == (not seeded)  # explicit wins
    got = jax.tree.map(np.asarray, step_tree(ecfg, jnp.int32(3), logits))
    want = jax.tree.map(np.asarray, build(jnp.int32(3), logits, budget, 4, seeded))
    jax.tree.map(np.testing.assert_array_equal, got, want)
    if budget <= depth:  # a tree with branches, where the seeded builder would give the chain 0-1-2-...
        assert not np.array_equal(got.parents[1:], np.arange(budget))
