"""Model files shipped inside the package: the tiny default pair `python -m dflash_jax.generate` runs without
`--target`, a 25M-parameter Python-code target and its 2-layer DFlash drafter, trained by
`scripts/train_tiny_pair.py` (docs/training.md, "The shipped tiny pair")."""

import os

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DIR = os.path.join(HERE, "default")
DEFAULT_TARGET = os.path.join(DEFAULT_DIR, "target.gguf")
DEFAULT_DRAFT = os.path.join(DEFAULT_DIR, "draft")
