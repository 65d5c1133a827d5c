"""`python -m dflash_jax.train_draft`: train a DFlash drafter for a target on text files.

    python -m dflash_jax.train_draft --target model.gguf --data corpus/ --out drafter/ --steps 2000

The recipe of specs/dflash_training.md: random anchors per sequence re-drawn every step, [anchor, MASK x (B-1)]
blocks that see the target's features strictly before their anchor and each other both ways, the decayed
cross-entropy on slots 1..B-1 against the target's own greedy tokens, the target's embedding and lm_head frozen,
AdamW with float32 master weights. The output directory holds the drafter in the z-lab format (config.json,
model.safetensors) that `--draft` loads, the checkpoint a rerun resumes from, and the metrics in history.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Sequence

from dflash_jax.errors import run_main
from dflash_jax.generate import UsageError, enable_jit_cache, parse_flags

GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's slot-weight decay per block size (specs/dflash_training.md §3.1)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def read_corpus(paths: Sequence[str]) -> list[tuple[str, str]]:
    """The deduplicated (name, text) documents of text files: read, and so checked, before any model loads."""
    from dflash_jax.training import data

    docs = data.dedupe(data.read_documents(data.list_files(paths)))
    if not docs:
        raise UsageError(f"no text found in {', '.join(paths)}")
    return docs


def load_corpus(docs: Sequence[tuple[str, str]], tokenizer, seq_len: int, held_out: float) -> tuple:
    """Train and held-out sequences [n, seq_len] of documents: split by file, tokenized, packed."""
    from dflash_jax.training import data

    separator = tokenizer.special.get("<|endoftext|>", tokenizer.eos_id)
    train_docs, test_docs = data.split(docs, held_out)
    train = data.pack([tokenizer.encode(text) for _, text in train_docs], seq_len, separator)
    test_ids = [tokenizer.encode(text) for _, text in test_docs]
    test = data.pack(test_ids, seq_len, separator) if sum(map(len, test_ids)) >= seq_len else train[:0]
    _log(f"data: {len(docs)} documents, {len(train)} train and {len(test)} held-out sequences of {seq_len} tokens")
    return train, test


def run(argv: Sequence[str]) -> int:
    """The command; returns its exit code."""
    import jax
    import numpy as np
    from absl import flags, logging

    from dflash_jax.config import draft_config_to_hf
    from dflash_jax.load import load_target
    from dflash_jax.models import draft as draft_model
    from dflash_jax.tokenizer import load_tokenizer
    from dflash_jax.training import checkpoint
    from dflash_jax.training.data import batches
    from dflash_jax.training.draft_trainer import BlockConfig, draft_config_for, draft_trainer, trained_draft
    from dflash_jax.training.loop import TrainConfig

    logging.set_verbosity(logging.WARNING)
    f = flags.FLAGS
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    for name in ("target", "data", "out"):
        if not getattr(f, name):
            raise UsageError(f"--{name} is required")
    if f.seq_len % 64:
        raise UsageError(f"--seq_len {f.seq_len} must be a multiple of 64 (the target's prefill chunk)")
    if f.block_size + 1 > f.seq_len:
        raise UsageError(f"--block_size {f.block_size} does not fit --seq_len {f.seq_len}")
    enable_jit_cache(f.jit_cache)
    if not os.path.exists(f.target):
        raise UsageError(f"{f.target}: no such file or directory")
    docs = read_corpus(f.data.split(","))
    target = load_target(f.target)  # the reference kernels: exact features, and differentiable
    tok = load_tokenizer(f.target)
    mask_id = tok.special.get(f.mask_token) if f.mask_token_id < 0 else f.mask_token_id
    if mask_id is None or not 0 <= mask_id < target.config.vocab_size:
        raise UsageError(f"no mask token: the tokenizer has no {f.mask_token!r} and --mask_token_id is not given")
    row_norm = float(np.linalg.norm(np.asarray(target.embed_tokens(jax.numpy.asarray([mask_id])))))
    _log(f"target: {f.target} ({target.config.num_layers} layers, hidden {target.config.hidden_size}); mask token "
         f"{mask_id}, its embedding row has norm {row_norm:.3g}" + (" (near zero: every MASK slot starts alike)"
                                                                     if row_norm < 1e-3 else ""))
    cfg = draft_config_for(target.config, mask_id, f.layers, f.block_size, f.taps)
    tc = TrainConfig(steps=f.steps, batch=f.batch, seq_len=f.seq_len, lr=f.lr, warmup=f.warmup, seed=f.seed)
    bc = BlockConfig(anchors=f.anchors, gamma=f.gamma or GAMMA.get(f.block_size, round(7.0 * f.block_size / 16, 1)),
                     labels=f.labels, dtype=f.dtype)
    train, test = load_corpus(docs, tok, f.seq_len, f.held_out)
    trainer = draft_trainer(cfg, target, tc, bc)
    params, opt_state = trainer.init()
    meta = {"train": dataclasses.asdict(tc), "blocks": dataclasses.asdict(bc), "draft": draft_config_to_hf(cfg)}
    os.makedirs(f.out, exist_ok=True)
    ckpt, history_path = os.path.join(f.out, "checkpoint.npz"), os.path.join(f.out, "history.json")
    start, history = 0, []
    if f.resume and os.path.exists(ckpt):
        (params, opt_state), saved = checkpoint.load(ckpt, (params, opt_state))
        def settings(m):  # everything but --steps, which may be raised to train longer
            return {"train": {**m["train"], "steps": None}, "blocks": m.get("blocks"), "draft": m.get("draft")}

        if settings(saved) != settings(meta):
            raise UsageError(f"{ckpt} was written with other settings; use another --out or --noresume")
        start = saved["step"]
        history = json.load(open(history_path)) if os.path.exists(history_path) else []
        _log(f"resuming from step {start}")
    n_params = sum(x.size for x in jax.tree.leaves(params))
    _log(f"drafter: {cfg.num_layers} layers, block {cfg.block_size}, taps {list(cfg.target_layer_ids)}, "
         f"{n_params / 1e6:.2f}M trained parameters; {tc.steps} steps of {tc.batch} x {tc.seq_len} tokens, "
         f"{bc.anchors} blocks each, on {jax.default_backend()}")

    def save(step, params, opt_state):
        checkpoint.save(ckpt, (params, opt_state), {**meta, "step": step})
        draft_model.write_draft_dir(f.out, trained_draft(cfg, params))
        with open(history_path, "w") as out:
            json.dump(history, out, indent=1)

    t0 = time.perf_counter()
    trainer.run(params, opt_state, batches(train, tc.batch, tc.seed, start), start, log=_log, every=f.log_every,
                on_checkpoint=save, save_every=f.save_every, held_out=test if len(test) else None,
                eval_every=f.eval_every, history=history)
    _log(f"done: {tc.steps - start} steps in {time.perf_counter() - t0:.0f} s; drafter written to {f.out}")
    return 0


def main(argv: Sequence[str]) -> None:
    run_main("train_draft", run, argv)


def define_flags() -> None:
    from absl import flags

    from dflash_jax.generate import default_jit_cache

    flags.DEFINE_string("target", None, "The target: a qwen35 GGUF file or an HF directory (frozen).")
    flags.DEFINE_string("data", None, "Training text: files or directories (comma-separated); .jsonl files give "
                        "one document per line's 'text'.")
    flags.DEFINE_string("out", None, "Output directory: the drafter (config.json, model.safetensors), "
                        "checkpoint.npz and history.json.")
    flags.DEFINE_integer("layers", 5, "Drafter layers.", lower_bound=1)
    flags.DEFINE_integer("block_size", 16, "Block size B: the anchor and B-1 masked slots.", lower_bound=2)
    flags.DEFINE_integer("taps", 5, "Target layers whose outputs feed the drafter.", lower_bound=1)
    flags.DEFINE_integer("steps", 2000, "Optimizer steps.", lower_bound=1)
    flags.DEFINE_integer("batch", 8, "Sequences per step.", lower_bound=1)
    flags.DEFINE_integer("seq_len", 256, "Tokens per sequence (a multiple of 64).", lower_bound=64)
    flags.DEFINE_integer("anchors", 32, "Blocks per sequence, re-drawn every step.", lower_bound=1)
    flags.DEFINE_float("lr", 6e-4, "Peak learning rate.", lower_bound=0.0)
    flags.DEFINE_float("warmup", 0.04, "Warmup, as a fraction of the steps.", lower_bound=0.0, upper_bound=1.0)
    flags.DEFINE_float("gamma", 0.0, "Slot-weight decay exp(-(k-1)/gamma); 0: the paper's for the block size.",
                       lower_bound=0.0)
    flags.DEFINE_enum("labels", "greedy", ["greedy", "data"], "What slot k learns: the target's greedy token there "
                      "(what verification accepts) or the data's.")
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Matmul input precision (weights and optimizer "
                      "state stay float32).")
    flags.DEFINE_integer("seed", 0, "Seed of the initial weights, the data order and the anchors.")
    flags.DEFINE_float("held_out", 0.05, "Fraction of the files held out for evaluation (by a hash of the name).",
                       lower_bound=0.0, upper_bound=0.5)
    flags.DEFINE_string("mask_token", "<|mask|>", "The tokenizer's reserved token the blocks are filled with.")
    flags.DEFINE_integer("mask_token_id", -1, "The mask token by id (overrides --mask_token).")
    flags.DEFINE_integer("log_every", 50, "Steps between progress lines.", lower_bound=1)
    flags.DEFINE_integer("eval_every", 500, "Steps between held-out evaluations (0: only at the end).", lower_bound=0)
    flags.DEFINE_integer("save_every", 500, "Steps between checkpoints.", lower_bound=1)
    flags.DEFINE_boolean("resume", True, "Continue from the checkpoint in --out when there is one.")
    flags.DEFINE_string("jit_cache", default_jit_cache(), "JAX's persistent compilation cache; empty to turn it off.")


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(main, flags_parser=lambda argv: parse_flags(argv, "train_draft"))
