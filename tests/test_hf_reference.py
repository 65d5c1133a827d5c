"""The target against HF transformers on random tiny configs, loaded from an HF directory and from a GGUF."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT

from dflash_jax.engine.prefill import prefill_chunks
from dflash_jax.load import load_target
from dflash_jax.models import target as T
from dflash_jax.models.target import init_state
from dflash_jax.testing.gguf_writer import uniform_rule, write_hf_as_gguf
from dflash_jax.testing.tiny import hf_reference_model, random_hf_state_dict, tiny_target_config, write_hf_dir

verify = jax.jit(T.verify, static_argnums=(1, 5))
commit = jax.jit(T.commit)
PROMPT, DECODE = 64, 32

CONFIGS = {
    # nk != nv (2 key heads, 6 value heads, tiled), untied head, full attention at layers 3 and 7
    "nk2-nv6-untied": dict(num_layers=8, interval=4, vocab_size=384, hidden_size=128, intermediate_size=256,
                           linear_key_head_dim=16, linear_value_head_dim=16, head_dim=32, rope_dim=8),
    # nk == nv, tied embedding, full attention at layers 1 and 3
    "nk4-nv4-tied": dict(num_layers=4, interval=2, vocab_size=384, hidden_size=128, intermediate_size=256,
                         linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16, head_dim=32, rope_dim=8, tie_word_embeddings=True),
}


def rel_rows(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module", params=list(CONFIGS))
def reference(request):
    """A random tiny model, HF's greedy continuation of a random prompt, and HF's logits along it."""
    cfg = tiny_target_config(**CONFIGS[request.param])
    weights = random_hf_state_dict(cfg, seed=7)
    model = hf_reference_model(cfg, weights)
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, PROMPT)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(DECODE):  # greedy, the full sequence each time: no cache involved on the reference side
            logits = model(torch.tensor([seq])).logits[0, -1]
            seq.append(int(torch.argmax(logits)))
        logits = model(torch.tensor([seq])).logits[0].numpy()
    return cfg, weights, np.array(seq), logits


@pytest.mark.parametrize("source", ["hf_dir", "gguf_f32"])
def test_prefill_and_decode_match_transformers(reference, source, tmp_path):
    cfg, weights, seq, want = reference
    if source == "hf_dir":
        write_hf_dir(tmp_path / "hf", cfg, weights)
        model = load_target(tmp_path / "hf", progress=False)
    else:
        write_hf_as_gguf(tmp_path / "m.gguf", weights, cfg, types=uniform_rule(GT.F32))
        model = load_target(tmp_path / "m.gguf", progress=False)
    assert model.config == cfg
    params = model
    state = init_state(cfg, slots=PROMPT + DECODE)
    (_, logits, _, state), = prefill_chunks(params, cfg, state, seq[:PROMPT], chunk=PROMPT, all_logits=True)
    got = [np.asarray(logits)]
    for i in range(PROMPT, PROMPT + DECODE):
        lg, _, state, ver = verify(params, cfg, state, jnp.asarray(seq[i:i + 1], jnp.int32),
                                   jnp.array([-1], jnp.int32), ())
        state = commit(state, ver, jnp.int32(0))
        got.append(np.asarray(lg))
    got = np.concatenate(got)
    assert rel_rows(got, want).max() < 1e-4
    # identical greedy continuation: each decoded token is our argmax at the position before it
    np.testing.assert_array_equal(np.argmax(got[PROMPT - 1:-1], axis=-1), seq[PROMPT:])
    assert int(state.length) == PROMPT + DECODE
