"""Write the tiny model pair shipped in the package (dflash_jax/assets/default/), deterministically from a seed.

    python scripts/make_default_model.py [--out dflash_jax/assets/default] [--seed 0]

A 4-layer Qwen3.5-architecture target (3 Gated DeltaNet layers, 1 gated attention layer, hidden 256) as a Q4_K_M
GGUF with a 512-token byte-level BPE (trained here with `tokenizers` on the fixed corpus below, `qwen35`
pre-tokenizer, Qwen's special tokens and a mask token) and a ChatML template, plus a 2-layer DFlash drafter (block 8)
in the z-lab layout. The weights are random: the pair exists so that `python -m dflash_jax.generate` runs on a fresh
machine with no download; its text is noise and its drafts are rarely accepted. (The trained pair of issue 8
replaces it.)
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_jax.models.draft import write_draft_dir  # noqa: E402
from dflash_jax.testing.gguf_writer import write_gguf  # noqa: E402
from dflash_jax.testing.tiny import (random_draft_tensors, random_gguf_tensors, tiny_draft_config,  # noqa: E402
                                     tiny_target_config)
from dflash_jax.training.bpe import gguf_metadata, train_bpe  # noqa: E402

VOCAB = 512
CORPUS = '''
def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


class Stack:
    """A last-in, first-out stack."""

    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def __len__(self):
        return len(self.items)


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\\n") for line in f]


def count_words(text: str) -> dict[str, int]:
    counts = {}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    return counts


import numpy as np

x = np.zeros((3, 4), dtype=np.float32)
for i in range(len(x)):
    x[i] = np.arange(4) * i
print("The sum of the array is", x.sum())

The quick brown fox jumps over the lazy dog. Hello, world! This is a test of the tokenizer.
A language model predicts the next token; a draft model proposes several tokens and the target checks them.
'''


def make(out: Path, seed: int) -> None:
    """Write target.gguf and draft/ under out."""
    logging.getLogger("gguf").setLevel(logging.WARNING)
    tokens, merges = train_bpe([CORPUS], VOCAB)
    cfg = tiny_target_config(num_layers=4, vocab_size=len(tokens))
    out.mkdir(parents=True, exist_ok=True)
    write_gguf(out / "target.gguf", random_gguf_tensors(cfg, seed), cfg, metadata=gguf_metadata(tokens, merges),
               name=f"dflash-jax default tiny target (random, seed {seed})")
    dcfg = tiny_draft_config(cfg, block_size=8)
    write_draft_dir(out / "draft", dcfg, random_draft_tensors(dcfg, seed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "dflash_jax" / "assets" / "default")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    make(args.out, args.seed)
    sizes = {p.relative_to(args.out).as_posix(): p.stat().st_size for p in sorted(args.out.rglob("*")) if p.is_file()}
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sizes.items()))


if __name__ == "__main__":
    main()
