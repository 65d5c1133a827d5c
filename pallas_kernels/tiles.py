"""Tile sizes for the Triton backend, whose block dimensions must be powers of two and whose products need 16+."""

from __future__ import annotations


def dot_tile(n: int) -> int:
    """The smallest power of two >= n and >= 16: the padded size of a dimension that enters a product."""
    return max(16, 1 << max(0, (n - 1).bit_length()))
