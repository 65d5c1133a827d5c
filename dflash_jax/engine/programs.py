"""Lowered programs kept between processes: a jitted function's StableHLO, exported once per argument signature
(jax.export) into `<folder>/<key>.jaxprog` and called from there by a later process, which then skips tracing and
lowering it (on a GPU most of a warm start: the step's Mosaic GPU kernels take about 0.33 s each to lower).

The key covers what the program depends on: the caller's description of its static configuration, the arguments'
tree and avals, this package's source, jax and jaxlib's versions and the device kind. A stored program lowers to the
module it was exported from, so XLA's persistent cache (`--jit_cache`) finds its executable as well. Anything that
fails to export or load falls back to the function itself, with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jaxlib

SUFFIX = ".jaxprog"
PACKAGES = ("dflash_jax", "pallas_kernels")  # whose sources a stored program depends on


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """sha256 of this package's and the kernels' Python sources (a stored program is stale once any changes)."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _aval(x: Any) -> tuple:
    return tuple(x.shape), str(x.dtype)


def graph_digest(*graphs: Any) -> str:
    """sha256 of nnx graphs' text (their modules' static attributes; about 5 ms for the fixture's 8 layers)."""
    return hashlib.sha256("".join(map(repr, graphs)).encode()).hexdigest()


def program_key(describe: str, treedef: Any, leaves: list) -> str:
    """The file key of a program: its description, argument tree and avals, the sources, jax, jaxlib, the device."""
    device = jax.devices()[0]
    parts = (describe, str(treedef), tuple(map(_aval, leaves)), source_hash(), jax.__version__, jaxlib.__version__,
             device.platform, device.device_kind)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def stored(fn: Callable, describe: str, folder: str | None, donate: tuple[int, ...] = (),
           weights: tuple[int, ...] = (0,)) -> Callable:
    """`fn` (jitted, a function of array pytrees on one device) as a function that keeps each signature's lowered
    program in `folder` and calls it from there; `fn` itself where `folder` is None or empty.

    `donate`: the positional arguments donated, as fn donates them. `weights`: positions whose avals stay fixed for a
    given function (a model's weights), left out of the per-call signature so that a call flattens only the rest.
    `call.lower(*args)` (args may be jax.ShapeDtypeStructs) lowers the program that a call with such arguments runs,
    as `jax.jit(...).lower` does, so that compiling it ahead leaves that call nothing to compile."""
    if not folder:
        return fn
    calls: dict = {}

    def program(args: tuple) -> Callable:
        rest = [a for i, a in enumerate(args) if i not in weights]
        leaves, tree = jax.tree.flatten(rest)
        sig = (len(args), tree, tuple(map(_aval, leaves)))
        if sig not in calls:
            calls[sig] = _program(fn, describe, folder, args, donate)
        return calls[sig]

    def call(*args):
        return program(args)(*args)

    call.lower = lambda *args: program(args).lower(*args)
    return call


def _program(fn: Callable, describe: str, folder: str, args: tuple, donate: tuple[int, ...]) -> Callable:
    """The callable of one signature: the stored program (exported now if not yet in `folder`), or fn on failure."""
    leaves, treedef = jax.tree.flatten(args)
    path = Path(folder) / (program_key(describe, treedef, leaves) + SUFFIX)
    try:
        if path.exists():
            exported, out_tree = _load(path)
        else:
            exported, out_tree = _export(fn, treedef, leaves)
            _save(path, exported, out_tree)
    except Exception as e:  # noqa: BLE001 - a program that cannot be kept is traced as before
        warnings.warn(f"{describe}: the lowered program is not kept ({type(e).__name__}: {e}); tracing it instead",
                      stacklevel=3)
        return fn
    donated = tuple(i for i, leaf in enumerate(_positions(args)) if leaf in donate)
    device = jax.devices()[0]
    # committed in and out: an exported program's results are committed, and a first call with uncommitted
    # arguments would otherwise compile the call once more for the committed ones
    sharding = jax.sharding.SingleDeviceSharding(device)

    def run(*xs):
        return exported.call(*xs)

    run.__name__ = getattr(fn, "__name__", "program")  # reports (--compile_report) name it as the function it is
    flat = jax.jit(run, donate_argnums=donated, in_shardings=sharding, out_shardings=sharding)

    def kept(*args):
        return jax.tree.unflatten(out_tree, flat(*jax.tree.leaves(args)))

    kept.lower = lambda *args: flat.lower(*jax.tree.leaves(args))
    return kept


def _positions(args: tuple) -> list[int]:
    """The positional argument each leaf of args belongs to, in leaf order."""
    return [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]


def _export(fn: Callable, treedef: Any, leaves: list):
    """(exported flat program, output tree) of fn at these arguments."""
    out_tree = []

    def flat(*xs):
        out = fn(*jax.tree.unflatten(treedef, xs))
        out_tree.append(jax.tree.structure(out))
        return jax.tree.leaves(out)

    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    exported = jax.export.export(jax.jit(flat), disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ALL")]
                                 )(*specs)
    return exported, out_tree[0]


def _save(path: Path, exported: Any, out_tree: Any) -> None:
    """Written to a temporary name and renamed, so a concurrent reader sees a whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(pickle.dumps({"exported": bytes(exported.serialize()), "out_tree": out_tree}))
    tmp.replace(path)


def _load(path: Path):
    data = pickle.loads(path.read_bytes())
    return jax.export.deserialize(bytearray(data["exported"])), data["out_tree"]
