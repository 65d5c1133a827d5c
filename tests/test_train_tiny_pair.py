"""scripts/train_tiny_pair.py end to end at toy size on the CPU: corpus, BPE, target and drafter training lower their
losses, and what it writes is a pair the engine loads and decodes losslessly with."""

import email
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT

# The standard library's email package: a corpus that does not change with this repository's code, so the losses
# below are the same on every commit.
ARGS = ["--roots", str(Path(email.__file__).parent), "--held_out", "0.3", "--vocab", "384", "--hidden", "64",
        "--layers", "4", "--ffn", "128", "--seq_len", "64", "--batch", "4", "--target_steps", "24", "--lr", "1e-2",
        "--draft_layers", "1", "--taps", "2", "--block_size", "8", "--draft_steps", "24", "--draft_lr", "3e-3",
        "--anchors", "4", "--log_every", "4", "--eval_every", "24", "--save_every", "12"]


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "scripts"))
    import train_tiny_pair

    out = tmp_path_factory.mktemp("tiny")
    train_tiny_pair.main(["--out", str(out), *ARGS])
    return out


def _losses(history):
    return [h["loss"] for h in history if "loss" in h]


def test_the_script_trains_a_pair_that_lowers_its_losses(toy_run):
    target = json.loads((toy_run / "target_report.json").read_text())
    draft = json.loads((toy_run / "draft_report.json").read_text())
    t, d = _losses(target["history"]), _losses(draft["history"])
    assert len(t) == len(d) == 6
    # Batch losses of 4 sequences are noisy; the held-out loss is over the whole test split.
    assert target["held_out"]["loss"] < math.log(384) - 0.8, target["held_out"]  # ln(384) = 5.95: untrained
    assert np.mean(t[-2:]) < t[0], t
    assert np.mean(d[-2:]) < np.mean(d[:2]), d
    assert set(target["completions"]) and target["gguf_bytes"] > 0
    corpus = json.loads((toy_run / "corpus.json").read_text())
    assert any(held for _, _, held in corpus["files"]) and all(len(h) == 16 for _, h, _ in corpus["files"])
    prompts = [json.loads(line) for line in (toy_run / "heldout_prompts.jsonl").read_text().splitlines()]
    assert prompts and all(p["prompt"].rstrip().split("\n")[-1].lstrip().startswith("def ") for p in prompts)


def test_what_it_writes_decodes_losslessly(toy_run):
    from dflash_jax.config import EngineConfig
    from dflash_jax.engine.generate import Engine
    from dflash_jax.load import load_draft, load_target
    from dflash_jax.tokenizer import load_tokenizer

    target = load_target(toy_run / "target.gguf", progress=False)
    draft = load_draft(toy_run / "draft", target.config, progress=False, kcfg=target.kcfg)
    tok = load_tokenizer(toy_run / "target.gguf")
    assert target.config.tie_word_embeddings and draft.config.mask_token_id == tok.special["<|mask|>"]
    ids = tok.encode("def main():\n")
    runs = {mode: Engine.from_loaded(target, draft if mode != "ar" else None,
                                     EngineConfig(mode=mode, budget=6, max_ctx=64)).generate(ids, 24).tokens
            for mode in ("ar", "ddtree")}
    assert runs["ar"] == runs["ddtree"]


def test_a_rerun_skips_finished_stages_and_an_edited_checkpoint_is_refused(toy_run, capsys):
    import train_tiny_pair

    argv = ["--out", str(toy_run), *ARGS]
    before = (toy_run / "target.gguf").read_bytes()
    train_tiny_pair.main(argv)  # every stage's outputs exist: nothing runs
    assert (toy_run / "target.gguf").read_bytes() == before and "step" not in capsys.readouterr().err
    (toy_run / "target_report.json").unlink()
    with pytest.raises(SystemExit, match="written with other settings"):
        train_tiny_pair.main(argv + ["--lr", "5e-3"])  # the checkpoint was written with --lr 1e-2
