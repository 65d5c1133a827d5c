"""Model files shipped inside the package: the tiny default pair `python -m dflash_jax.generate` runs without
`--target` (random weights made by `scripts/make_default_model.py`; they show the pipeline, not real text)."""

import os

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DIR = os.path.join(HERE, "default")
DEFAULT_TARGET = os.path.join(DEFAULT_DIR, "target.gguf")
DEFAULT_DRAFT = os.path.join(DEFAULT_DIR, "draft")
