"""Train the tiny model pair of issue 8 from a seed: a Python-code corpus from the machine, a byte-level BPE, a
Qwen3.5-architecture target trained from scratch (a Q4_K_M GGUF with its tokenizer) and its DFlash drafter.

    python scripts/train_tiny_pair.py --out runs/tiny [--stage corpus|target|draft|all] [--time_limit 500]

The defaults are the recipe of the pair shipped in dflash_jax/assets/default/. Stages keep their outputs in --out
and are skipped when those exist; training checkpoints and resumes, so a run cut short by --time_limit continues
where it stopped when started again.

corpus: every .py file under --roots (default: this Python's standard library and site-packages), in sorted order,
deduplicated, at most --max_mb; a hash of each path holds out --held_out of the files. The list with each file's
sha256 goes to corpus.json. A BPE of --vocab tokens is trained on the training files (tokenizer.json, kept if it
exists), and both splits are tokenized into one stream each (train_ids.npy, test_ids.npy; documents end with
<|endoftext|>). heldout_prompts.jsonl holds a completion prompt per held-out file (for scripts/acceptance.py).

target: --target_steps of next-token training (AdamW, warmup then cosine) on --seq_len sequences, then target.gguf
(Q4_K_M types, the BPE and a ChatML template in its metadata) and target_report.json: held-out loss and greedy
completions of a few code prompts through the engine.

draft: --draft_steps of the DFlash recipe (the trainer of `python -m dflash_jax.train_draft`) against target.gguf as
written, so the labels are the shipped target's own greedy tokens; then draft/ (config.json and model.safetensors,
the z-lab layout) and draft_report.json (held-out loss, slot-1 accuracy, teacher-forced acceptance).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_jax.training import data  # noqa: E402
from dflash_jax.training.bpe import bpe_tokenizer, gguf_metadata, train_bpe  # noqa: E402

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self):\n",
           "    for i in range(len("]


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def default_roots() -> list[str]:
    paths = sysconfig.get_paths()
    return sorted({paths["stdlib"], paths["purelib"]})


def corpus_stage(out: Path, roots: list[str], held_out: float, max_mb: float, vocab: int) -> None:
    """corpus.json, tokenizer.json, train_ids.npy and test_ids.npy."""
    t0 = time.perf_counter()
    files = data.list_files(roots, (".py",))
    docs, total = [], 0
    for name, text in data.dedupe(data.read_documents(files)):
        if total + len(text) > max_mb * 1e6:
            break
        docs.append((name, text))
        total += len(text)
    if not docs:
        raise SystemExit(f"no .py files under {roots}")
    train_docs, test_docs = data.split(docs, held_out)
    held = {name for name, _ in test_docs}
    (out / "corpus.json").write_text(json.dumps({
        "roots": roots, "held_out": held_out, "max_mb": max_mb, "bytes": total,
        "files": [[name, hashlib.sha256(text.encode()).hexdigest()[:16], name in held]
                  for name, text in docs]}, indent=0))
    log(f"corpus: {len(docs)} files, {total / 1e6:.1f} MB ({len(test_docs)} held out) in "
        f"{time.perf_counter() - t0:.0f} s")
    if (out / "tokenizer.json").exists():  # a rerun keeps the tokenizer a target was trained with
        saved = json.loads((out / "tokenizer.json").read_text())
        tokens, merges = saved["tokens"], saved["merges"]
        log("tokenizer: reusing tokenizer.json")
    else:
        tokens, merges = train_bpe([text for _, text in train_docs], vocab)
        (out / "tokenizer.json").write_text(json.dumps({"tokens": tokens, "merges": merges}))
    with open(out / "heldout_prompts.jsonl", "w", encoding="utf-8") as f:
        for name, text in test_docs:
            prompt = completion_prompt(text)
            if prompt:
                f.write(json.dumps({"name": name, "prompt": prompt}) + "\n")
    tok = bpe_tokenizer(tokens, merges)
    sep = tok.special["<|endoftext|>"]
    for name, part in (("train", train_docs), ("test", test_docs)):
        encoded = tok.backend.encode_batch([text for _, text in part], add_special_tokens=False)
        stream = np.fromiter((i for e in encoded for i in (*e.ids, sep)), np.int32)
        np.save(out / f"{name}_ids.npy", stream)
        log(f"{name}: {len(stream):,} tokens")
    log(f"tokenizer: {len(tokens)} tokens; corpus stage {time.perf_counter() - t0:.0f} s")


def train_resumable(out: Path, name: str, trainer, settings: dict, args) -> tuple[object, list[dict], dict] | None:
    """Train on train_ids.npy (or resume from out/{name}_checkpoint.npz, written with the same settings) to the
    trainer's steps: the params, the logged history and the held-out metrics; None when --time_limit stopped the run
    at a checkpoint (run again to continue)."""
    import jax

    from dflash_jax.training import checkpoint

    tc = trainer.tc
    meta = {"train": {**tc.__dict__, "steps": None}, **settings}
    train_rows = rows(out / "train_ids.npy", tc.seq_len)
    test_rows = rows(out / "test_ids.npy", tc.seq_len, 64)
    if len(test_rows) < tc.batch:
        raise SystemExit(f"{name}: the held-out split fills {len(test_rows)} sequences of {tc.seq_len}, fewer than a "
                         f"batch of {tc.batch}: raise --held_out")
    params, opt_state = trainer.init()
    ckpt, start, history = out / f"{name}_checkpoint.npz", 0, []
    if ckpt.exists():
        (params, opt_state), saved = checkpoint.load(str(ckpt), (params, opt_state))
        if {k: saved[k] for k in meta} != meta:
            raise SystemExit(f"{ckpt} was written with other settings")
        start, history = saved["step"], saved["history"]
        log(f"{name}: resuming from step {start}")
    log(f"{name}: {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.2f}M trained parameters, {len(train_rows)} "
        f"train sequences of {tc.seq_len}, {tc.steps} steps of {tc.batch}, on {jax.default_backend()}")
    deadline = args.deadline

    def save(step, params, opt_state):
        checkpoint.save(str(ckpt), (params, opt_state), {**meta, "step": step, "history": history})
        if deadline and time.monotonic() > deadline and step < tc.steps:
            raise TimeoutError(step)

    try:
        params, _ = trainer.run(params, opt_state, data.batches(train_rows, tc.batch, tc.seed, start), start, log=log,
                                every=args.log_every, on_checkpoint=save, save_every=args.save_every,
                                held_out=test_rows, eval_every=args.eval_every, history=history)
    except TimeoutError as stop:
        log(f"{name}: stopped at step {stop.args[0]} (--time_limit); run again to continue")
        return None
    return params, history, trainer.evaluate(params, test_rows)


def rows(path: Path, seq_len: int, limit: int | None = None) -> np.ndarray:
    """A token stream cut into [n, seq_len] rows (at most `limit`)."""
    stream = np.load(path)
    n = len(stream) // seq_len if limit is None else min(len(stream) // seq_len, limit)
    return stream[:n * seq_len].reshape(n, seq_len)


def completion_prompt(text: str, min_chars: int = 400, max_chars: int = 2000) -> str | None:
    """A held-out file as a completion prompt: its text through the first `def` line after min_chars characters
    (keeping at most the last max_chars, cut at a line start), or None if it has no such line."""
    at = text.find("def ", min_chars)
    while at > 0 and text[at - 1] not in " \n":
        at = text.find("def ", at + 1)
    end = text.find("\n", at) if at >= 0 else -1
    if end < 0:
        return None
    prompt = text[:end + 1]
    if len(prompt) > max_chars:
        cut = prompt.find("\n", len(prompt) - max_chars)
        prompt = prompt[cut + 1:]
    return prompt


def target_stage(out: Path, args) -> None:
    """target.gguf and target_report.json, training from (or resuming) target_checkpoint.npz."""
    import jax

    from dflash_jax.chat_template import CHATML
    from dflash_jax.config import EngineConfig
    from dflash_jax.engine.generate import Engine
    from dflash_jax.testing.gguf_writer import write_gguf
    from dflash_jax.training.loop import TrainConfig
    from dflash_jax.training.target_lm import code_target_config, target_trainer, tensors_to_write, to_engine

    cfg = code_target_config(args.hidden, args.layers, args.vocab, args.ffn, args.tie)
    vocab = json.loads((out / "tokenizer.json").read_text())
    tok = bpe_tokenizer(vocab["tokens"], vocab["merges"])
    if tok.vocab_size != cfg.vocab_size:
        raise SystemExit(f"tokenizer.json has {tok.vocab_size} tokens, --vocab is {cfg.vocab_size}")
    tc = TrainConfig(steps=args.target_steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, warmup=0.02,
                     seed=args.seed)
    trained = train_resumable(out, "target", target_trainer(cfg, tc),
                              {"config": [args.hidden, args.layers, args.ffn, args.vocab, args.tie]}, args)
    if trained is None:
        return
    params, history, evaluation = trained
    write_gguf(out / "target.gguf", tensors_to_write(params, cfg), cfg,
               metadata=gguf_metadata(vocab["tokens"], vocab["merges"], CHATML),
               name=f"dflash-jax tiny code target (seed {args.seed})")
    engine = Engine(cfg, to_engine(params, cfg), EngineConfig(mode="ar", max_ctx=256))
    completions = {p: tok.decode(engine.generate(tok.encode(p), 48, tok.stop_ids).tokens) for p in PROMPTS}
    report = {"held_out": evaluation, "history": history, "completions": completions,
              "gguf_bytes": os.path.getsize(out / "target.gguf"), "backend": jax.default_backend()}
    (out / "target_report.json").write_text(json.dumps(report, indent=1))
    log(f"target: held-out loss {evaluation['loss']:.3f}, accuracy {evaluation['acc']:.3f}; target.gguf "
        f"{report['gguf_bytes'] / 1e6:.1f} MB")
    for p, c in completions.items():
        log(f"--- {p!r}\n{p}{c}")


def draft_stage(out: Path, args) -> None:
    """draft/ (the drafter in the z-lab layout) and draft_report.json, trained against target.gguf as written
    (its quantized weights give the greedy labels), from (or resuming) draft_checkpoint.npz."""
    import jax

    from dflash_jax.config import draft_config_to_hf
    from dflash_jax.load import load_target
    from dflash_jax.models import draft as draft_model
    from dflash_jax.tokenizer import load_tokenizer
    from dflash_jax.training.draft_trainer import BlockConfig, draft_config_for, draft_trainer, trained_draft
    from dflash_jax.training.loop import TrainConfig

    target = load_target(out / "target.gguf", progress=False)  # the reference kernels
    tok = load_tokenizer(out / "target.gguf")
    cfg = draft_config_for(target.config, tok.special["<|mask|>"], args.draft_layers, args.block_size, args.taps)
    tc = TrainConfig(steps=args.draft_steps, batch=args.batch, seq_len=args.seq_len, lr=args.draft_lr, warmup=0.04,
                     seed=args.seed)
    bc = BlockConfig(anchors=args.anchors, gamma=7.0 * args.block_size / 16)
    trained = train_resumable(out, "draft", draft_trainer(cfg, target, tc, bc),
                              {"blocks": bc.__dict__, "draft": draft_config_to_hf(cfg)}, args)
    if trained is None:
        return
    params, history, evaluation = trained
    draft_model.write_draft_dir(out / "draft", trained_draft(cfg, params))
    size = os.path.getsize(out / "draft" / "model.safetensors")
    report = {"held_out": evaluation, "history": history, "safetensors_bytes": size,
              "backend": jax.default_backend()}
    (out / "draft_report.json").write_text(json.dumps(report, indent=1))
    log(f"draft: held-out loss {evaluation['loss']:.3f}, slot-1 accuracy {evaluation['acc1']:.3f}, teacher-forced "
        f"acceptance {evaluation['accept']:.2f}; model.safetensors {size / 1e6:.1f} MB")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stage", choices=["corpus", "target", "draft", "all"], default="all")
    ap.add_argument("--roots", nargs="+", default=None, help="directories to take .py files from")
    ap.add_argument("--held_out", type=float, default=0.02)
    ap.add_argument("--max_mb", type=float, default=80.0)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--tie", action=argparse.BooleanOptionalAction, default=True,
                    help="tie the output head to the embedding (keeps target.gguf under 16 MiB)")
    ap.add_argument("--draft_layers", type=int, default=2)
    ap.add_argument("--block_size", type=int, default=16)
    ap.add_argument("--taps", type=int, default=5, help="target layers the drafter reads")
    ap.add_argument("--draft_steps", type=int, default=4000)
    ap.add_argument("--draft_lr", type=float, default=1e-3)
    ap.add_argument("--anchors", type=int, default=32, help="drafter blocks per training sequence")
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--target_steps", type=int, default=1500)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log_every", type=int, default=100)
    ap.add_argument("--eval_every", type=int, default=1000)
    ap.add_argument("--save_every", type=int, default=250)
    ap.add_argument("--time_limit", type=float, default=0,
                    help="seconds from the start; training stops at its next checkpoint after it (rerun to continue)")
    args = ap.parse_args(argv)
    args.deadline = time.monotonic() + args.time_limit if args.time_limit else None
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage in ("corpus", "all") and not (args.out / "test_ids.npy").exists():
        corpus_stage(args.out, args.roots or default_roots(), args.held_out, args.max_mb, args.vocab)
    if args.stage in ("target", "all") and not (args.out / "target_report.json").exists():
        target_stage(args.out, args)
    if args.stage in ("draft", "all") and (args.out / "target.gguf").exists() and \
            not (args.out / "draft_report.json").exists():
        draft_stage(args.out, args)


if __name__ == "__main__":
    main()
