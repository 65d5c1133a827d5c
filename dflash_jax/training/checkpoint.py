"""Training checkpoints: a pytree's leaves in one .npz plus JSON metadata, written atomically, read back against a
template of the same structure."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from dflash_jax.errors import InputError


class CheckpointError(InputError):
    """A checkpoint that does not fit what is being resumed."""


def save(path: str, tree: Any, meta: dict[str, Any]) -> None:
    """Write tree's leaves and meta to path (.npz), replacing an older checkpoint only once the new one is whole."""
    leaves = jax.tree.leaves(tree)
    arrays = {f"leaf_{i:05d}": np.asarray(x) for i, x in enumerate(leaves)}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def load(path: str, template: Any) -> tuple[Any, dict[str, Any]]:
    """The tree saved at path, with template's structure, and its meta; CheckpointError if the shapes differ."""
    with np.load(path) as f:
        meta = json.loads(bytes(f["meta"]).decode())
        leaves, treedef = jax.tree.flatten(template)
        names = sorted(k for k in f.files if k.startswith("leaf_"))
        if len(names) != len(leaves):
            raise CheckpointError(f"{path}: {len(names)} arrays, but the model and optimizer have {len(leaves)}")
        out = []
        for name, want in zip(names, leaves):
            got = f[name]
            if got.shape != np.shape(want) or got.dtype != np.asarray(want).dtype:
                raise CheckpointError(f"{path}: {name} is {got.dtype}{list(got.shape)}, expected "
                                      f"{np.asarray(want).dtype}{list(np.shape(want))}")
            out.append(got)
    return jax.tree.unflatten(treedef, out), meta
