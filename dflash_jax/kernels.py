"""The kernel switch: `impl="reference"` runs the plain-jnp paths, `impl="pallas"` the Pallas GPU kernels.

Today the Pallas side covers the quantized matmuls (pallas_kernels/qmatmul.py): with `impl="pallas"` every
Q4_K/Q5_K/Q6_K/Q8_0 matrix is repacked once at load into the kernel layout and `linear` dispatches on that type.
Attention and the gated delta rule still run their jnp references under either impl (issue 5 is open for them);
dense weights stay with XLA's product, which measured faster than the kernel's dense path (README, Kernels).
On a CPU the Pallas kernels run in interpret mode (slow; for tests).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.quant import QTensor
from dflash_jax.quant import linear as reference_linear
from pallas_kernels import qmatmul as qm

IMPLS = ("reference", "pallas")


def default_impl() -> str:
    """`pallas` when JAX runs on a GPU, `reference` otherwise."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def resolve_impl(impl: str) -> str:
    """`auto` -> default_impl(); anything else must be one of IMPLS."""
    if impl == "auto":
        return default_impl()
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of auto, {', '.join(IMPLS)}; got {impl!r}")
    return impl


def prepare_matrices(params: Any, impl: str, skip: tuple[str, ...] = ()) -> Any:
    """The parameter pytree with its quantized matrices in the layout `impl` computes with.

    For `pallas`, each QTensor in a format the kernel streams becomes a PackedWeight (the QTensor is dropped);
    top-level entries named in `skip` (e.g. the embedding table, read by row) are left alone.
    """
    if resolve_impl(impl) == "reference":
        return params
    convert = lambda x: prepare_matrix(x, impl)  # noqa: E731
    is_leaf = lambda x: isinstance(x, QTensor)  # noqa: E731
    return {name: (value if name in skip else jax.tree.map(convert, value, is_leaf=is_leaf))
            for name, value in params.items()}


def prepare_matrix(x: Any, impl: str) -> Any:
    """One tensor in the layout `impl` computes with (a quantized QTensor -> PackedWeight for `pallas`)."""
    if resolve_impl(impl) == "pallas" and isinstance(x, QTensor) and x.fmt in qm.QUANTIZED_FORMATS:
        return qm.pack(x)
    return x


def linear(x: jax.Array, w: Any) -> jax.Array:
    """x [..., in] @ w.T -> float32, for a dense array, a QTensor (reference) or a PackedWeight (Pallas)."""
    if not isinstance(w, qm.PackedWeight):
        return reference_linear(x, w)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    interpret = jax.default_backend() != "gpu"
    parts = [qm.qmatmul(rows[i:i + qm.M_MAX], w, interpret=interpret) for i in range(0, rows.shape[0], qm.M_MAX)]
    out = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
    return out.reshape(*lead, w.shape[0])
