"""Synthetic full-size models (testing/synthetic.py) at tiny sizes, and the forced drafter the benchmark uses."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import EngineConfig
from dflash_jax.engine.generate import Engine
from dflash_jax.engine.step import DFlashDrafter
from dflash_jax.gguf import tensor_specs
from dflash_jax.profiling import CompileLog
from dflash_jax.quant import dequantize
from dflash_jax.testing import synthetic
from dflash_jax.testing.gguf_writer import q4_k_m_rule
from dflash_jax.testing.oracle import ForcedDrafter
from dflash_jax.testing.tiny import tiny_draft_config, tiny_target_config

CFG = tiny_target_config(num_layers=4, vocab_size=512)


@pytest.fixture(scope="module")
def pair():
    stored = {}
    target = synthetic.synthetic_target(CFG, on_tensor=lambda n, b: stored.__setitem__(n, b))
    draft = synthetic.synthetic_draft(tiny_draft_config(CFG, block_size=8))
    return target, draft, stored


def test_every_tensor_has_its_shape_and_stock_q4_k_m_type(pair):
    _, _, stored = pair
    rule = q4_k_m_rule(CFG)
    specs = {n: s for n, s in tensor_specs(CFG).items() if not s.optional}
    assert set(stored) == set(specs)
    for name, spec in specs.items():
        if spec.kind == "dense":
            assert stored[name] == 4 * int(np.prod(spec.shape)), name
        else:
            block, type_bytes = gguf.GGML_QUANT_SIZES[rule(name, spec)]
            assert stored[name] == int(np.prod(spec.shape)) * type_bytes // block, name  # the rule's type, exactly


@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K", "Q8_0"])
def test_random_matrices_have_entries_of_about_one_over_sqrt_in(fmt):
    for k in (256, 1024):
        w = dequantize(synthetic.random_matrix(jax.random.key(3), fmt, (256, k)))
        assert bool(jnp.all(jnp.isfinite(w)))
        assert abs(float(jnp.std(w)) * np.sqrt(k) - 1.0) < 0.25, (fmt, k)


def test_the_synthetic_pair_decodes_and_is_seeded(pair):
    target, draft, _ = pair
    norms = [layer.input_layernorm.weight.get_value() for layer in target.layers]
    assert all(bool(jnp.all(jnp.abs(n - 1.0) < 1.0)) for n in norms)
    assert all(bool(jnp.all(layer.linear_attn.A.get_value() < 0)) for layer in target.layers
               if hasattr(layer, "linear_attn"))
    ecfg = EngineConfig(mode="ar", max_ctx=128)
    ar = Engine.from_loaded(target, None, ecfg).generate(list(range(1, 20)), 12)
    again = synthetic.synthetic_target(CFG)
    assert Engine.from_loaded(again, None, ecfg).generate(list(range(1, 20)), 12).tokens == ar.tokens
    other = synthetic.synthetic_target(CFG, seed=5)
    assert Engine.from_loaded(other, None, ecfg).generate(list(range(1, 20)), 12).tokens != ar.tokens
    tree = Engine.from_loaded(target, draft, EngineConfig(mode="ddtree", budget=6, max_ctx=128))
    assert tree.generate(list(range(1, 20)), 12).tokens == ar.tokens  # lossless with a random drafter too


def test_forced_drafter_sets_the_acceptance_without_recompiling(pair):
    target, draft, _ = pair
    prompt, n_gen = list(range(3, 40)), 40
    ar = Engine.from_loaded(target, None, EngineConfig(mode="ar", max_ctx=128)).generate(prompt, n_gen)
    real = DFlashDrafter(draft.config, target.kcfg.drafter)
    ecfg = EngineConfig(mode="ddtree", budget=10, topk=4, max_ctx=128)
    engine = Engine(target.config, target, ecfg, ForcedDrafter(real, CFG.vocab_size), None)
    sequence = np.zeros(192, np.int32)
    sequence[len(prompt):len(prompt) + n_gen] = ar.tokens  # the first generated token sits at len(prompt)

    def run(rate):
        engine.dparams = {"real": draft, "sequence": jnp.asarray(sequence), "error_rate": jnp.float32(rate)}
        return engine.generate(prompt, n_gen)

    perfect = run(0.0)
    with CompileLog() as log:
        rows = [run(rate) for rate in (0.2, 0.5)]
    assert perfect.tokens == ar.tokens and all(g.tokens == ar.tokens for g in rows)
    width = engine.width  # depth min(block - 1, budget) + the bonus
    assert perfect.accept_lengths[:-1] == [width] * (len(perfect.accept_lengths) - 1)
    assert width > rows[0].mean_accept_length > rows[1].mean_accept_length > 1.0
    assert not [r for r in log.rows() if "_step" in r["name"]]  # the error rate is an argument, not a constant
