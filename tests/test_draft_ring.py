"""The drafter's context cache in rings (models/draft.py): each position of a window at both of its slots, across the
ring's end and from chunks longer than the ring; the drafter's logits through a ring equal a linear cache's with the
same window; a rewind shows the drafter only what the ring still holds while the emitted tokens stay a fresh run's;
snapshots of a ring restore bit for bit, page only the ring's slots and keep its start."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import EngineConfig, KernelConfig
from dflash_jax.engine.generate import Engine
from dflash_jax.engine.state import PAGE, rewind
from dflash_jax.engine.step import DFlashDrafter
from dflash_jax.models import draft as D
from dflash_jax.testing.tiny import random_draft, tiny_draft_config
from test_engine import TCFG, tparams  # noqa: F401 (fixture)

# two sliding layers around a full one: the groups' layers are not contiguous
DCFG = tiny_draft_config(TCFG, ("sliding_attention", "full_attention", "sliding_attention"), block_size=8,
                         sliding_window=6, taps=(0, 2))
SLOTS, CONTEXT = 64, 8  # a ring of 8 for the full layer (16 slots), of 6 for the sliding ones (12 slots)
MAX_CTX = 320  # two snapshot pages

extend = jax.jit(D.extend_context, static_argnums=(1,))
propose = jax.jit(D.propose, static_argnums=(1,), static_argnames=("kcfg",))


@pytest.fixture(scope="module")
def dparams():
    return random_draft(DCFG, seed=3)


def linear(state: D.DraftState, slots: int = SLOTS) -> D.DraftState:
    """The same groups, windows and KV types, stored linearly (position p at slot p) in `slots` slots."""
    grow = lambda c: jax.tree.map(lambda x: jnp.zeros((x.shape[0], slots, *x.shape[2:]), x.dtype), c)  # noqa: E731
    return dataclasses.replace(state, k=tuple(map(grow, state.k)), v=tuple(map(grow, state.v)),
                               rings=(False,) * len(state.k))


def taps(n: int, seed: int) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (n, len(DCFG.target_layer_ids), DCFG.hidden_size))


# chunks (rows, valid rows): to 5, across both rings' ends, one longer than either ring, a padded one
CHUNKS = [(5, 5), (6, 6), (20, 20), (8, 3)]


def filled(state: D.DraftState, dparams, upto: int) -> D.DraftState:
    for i, (n, valid) in enumerate(CHUNKS[:upto]):
        state = extend(dparams, DCFG, state, taps(n, i), jnp.int32(valid))
    return state


def test_the_groups_and_their_rings():
    assert D.cache_groups(DCFG) == ((1,), (0, 2))
    state = D.init_draft_state(DCFG, SLOTS, context=CONTEXT)
    assert state.windows == (CONTEXT, 6) and state.rings == (True, True)
    assert [c.shape[:2] for c in state.k] == [(1, 2 * CONTEXT), (2, 12)]
    # a window of at least half the slots is kept linearly (a ring would take as many slots or more)
    assert D.init_draft_state(DCFG, 12, context=CONTEXT).rings == (False, False)
    assert D.init_draft_state(DCFG, SLOTS).windows == (None, 6)
    typed = D.init_draft_state(DCFG, SLOTS, ("q8_0", "f16"))
    assert [c.kind for c in typed.k] == ["q8_0"] * 2 and [c.dtype for c in typed.v] == [jnp.float16] * 2


@pytest.mark.parametrize("kv_types", [("f32", "f32"), ("q8_0", "rq3_0")])
def test_a_ring_holds_each_position_of_its_window_at_both_of_its_slots(dparams, kv_types):
    """After each chunk (one crossing the rings' ends, one longer than the rings, one whose last rows are padding
    that must not be written), both slots of every position in a group's window hold that position's keys and
    values, as a linear cache holds them (in a block type, every field of its blocks)."""
    ring = D.init_draft_state(DCFG, SLOTS, kv_types, context=CONTEXT)
    flat = linear(ring)
    for i, (n, valid) in enumerate(CHUNKS):
        ring = extend(dparams, DCFG, ring, taps(n, i), jnp.int32(valid))
        flat = extend(dparams, DCFG, flat, taps(n, i), jnp.int32(valid))
        length = int(ring.length)
        for g, w in enumerate(ring.windows):
            for p in range(max(0, length - w), length):
                for got, want in ((ring.k[g], flat.k[g]), (ring.v[g], flat.v[g])):
                    for slot in (p % w, p % w + w):
                        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[:, slot], b[:, p]), got, want)
    assert int(ring.length) == 34


@pytest.mark.parametrize("upto", [1, 2, 4])  # 5 committed (within both rings), 11 (past the sliding ring), 34
def test_the_drafter_sees_through_a_ring_what_a_linear_cache_with_its_window_shows(tparams, dparams, upto):
    """propose's logits through the rings equal those through a linear cache with the same windows; within the
    full layer's window they equal the whole context's, past it they differ (the bound is in the path)."""
    ring = filled(D.init_draft_state(DCFG, SLOTS, context=CONTEXT), dparams, upto)
    same = filled(linear(D.init_draft_state(DCFG, SLOTS, context=CONTEXT)), dparams, upto)
    whole = filled(linear(D.init_draft_state(DCFG, SLOTS)), dparams, upto)
    logits = {name: np.asarray(propose(dparams, DCFG, s, tparams, jnp.int32(3))[1])
              for name, s in (("ring", ring), ("same", same), ("whole", whole))}
    np.testing.assert_allclose(logits["ring"], logits["same"], rtol=1e-5, atol=1e-5)
    if int(ring.length) <= CONTEXT:
        np.testing.assert_allclose(logits["ring"], logits["whole"], rtol=1e-5, atol=1e-5)
    else:
        assert np.abs(logits["ring"] - logits["whole"]).max() > 1e-2


@pytest.mark.parametrize("kv_types", [("f32", "f32"), ("q8_0", "q8_0")])
def test_the_interpret_kernel_reads_a_ring_as_the_reference_does(tparams, dparams, kv_types):
    """The Pallas attention (interpret mode) over the rings' slots, in a float and a block type: the reference path's
    logits, to its bf16 products. (A 4-bit type moves further, 2 %: each layer quantizes the block's own rows anew,
    and the products' small difference in a layer's input moves some of their codes a whole step.)"""
    ring = filled(D.init_draft_state(DCFG, SLOTS, kv_types, context=CONTEXT), dparams, 4)
    ref = np.asarray(propose(dparams, DCFG, ring, tparams, jnp.int32(3))[1])
    got = np.asarray(propose(dparams, DCFG, ring, tparams, jnp.int32(3),
                             kcfg=KernelConfig(impl="pallas", interpret=True))[1])
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2


@pytest.fixture(scope="module")
def engines(tparams, dparams):
    """A DDTree engine whose drafter keeps rings (its full layer the last 32 tokens), and AR."""
    ddtree = Engine(TCFG, tparams, EngineConfig(mode="ddtree", budget=8, topk=4, max_ctx=MAX_CTX, draft_ctx=32),
                    DFlashDrafter(DCFG), dparams)
    return ddtree, Engine(TCFG, tparams, EngineConfig(mode="ar", max_ctx=MAX_CTX))


def ids_of(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, TCFG.vocab_size, n)


@pytest.mark.parametrize("at", [96, 40])  # back within the full layer's window (it keeps 13 of its 32), past it
def test_a_rewound_ring_shows_only_what_it_still_holds_and_the_tokens_stay_a_fresh_runs(tparams, dparams, engines,
                                                                                          at):
    """After a rewind the rings' starts move to the first position of their windows before it (positions from there
    on were overwritten), no further than the mark: the drafter then proposes what a fresh state of the same context
    proposes when shown only those positions, and the decoding goes on to emit what a fresh run emits."""
    engine, ar = engines
    first = ids_of(1, 100)
    turn1 = engine.generate(first, 10, mark_at=at)
    length = int(turn1.state.target.length)
    state = rewind(turn1.state, turn1.mark)
    want = [min(at, max(0, length - w)) for w in state.draft.windows]
    assert state.draft.start.tolist() == want and int(state.draft.length) == at
    fresh = engine.start(first[:at], 1)[0].draft
    shown = dataclasses.replace(fresh, start=jnp.asarray(want, jnp.int32))
    logits = lambda d: np.asarray(propose(dparams, DCFG, d, tparams, jnp.int32(5))[1])  # noqa: E731
    np.testing.assert_allclose(logits(state.draft), logits(shown), rtol=1e-4, atol=1e-4)
    assert np.abs(logits(shown) - logits(fresh)).max() > 1e-2  # the hidden positions matter
    ids = np.concatenate([first[:at], ids_of(2, 12)])
    token_state, token = engine.start(ids[at:], 16, after=state, keep_pending=False)
    assert engine.decode(token_state, token, 16).tokens == ar.generate(ids, 16).tokens


def held(state) -> dict:
    """What a later step reads of a state: the target's slots below the length, each drafter cache's below the length
    and its size, the lengths and the rings' starts."""
    t, d, n = state.target, state.draft, int(state.target.length)
    out = dict(k=t.k[:, :n], v=t.v[:, :n], conv=t.conv, ssm=t.ssm, length=t.length, dlength=d.length, start=d.start)
    out.update({f"d{name}{g}": c[:, :n] for name in "kv" for g, c in enumerate(getattr(d, name))})
    return {name: np.asarray(x) for name, x in out.items()}


def test_a_snapshot_of_rings_restores_them_and_pages_only_their_slots(engines):
    """A snapshot copies a ring's slots below its size only (the second page holds the target's rows alone),
    restores bit for bit, keeps a rewound ring's start, and a run from it emits what a fresh run emits."""
    engine, ar = engines
    ids = ids_of(3, 300)
    gen = engine.generate(ids, 8, snapshot_at=(100, 300), mark_at=100)
    short, long = gen.snapshots
    empty = engine.restore(short)
    target_row = sum(c.nbytes // c.shape[1] for c in (empty.target.k, empty.target.v))
    rings = sum(c.nbytes for c in empty.draft.k + empty.draft.v)  # each ring's slots, all in the first page
    assert all(c.shape[1] < PAGE for c in empty.draft.k)
    fixed = gen.mark.conv.nbytes + gen.mark.ssm.nbytes + 4 + empty.draft.start.nbytes
    assert short.nbytes == fixed + PAGE * target_row + rings
    assert long.nbytes == fixed + 2 * PAGE * target_row + rings
    got = held(engine.restore(long))
    for name, want in held(engine.generate(ids, 1, mark_at=100).state).items():  # prefilled in the same parts
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    rewound = rewind(gen.state, gen.mark)
    assert rewound.draft.start.tolist() != [0, 0]
    again = engine.restore(engine.snapshot(rewound))
    assert again.draft.start.tolist() == rewound.draft.start.tolist()
    tail = ids_of(4, 9)
    state, token = engine.start(tail, 8, after=engine.restore(long), keep_pending=False)
    assert engine.decode(state, token, 8).tokens == ar.generate(np.concatenate([ids, tail]), 8).tokens


def test_a_ring_is_written_in_place(tparams):
    """The context extension's compiled call aliases a ring state whole (both copies of each row go in by one scatter
    into the donated cache), with temporaries well below it."""
    from dflash_jax.engine.state import tree_bytes

    cfg = tiny_draft_config(TCFG, ("full_attention",) * 4, block_size=8, taps=(0, 2))
    cfg = dataclasses.replace(cfg, num_heads=4, num_kv_heads=4, head_dim=128)
    engine = Engine(TCFG, tparams, EngineConfig(mode="ddtree", max_ctx=8192, draft_ctx=1024), DFlashDrafter(cfg),
                    random_draft(cfg, seed=3))
    state = engine.drafter.init_state(8192, ("f32", "f32"), 1024)
    assert state.rings == (True,) and state.k[0].shape[1] == 2048
    memory = engine.extend.lower(engine.dweights, state, jnp.zeros((64, 2, cfg.hidden_size)),
                                 jnp.int32(64)).compile().memory_analysis()
    assert memory.alias_size_in_bytes == tree_bytes(state)
    assert memory.temp_size_in_bytes < 0.5 * tree_bytes(state), (memory.temp_size_in_bytes, tree_bytes(state))
