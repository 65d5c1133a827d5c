"""Loading targets from HF directories and GGUF files, host-side prompt checks, and `python -m dflash_jax.score`."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from dflash_jax.config import KernelConfig
from dflash_jax.engine.prefill import InputError, prefill, prefill_chunks
from dflash_jax.load import LoadError, load_target
from dflash_jax.models.target import init_state
from dflash_jax.quant import QTensor
from dflash_jax.testing.gguf_writer import write_hf_as_gguf
from dflash_jax.testing.tiny import random_hf_state_dict, tiny_target_config, write_hf_dir

from conftest import ROOT, TINY

CFG = tiny_target_config(num_layers=4, interval=2, vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_heads=2, num_kv_heads=1, head_dim=32, rope_dim=8, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_num_value_heads=4)


@pytest.fixture(scope="module")
def weights():
    return random_hf_state_dict(CFG, seed=11)


def leaves(params):
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(params)]


def last_logits(model, ids):
    logits, _, _ = prefill(model, model.config, init_state(model.config, 64), ids)
    return np.asarray(logits)


def test_bf16_directory_keeps_bf16_matrices_and_matches_f32_of_the_same_values(weights, tmp_path):
    rounded = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in weights.items()}
    write_hf_dir(tmp_path / "bf16", CFG, weights, dtype=ml_dtypes.bfloat16)
    write_hf_dir(tmp_path / "f32", CFG, rounded)
    bf16, f32 = load_target(tmp_path / "bf16", progress=False), load_target(tmp_path / "f32", progress=False)
    wq = bf16.layers[1].self_attn.q_proj.weight.get_value()
    if bf16.kcfg.impl == "pallas":  # kept in the stored precision for XLA's product
        assert isinstance(wq, QTensor) and wq.fmt == "BF16" and wq.data["w"].dtype == jnp.bfloat16
    else:  # a small model on the reference path: widened once at load (kernels.prepare_matrices)
        assert wq.dtype == jnp.float32
        pallas = KernelConfig(impl="pallas", interpret=True)
        stored = load_target(tmp_path / "bf16", progress=False, kcfg=pallas).layers[1].self_attn.q_proj.weight
        stored = stored.get_value()
        assert stored.fmt == "BF16" and stored.data["w"].dtype == jnp.bfloat16
        np.testing.assert_array_equal(wq, np.asarray(stored.data["w"], np.float32))
    assert bf16.layers[0].input_layernorm.weight.get_value().dtype == jnp.float32  # norms (+1 folded in) stay float32
    ids = np.arange(1, 40) % CFG.vocab_size
    # the same float32 arithmetic on the same values (a GPU may fuse the bf16 widening differently: last-ulp noise)
    np.testing.assert_allclose(last_logits(bf16, ids), last_logits(f32, ids), rtol=1e-5, atol=1e-6)


def test_vlm_directory_loads_its_language_model(weights, tmp_path):
    write_hf_dir(tmp_path / "lm", CFG, weights)
    write_hf_dir(tmp_path / "vlm", CFG, weights, vlm=True)
    lm, vlm = load_target(tmp_path / "lm", progress=False), load_target(tmp_path / "vlm", progress=False)
    assert vlm.config == lm.config == CFG
    for a, b in zip(leaves(lm), leaves(vlm), strict=True):
        np.testing.assert_array_equal(a, b)


def test_sharded_directory_with_an_index(weights, tmp_path):
    write_hf_dir(tmp_path / "one", CFG, weights)
    shard = tmp_path / "sharded"
    shard.mkdir()
    (shard / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: weights[n] for n in part}, str(shard / file))
    weight_map = {n: f for f, part in halves.items() for n in part}
    (shard / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for a, b in zip(leaves(load_target(tmp_path / "one", progress=False)),
                    leaves(load_target(shard, progress=False)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_gguf_load_drops_the_mtp_block(tmp_path):
    cfg = dataclasses.replace(CFG, num_mtp_layers=1)
    write_hf_as_gguf(tmp_path / "mtp.gguf", random_hf_state_dict(cfg, seed=2, mtp=True), cfg)
    model = load_target(tmp_path / "mtp.gguf", progress=False)
    assert model.config.num_mtp_layers == 1 and len(model.layers) == cfg.num_layers


def _bad_dir(tmp_path, weights, edit):
    path = tmp_path / "bad"
    write_hf_dir(path, CFG, weights)
    edit(path)
    return path


@pytest.mark.parametrize("edit, error, message", [
    (lambda p: (p / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                           "model_type": "llama"})),
     LoadError, "LlamaForCausalLM is not a Qwen3.5/3.6 model"),
    (lambda p: (p / "config.json").unlink(), LoadError, "no config.json"),
    (lambda p: (p / "model.safetensors").rename(p / "pytorch_model.bin"), LoadError, "no *.safetensors"),
    (lambda p: (p / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}    "),
     LoadError, "not a readable safetensors file"),
])
def test_bad_directories_give_clear_errors(weights, tmp_path, edit, error, message):
    with pytest.raises(error, match=message.replace("*", r"\*").replace(".", r"\.")):
        load_target(_bad_dir(tmp_path, weights, edit), progress=False)


def test_missing_tensor_and_unsupported_dtype(weights, tmp_path):
    dropped = {k: v for k, v in weights.items() if k != "model.layers.0.linear_attn.in_proj_z.weight"}
    write_hf_dir(tmp_path / "missing", CFG, dropped)
    with pytest.raises(LoadError, match=f"^{tmp_path / 'missing'}: missing HF tensor "
                                        f"'model.layers.0.linear_attn.in_proj_z.weight'"):
        load_target(tmp_path / "missing", progress=False)
    write_hf_dir(tmp_path / "int8", CFG, weights)
    save_file({**weights, "model.norm.weight": np.zeros(CFG.hidden_size, np.int8)},
              str(tmp_path / "int8" / "model.safetensors"))
    with pytest.raises(LoadError, match="'model.norm.weight' is I8; only F32, BF16 and F16"):
        load_target(tmp_path / "int8", progress=False)
    with pytest.raises(LoadError, match="no such file or directory"):
        load_target(tmp_path / "nowhere", progress=False)


@pytest.fixture(scope="module")
def small(weights, tmp_path_factory):
    path = tmp_path_factory.mktemp("small") / "hf"
    write_hf_dir(path, CFG, weights)
    return load_target(path, progress=False)


def test_bad_prompts_raise_and_leave_the_state_alone(small):
    cfg, params = small.config, small
    _, _, state = prefill(params, cfg, init_state(cfg, 40), np.arange(10))
    before = leaves(state)
    for ids, message in [([1, 2, cfg.vocab_size], "outside the vocabulary"), ([3, -1], "outside the vocabulary"),
                         (np.arange(31), "need 41 cache slots; the context was allocated with 40"),
                         ([], "non-empty"), (np.ones((2, 2), int), "1-D"), ([1.5], "integers")]:
        with pytest.raises(InputError, match=message):
            prefill(params, cfg, state, ids)
        for a, b in zip(before, leaves(state), strict=True):
            np.testing.assert_array_equal(a, b)
    _, _, state = prefill(params, cfg, state, np.arange(30))  # exactly full still works
    assert int(state.length) == 40


def test_padded_last_chunk_at_the_end_of_the_cache_keeps_committed_keys(small):
    """70 tokens in chunks of 64 into 70 slots: the last chunk's padding falls past the cache and is dropped."""
    cfg, params = small.config, small
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 70)
    full = [np.asarray(lg) for _, lg, _, _ in prefill_chunks(params, cfg, init_state(cfg, 128), ids,
                                                               all_logits=True)]
    tight = [np.asarray(lg) for _, lg, _, _ in prefill_chunks(params, cfg, init_state(cfg, 70), ids,
                                                                all_logits=True)]
    np.testing.assert_allclose(np.concatenate(tight), np.concatenate(full), rtol=1e-5, atol=1e-5)


def test_prefill_returns_taps_of_every_prompt_token(small):
    cfg, params = small.config, small
    ids = np.arange(5, 75)
    logits, taps, _ = prefill(params, cfg, init_state(cfg, 80), ids, taps=(0, 2))
    assert logits.shape == (cfg.vocab_size,) and taps.shape == (70, 2, cfg.hidden_size)
    (_, lg, t, _), = prefill_chunks(params, cfg, init_state(cfg, 80), ids, chunk=128, taps=(0, 2))
    np.testing.assert_allclose(np.asarray(taps), np.asarray(t)[:70], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(lg), rtol=1e-5, atol=1e-5)


def run_score(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "dflash_jax.score", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)


def test_score_cli_reproduces_hf_logits_of_the_fixture(tiny_gguf_path, tmp_path):
    out = tmp_path / "logits.npy"
    proc = run_score("--target", str(tiny_gguf_path), "--ids", str(TINY / "tokens.npy"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    want = np.load(TINY / "ref.npz")["hf_q_logits"]
    got = np.load(out)
    assert got.shape == want.shape
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4
    ids = np.load(TINY / "tokens.npy")
    logp = jax.nn.log_softmax(jnp.asarray(want[:-1]), axis=-1)
    mean = float(np.mean(np.take_along_axis(np.asarray(logp), ids[1:, None], axis=-1)))
    found = re.search(r"mean log-likelihood (-?[\d.]+), perplexity ([\d.]+)", proc.stdout)
    assert found, proc.stdout
    assert float(found[1]) == pytest.approx(mean, abs=2e-4)
    assert float(found[2]) == pytest.approx(np.exp(-mean), rel=1e-5)


def test_score_cli_bad_input_is_one_line(tiny_gguf_path):
    proc = run_score("--target", str(tiny_gguf_path), "--ids", "1,2,99999")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "score: token id 99999 at position 2 is outside the vocabulary (0..1023); 1 such id(s)"]


def test_score_cli_text_goes_through_the_gguf_tokenizer(tiny_gguf_path):
    import json

    case = json.loads((TINY / "tokenizer_ref.json").read_text())[0]
    by_text = run_score("--target", str(tiny_gguf_path), "--text", case["text"])
    by_ids = run_score("--target", str(tiny_gguf_path), "--ids", ",".join(map(str, case["ids"])))
    assert by_text.returncode == 0 and by_ids.returncode == 0, by_text.stderr + by_ids.stderr
    assert by_text.stdout.split("(load")[0] == by_ids.stdout.split("(load")[0]


def test_reference_matrices_are_dequantized_once_when_they_fit(tiny_gguf_path):
    """kernels.prepare_matrices on the reference path: each stored matrix becomes the float32 array the product
    would dequantize at every call, unless together they pass the limit; the embedding (read by row) is left."""
    from dflash_jax.kernels import REFERENCE, prepare_matrices
    from dflash_jax.quant import dequantize

    from dflash_jax.gguf import GGUFModel

    model = GGUFModel(tiny_gguf_path)
    stored = {n: jax.tree.map(jnp.asarray, model.load(n)) for n in model.tensors}
    dense = prepare_matrices(stored, REFERENCE, skip=("token_embd.weight",))
    assert isinstance(dense.pop("token_embd.weight"), QTensor) and not any(
        isinstance(x, QTensor) for x in jax.tree.leaves(dense, is_leaf=lambda x: isinstance(x, QTensor)))
    wq, qt = dense["blk.3.attn_q.weight"], stored["blk.3.attn_q.weight"]
    np.testing.assert_array_equal(wq, dequantize(qt))
    assert prepare_matrices(stored, REFERENCE, dense_limit=1000) is stored


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_named_pipe_is_refused_without_reading_it(tmp_path):
    """A FIFO as --target or --draft would block the first read: refused by its type, before any open."""
    from dflash_jax.load import draft_config, open_target

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(LoadError, match="not a regular file or a directory"):
        open_target(fifo)
    with pytest.raises(LoadError, match="not a regular file or a directory"):
        draft_config(fifo, None)
    proc = subprocess.run([sys.executable, "-m", "dflash_jax.generate", "--target", str(fifo), "--mode", "ar",
                           "--prompt", "hi", "--jit_cache="], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "not a regular file" in proc.stderr and "Traceback" not in proc.stderr
