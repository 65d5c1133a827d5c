"""Training a target from scratch with the engine's own forward: the training logits are the prefill's, a short run
lowers the loss, and the trained tensors load back as the same model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.models.target import init_state, target_from_tensors
from dflash_jax.testing.tiny import tiny_target_config
from dflash_jax.training.data import batches
from dflash_jax.training.features import sequence_logits
from dflash_jax.training.loop import TrainConfig
from dflash_jax.training.target_lm import init_params, tensors_to_write, target_trainer, to_engine

CFG = tiny_target_config(num_layers=4, interval=2, vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_heads=2, num_kv_heads=1, head_dim=32, rope_dim=8, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_num_value_heads=4)


@pytest.mark.parametrize("tie", [False, True])
def test_training_logits_are_the_prefill_logits_and_tensors_round_trip(tie):
    """Tied: one trained matrix is both embedding and head, so what is written (no output.weight) is what trained."""
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tie)
    params = init_params(cfg, jax.random.key(0))
    a_logs = [layer["linear_attn"]["A"].get_value() for layer in params["layers"].values() if "linear_attn" in layer]
    assert a_logs and all(float(jnp.max(-jnp.exp(a_log))) < 0 for a_log in a_logs)
    assert ("lm_head" in params) != tie and ("output.weight" in tensors_to_write(params, cfg)) != tie
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, 128), jnp.int32)
    got = sequence_logits(to_engine(params, cfg), cfg, tokens)
    want = [logits for logits in _prefill_all(to_engine(params, cfg), tokens)]
    np.testing.assert_allclose(got, np.concatenate(want), rtol=1e-5, atol=1e-5)
    again = nnx.state(target_from_tensors(cfg, {k: jnp.asarray(v) for k, v in tensors_to_write(params, cfg).items()}))
    assert jax.tree.structure(again) == jax.tree.structure(nnx.state(to_engine(params, cfg)))
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(nnx.state(to_engine(params, cfg)))):
        np.testing.assert_array_equal(a, b)


def _prefill_all(params, tokens):
    from dflash_jax.engine.prefill import prefill_chunks

    for n, logits, _, _ in prefill_chunks(params, CFG, init_state(CFG, len(tokens)), tokens, all_logits=True):
        yield np.asarray(logits)


def test_a_short_run_lowers_the_loss():
    starts = np.random.default_rng(0).integers(0, 64, 48)
    # a learnable rule: each token is 5 times the previous one, mod 64
    data = np.stack([[(s * pow(5, i, 64)) % 64 for i in range(64)] for s in starts]).astype(np.int32)
    trainer = target_trainer(CFG, TrainConfig(steps=40, batch=8, seq_len=64, lr=1e-2))
    params, opt_state = trainer.init()
    before = trainer.evaluate(params, data[:8])["loss"]
    params, _ = trainer.run(params, opt_state, batches(data[8:], 8, 0), every=10, log=lambda _: None)
    after = trainer.evaluate(params, data[:8])["loss"]
    assert after < 0.7 * before, (before, after)
