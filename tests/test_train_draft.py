"""Drafter training: the training pass equals inference block by block (no context leak, same-position labels),
labels are the target's greedy tokens, and a short run on the fixture lowers the loss and resumes exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY
from dflash_jax.config import EngineConfig
from dflash_jax.engine.generate import Engine
from dflash_jax.models import draft as draft_model
from dflash_jax.testing.tiny import random_draft, random_target, tiny_draft_config, tiny_target_config
from dflash_jax.training.draft_blocks import block_labels, block_logits, sample_anchors
from dflash_jax.training.features import target_features

TCFG = tiny_target_config(num_layers=4, interval=2, vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_heads=2, num_kv_heads=1, head_dim=32, rope_dim=8, linear_key_head_dim=16,
                          linear_value_head_dim=16, linear_num_value_heads=4)
BLOCK = 8


@pytest.fixture(scope="module")
def tparams():
    return random_target(TCFG, seed=4)


@pytest.mark.parametrize("types, window", [(("full_attention", "full_attention"), None),
                                           (("sliding_attention", "full_attention"), 5)])
def test_training_blocks_equal_inference_blocks(tparams, types, window):
    """Every block of the training pass gives the logits `propose` gives after the context before its anchor was
    committed: the context is seen strictly before the anchor, at the same positions, with the same masks."""
    dcfg = tiny_draft_config(TCFG, types, block_size=BLOCK, sliding_window=window, taps=(0, 2))
    dparams = random_draft(dcfg, seed=3)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, TCFG.vocab_size, 128), jnp.int32)
    taps, _ = target_features(tparams, TCFG, tokens, dcfg.target_layer_ids)
    anchors = jnp.asarray([1, 2, 17, 63, 64, 100, 120], jnp.int32)
    got = block_logits(dparams, dcfg, tparams, taps, tokens, anchors)

    @jax.jit
    def inference(a):  # the context before the anchor committed, then the block rooted at the anchor
        state = draft_model.init_draft_state(dcfg, 128)
        state = draft_model.extend_context(dparams, dcfg, state, jnp.where(jnp.arange(128)[:, None, None] < a, taps,
                                                                           0.0), a)
        return draft_model.propose(dparams, dcfg, state, tparams, tokens[a])[1]

    for i, a in enumerate(np.asarray(anchors)):
        np.testing.assert_allclose(got[i], inference(jnp.int32(a)), rtol=1e-4, atol=1e-4, err_msg=f"anchor {a}")


def test_greedy_labels_are_what_the_target_decodes(tparams):
    """On the target's own greedy text the labels of a block are the next tokens after its anchor, as the verifier
    will accept them: slot k learns position a + k."""
    prompt = np.arange(5, 21)
    out = Engine(TCFG, tparams, EngineConfig(mode="ar", max_ctx=256)).generate(prompt, 128 - len(prompt))
    tokens = jnp.asarray(np.concatenate([prompt, out.tokens]), jnp.int32)
    _, greedy = target_features(tparams, TCFG, tokens, (0,))
    anchors = jnp.asarray([len(prompt) - 1, 40, 119], jnp.int32)
    for source in ("greedy", "data"):
        labels = np.asarray(block_labels(tokens, greedy, anchors, BLOCK, source))
        for a, row in zip(np.asarray(anchors), labels):
            assert row[1:].tolist() == np.asarray(tokens)[a + 1:a + BLOCK].tolist(), (source, a)


def test_anchor_sampling():
    weights = jnp.ones(64).at[40:].set(0)
    anchors, keep = sample_anchors(jax.random.key(0), weights, 16, BLOCK)
    a = np.asarray(anchors)
    assert keep.all() and (np.diff(a) > 0).all() and a.min() >= 1 and a.max() < 40
    anchors, keep = sample_anchors(jax.random.key(1), weights, 48, BLOCK)  # more than the 39 candidates
    assert int(keep.sum()) == 39 and sorted(set(np.asarray(anchors)[np.asarray(keep)])) == list(range(1, 40))
    assert np.asarray(keep)[:39].all() and not np.asarray(keep)[39:].any()


def test_training_lowers_the_held_out_loss_and_resumes_exactly(tparams, tmp_path):
    """30 steps lower the held-out loss; 15 steps, a checkpoint written to disk and read back, and 15 more give the
    same weights and metrics as 30 straight (the data order, anchors and optimizer state all resume)."""
    from dflash_jax.training import checkpoint
    from dflash_jax.training.data import batches
    from dflash_jax.training.draft_trainer import BlockConfig, draft_config_for, draft_trainer
    from dflash_jax.training.loop import TrainConfig

    data = np.random.default_rng(0).integers(0, 64, (64, 64)).astype(np.int32)  # held out: the first 8 rows
    cfg = draft_config_for(TCFG, TCFG.vocab_size - 1, layers=1, block_size=4, taps=2)
    tc = TrainConfig(steps=30, batch=4, seq_len=64, lr=3e-3)
    trainer = draft_trainer(cfg, tparams, tc, BlockConfig(anchors=8, gamma=2.0, dtype="float32"))
    params, opt_state = trainer.init()
    before = trainer.evaluate(params, data[:8])["loss"]
    straight = []
    params, _ = trainer.run(params, opt_state, batches(data[8:], 4, 0), every=5, log=lambda _: None,
                            history=straight)
    after = trainer.evaluate(params, data[:8])["loss"]
    assert after < 0.95 * before, (before, after)

    path = str(tmp_path / "ckpt.npz")
    p, o = trainer.init()
    resumed = []
    trainer.run(p, o, batches(data[8:], 4, 0), every=5, log=lambda _: None, history=resumed,
             on_checkpoint=lambda step, p, o: checkpoint.save(path, (p, o), {"step": step}) if step == 15 else None,
             save_every=15)
    (p, o), meta = checkpoint.load(path, trainer.init())
    assert meta == {"step": 15}
    resumed = resumed[:3]  # what was logged up to the checkpoint
    p, _ = trainer.run(p, o, batches(data[8:], 4, 0, start_step=15), start=15, every=5, log=lambda _: None,
                     history=resumed)
    assert resumed == straight
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(checkpoint.CheckpointError, match="arrays"):
        checkpoint.load(path, trainer.init()[0])


def test_the_train_draft_command_writes_a_drafter_the_engine_runs(tiny_gguf_path, tmp_path, jit_cache):
    """`python -m dflash_jax.train_draft` on the fixture target: progress lines, a z-lab drafter that loads and
    decodes losslessly, the metrics; bad flags exit 2 with one line. (Resuming is checked in-process above.)"""
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT
    from dflash_jax.load import load_draft, load_target

    out = tmp_path / "drafter"
    args = [sys.executable, "-m", "dflash_jax.train_draft", "--target", str(tiny_gguf_path), "--data",
            str(ROOT / "dflash_jax" / "server"), "--out", str(out), "--layers", "1", "--block_size", "8",
            "--seq_len", "64", "--batch", "2", "--anchors", "4", "--log_every", "2", "--save_every", "2",
            "--eval_every", "0", "--held_out", "0", f"--jit_cache={jit_cache}"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(args + ["--steps", "4"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "mask token 1023" in run.stderr and "step 4/4  loss" in run.stderr
    assert {"config.json", "model.safetensors", "checkpoint.npz", "history.json"} <= set(os.listdir(out))
    history = json.load(open(out / "history.json"))
    assert [h["step"] for h in history] == [2, 4] and all(np.isfinite(h["loss"]) for h in history)

    target = load_target(tiny_gguf_path, progress=False)
    draft = load_draft(out, target.config, progress=False)
    assert draft.config.num_layers == 1 and draft.config.block_size == 8
    engine = Engine.from_loaded(target, draft, EngineConfig(mode="ddtree", budget=8, max_ctx=256))
    greedy = np.load(TINY / "ref.npz")["hf_q_greedy"][:12].tolist()
    assert engine.generate(np.load(TINY / "tokens.npy"), 12).tokens == greedy  # lossless with the trained drafter

    bad = subprocess.run(args[:5] + ["--out", str(tmp_path / "x"), "--seq_len", "100"], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip() == "train_draft: --data is required"
    bad = subprocess.run(args + ["--seq_len", "100"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert bad.returncode == 2 and "multiple of 64" in bad.stderr


def test_corpus_files_split_pack_and_batches(tmp_path):
    import os

    from dflash_jax.training import data

    (tmp_path / "b").mkdir()
    for name, text in [("a.py", "x = 1\n"), ("b/c.py", "y = 2\n"), ("b/d.txt", "x = 1\n"), ("e.bin", "z")]:
        (tmp_path / name).write_text(text)
    (tmp_path / "f.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    files = data.list_files([str(tmp_path)])
    assert [os.path.relpath(f, tmp_path) for f in files] == ["a.py", "b/c.py", "b/d.txt", "f.jsonl"]
    docs = data.dedupe(data.read_documents(files))
    assert [text for _, text in docs] == ["x = 1\n", "y = 2\n", "one", "two"]  # d.txt repeats a.py
    assert docs[3][0].endswith("f.jsonl:3")
    names = [f"file{i}.py" for i in range(2000)]
    held = [n for n in names if data.held_out(n, 0.1)]
    assert 150 < len(held) < 250 and not data.held_out("file0.py", 0.0)
    packed = data.pack([[1, 2, 3], [4, 5]], 3, 0)
    assert packed.tolist() == [[1, 2, 3], [0, 4, 5]]  # the separator ends each document; the tail is dropped
    rows = np.arange(20).reshape(10, 2)
    it = data.batches(rows, 3, seed=1)
    first = [next(it) for _ in range(7)]
    resumed = data.batches(rows, 3, seed=1, start_step=4)
    assert all((next(resumed) == b).all() for b in first[4:])
    epoch = np.concatenate(first[:3])  # an epoch is 3 batches of distinct rows
    assert len({tuple(r) for r in epoch}) == 9
    for bad, message in [(lambda: data.pack([[1]], 8, 0), "do not fill one sequence"),
                         (lambda: next(data.batches(rows, 11, 0)), "do not fill one batch"),
                         (lambda: data.list_files([str(tmp_path / "missing")]), "no such file")]:
        with pytest.raises(data.DataError, match=message):
            bad()
