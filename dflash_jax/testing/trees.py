"""Random tree masks for kernel tests."""

from __future__ import annotations

import numpy as np


def random_ancestors(rng: np.random.Generator, n: int) -> np.ndarray:
    """Ancestor-or-self mask [n, n] of a random forest in insertion order: each node's parent is uniform over the
    earlier nodes, or none (a new root)."""
    anc = np.eye(n, dtype=bool)
    for i in range(1, n):
        p = int(rng.integers(-1, i))
        if p >= 0:
            anc[i] |= anc[p]
    return anc
