"""(-m gpu) The Mosaic GPU kernels inside the target: a random 4-layer target of the 27B's widths in the Q4_K_M types
(Q6_K in the output head and, in layers 2 and 3, attn_qkv, attn_v and ffn_down), with every Q4_K and Q6_K product
on the Mosaic kernels (the layout alone, as `generate` runs a tree) against the same weights on the Triton kernels:
each matrix at 1, 16 and 23 tokens, a prefill and a 23-node tree verify, the drafter's proposals, DDTree decoding with
an oracle drafter, and a tree built from logits through the head."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import FULL_ATTENTION, LINEAR_ATTENTION, KernelConfig, load_draft_config, load_target_config
from dflash_jax.engine.generate import Engine, EngineConfig
from dflash_jax.engine.step import DFlashDrafter, step_tree
from dflash_jax.models import target as T
from dflash_jax.models.target import init_state
from dflash_jax.testing import synthetic
from dflash_jax.testing.oracle import OracleDrafter, oracle_logits
from pallas_kernels import qmatmul as qm

pytestmark = pytest.mark.gpu

CFG = dataclasses.replace(load_target_config(synthetic.TARGET_27B), num_layers=4,
                          layer_types=(LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,))
FORMATS = ("Q4_K", "Q6_K")
# the products as `generate` resolves a tree on Hopper, the attention on Triton (Hopper's default is Mosaic: `attn`)
MOSAIC = KernelConfig(impl="pallas", mgpu="only")
TRITON = KernelConfig(impl="pallas")


def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.fixture(scope="module")
def targets():
    """(Mosaic, Triton) targets' parameters over the same random weights."""
    return tuple(synthetic.synthetic_target(CFG, kcfg=kcfg) for kcfg in (MOSAIC, TRITON))


def _weights(params):
    is_weight = lambda x: isinstance(x, qm.PackedWeight)  # noqa: E731
    return jax.tree_util.tree_flatten_with_path(params, is_leaf=is_weight)[0]


@pytest.mark.parametrize("m", [1, 16, 23])
def test_every_matrix_on_its_kernel(targets, m):
    """Each weight's Mosaic product against its kernel's reference, at M = 1 (decode), 16 (the drafter's block
    through the head), 23 (a DDTree-22 verify)."""
    mosaic, _ = targets
    weights = [(jax.tree_util.keystr(path), w) for path, w in _weights(mosaic) if isinstance(w, qm.PackedWeight)]
    assert {w.fmt for _, w in weights if w.mgpu_only} == set(FORMATS)
    bad = []
    for name, w in weights:
        if w.mgpu_only:
            x = jax.random.normal(jax.random.key(m), (m, w.shape[1]), jnp.float32)
            err = rel(qm.qmatmul(x, w), qm.MGPU_MODULES[w.fmt].reference(x, w.mgpu))
            if not err < 1e-4:
                bad.append(f"{name} {w.fmt} {w.shape}: {err:.2e}")
    assert not bad, bad


def prefill_and_verify(params, kcfg: KernelConfig, seed: int, kv_type: str = "f32") -> tuple[jax.Array, jax.Array]:
    """The logits of a random 64-token prefill, then of a random 23-node tree over it."""
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(0, CFG.vocab_size, 64), jnp.int32)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, 23), jnp.int32)
    parents = jnp.asarray([-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, 23)], jnp.int32)
    prefill = jax.jit(T.prefill_chunk, static_argnums=(1,), static_argnames=("all_logits", "kcfg"))
    verify = jax.jit(T.verify, static_argnums=(1, 5, 6))
    logits, _, state = prefill(params, CFG, init_state(CFG, 128, kv_type), prompt, jnp.int32(64), all_logits=True,
                               kcfg=kcfg)
    return logits, verify(params, CFG, state, tokens, parents, (), kcfg)[0]


def test_prefill_and_tree_verify(targets):
    """Logits of a 64-token prefill, then of a 23-node tree, as on the Triton kernels (the same weights)."""
    (prefill_m, verify_m), (prefill_t, verify_t) = (prefill_and_verify(params, kcfg, 0)
                                                    for params, kcfg in zip(targets, (MOSAIC, TRITON)))
    for got, want in ((prefill_m, prefill_t), (verify_m, verify_t)):
        errs = jnp.linalg.norm(got - want, axis=1) / jnp.linalg.norm(want, axis=1)
        assert float(errs.max()) < 2e-2, np.asarray(errs)


def test_drafter_proposals_through_the_head(targets):
    """The drafter's logits for a DDTree's 15 depths, read out through the target's Q6_K head on each kernel."""
    cfg = dataclasses.replace(load_draft_config(synthetic.DRAFT_27B), num_layers=1, layer_types=(FULL_ATTENTION,))
    drafter = DFlashDrafter(cfg, TRITON)  # its bf16 matrices on XLA: the same product under either target's layout
    params = synthetic.synthetic_draft(cfg, kcfg=TRITON)
    taps = jax.random.normal(jax.random.key(1), (64, len(cfg.target_layer_ids), cfg.hidden_size), jnp.float32)
    state = jax.jit(drafter.extend)(params, drafter.init_state(128, ("f32", "f32"), None), taps, jnp.int32(64))
    propose = jax.jit(drafter.propose, static_argnums=(5,))
    mosaic, triton = (propose(params, state, t, jnp.int32(7), jnp.int32(64), 15) for t in targets)
    assert bool(jnp.all(jnp.isfinite(mosaic)))
    errs = jnp.linalg.norm(mosaic - triton, axis=1) / jnp.linalg.norm(triton, axis=1)
    assert float(errs.max()) < 2e-2, np.asarray(errs)


@pytest.mark.parametrize("kernels", ["mosaic", "triton"])
def test_ddtree_accepts_the_ar_continuation(targets, kernels):
    """DDTree-22 with an oracle drafter proposing the AR continuation without errors: the same first tokens, most of
    each tree's path accepted (a verify row disagreeing with the committed decode would accept its root alone). The
    random weights' logits are nearly tied, so AR's one-token kernel (x in int8) and the verify's tiles may part ways
    later: on an H100 the Triton tiles did at token 13 of one draw."""
    params, kcfg = targets[kernels == "triton"], (MOSAIC, TRITON)[kernels == "triton"]
    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, 40)
    greedy = Engine(CFG, params, EngineConfig(mode="ar", max_ctx=160), kcfg=kcfg).generate(ids, 48).tokens
    sequence = np.zeros(160, np.int32)
    sequence[:len(ids) + len(greedy)] = np.concatenate([ids, greedy])
    tree = Engine(CFG, params, EngineConfig(mode="ddtree", budget=22, max_ctx=160),
                  OracleDrafter(16, CFG.vocab_size, 0.0, seed=1), {"sequence": jnp.asarray(sequence)}, kcfg=kcfg)
    gen = tree.generate(ids, 48)
    assert gen.tokens[:8] == greedy[:8] and gen.mean_accept_length > 4, (gen.tokens, greedy,
                                                                            gen.mean_accept_length)


@pytest.mark.parametrize("kernels", ["mosaic", "triton"])
def test_draft_tree_through_the_head(targets, kernels):
    """A DDTree built in one jit from forced logits plus 1e-3 x the head's product (ForcedDrafter's sum) puts the
    raised tokens on its top-1 chain."""
    head = targets[kernels == "triton"].lm_head.weight.get_value()
    ecfg = EngineConfig(mode="ddtree", budget=22, max_ctx=256)
    seq = jnp.asarray(np.random.default_rng(5).integers(0, CFG.vocab_size, 320), jnp.int32)
    forced = lambda s: oracle_logits(s, jnp.int32(64), 15, CFG.vocab_size, jnp.float32(0), 0)  # noqa: E731
    x = jax.random.normal(jax.random.key(1), (15, CFG.hidden_size), jnp.float32)
    got = jax.jit(lambda x, w, s: step_tree(ecfg, jnp.int32(7), forced(s) + 1e-3 * qm.qmatmul(x, w)).tokens)(x, head,
                                                                                                            seq)
    # nodes 1-15, the top-1 chain (chain_seed); later nodes are siblings of near-equal noise, in either order
    np.testing.assert_array_equal(np.asarray(got)[1:16], np.asarray(seq[65:80]))


def test_mosaic_tree_attention_in_the_target(targets):
    """bf16 caches with the tree attention on Mosaic GPU (mgpu_attention): a 64-token prefill's and a 23-node tree's
    logits as with the Triton attention, and DDTree-22 decoding with an oracle drafter follows AR on it (as in
    test_ddtree_accepts_the_ar_continuation)."""
    attn = dataclasses.replace(MOSAIC, mgpu_attention=True)
    for got, want in zip(*(prefill_and_verify(targets[0], kcfg, 2, "bf16") for kcfg in (attn, MOSAIC))):
        errs = jnp.linalg.norm(got - want, axis=1) / jnp.linalg.norm(want, axis=1)
        assert float(errs.max()) < 1e-2, np.asarray(errs)
    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, 40)
    greedy = Engine(CFG, targets[0], EngineConfig(mode="ar", max_ctx=160, kv_type="bf16"), kcfg=attn).generate(
        ids, 48).tokens
    sequence = np.zeros(160, np.int32)
    sequence[:len(ids) + len(greedy)] = np.concatenate([ids, greedy])
    tree = Engine(CFG, targets[0], EngineConfig(mode="ddtree", budget=22, max_ctx=160, kv_type="bf16"),
                  OracleDrafter(16, CFG.vocab_size, 0.0, seed=1), {"sequence": jnp.asarray(sequence)}, kcfg=attn)
    gen = tree.generate(ids, 48)
    assert gen.tokens[:8] == greedy[:8] and gen.mean_accept_length > 4, (gen.tokens, greedy, gen.mean_accept_length)
