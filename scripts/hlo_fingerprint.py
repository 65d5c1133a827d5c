"""The lowered computation of the engine's jitted functions on the tiny pair, in a form two checkouts can compare.

    python scripts/hlo_fingerprint.py --out DIR [--compare OTHER_DIR]

Lowers the AR and DDTree steps, the prefill chunk and the drafter's context extension (reference and Pallas
interpret kernels) and writes, per function, its StableHLO with each argument renamed by what it holds rather than
by its position (a weight by a hash of its contents, the other arguments in order) and the main signature sorted,
plus the op counts of the compiled HLO (DIR/summary.json, DIR/NAME.mlir). jit numbers its arguments by their pytree
paths, so a change of how the weights are held (a dict of parameters, then the state of NNX modules) renumbers them
without changing the computation; the canonical text is identical then. With --compare, prints for each function
whether the text and the op counts equal OTHER_DIR's (a run of the same script on another checkout), and exits 1 if
any differs.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_jax.config import EngineConfig, KernelConfig  # noqa: E402
from dflash_jax.engine.generate import Engine  # noqa: E402
from dflash_jax.engine.state import DecodeState  # noqa: E402
from dflash_jax.engine.step import MAX_STOP_IDS  # noqa: E402
from dflash_jax.kernels import REFERENCE  # noqa: E402
from dflash_jax.testing import synthetic  # noqa: E402
from dflash_jax.testing.tiny import tiny_draft_config, tiny_target_config  # noqa: E402

ARG = re.compile(r"%arg(\d+)\b")


def _labels(dynamic_args: list, weight_ids: set[int]) -> list[str]:
    """A name per leaf of the dynamic arguments: w_<hash of contents> for a weight, x<index> for the others."""
    labels, k = [], 0
    for x in jax.tree.leaves(dynamic_args):
        if id(x) in weight_ids:
            a = np.asarray(x)
            labels.append("w_" + hashlib.sha1(a.tobytes() + str((a.shape, a.dtype)).encode()).hexdigest()[:12])
        else:
            labels.append(f"x{k:03d}")
            k += 1
    return labels


def canonical(fn, args: tuple, weights, static: tuple[int, ...] = (), **kwargs) -> tuple[str, dict[str, int]]:
    """(StableHLO text with arguments named by content and the signature sorted, compiled HLO op counts)."""
    lowered = fn.lower(*args, **kwargs)
    labels = _labels([a for i, a in enumerate(args) if i not in static], {id(x) for x in jax.tree.leaves(weights)})
    labels = [labels[i] for i in sorted(lowered._lowering.compile_args["kept_var_idx"])]  # unused ones are dropped
    named = [x for x in labels if x.startswith("w_")]
    assert len(set(named)) == len(named), "two weights with the same contents"
    head, rest = lowered.as_text().split("func.func public @main(", 1)
    main, sep, private = rest.partition("\n  func.func ")  # private functions number their own arguments
    n = len(labels)  # numbers past the arguments are block arguments of nested regions
    main = ARG.sub(lambda m: "%" + (labels[int(m.group(1))] if int(m.group(1)) < n else f"r{int(m.group(1)) - n}"),
                   main)
    signature, body = main.split(") -> (", 1)
    params = re.split(r", (?=%[wx]\w+: )", signature)
    assert len(params) == n, (len(params), n)
    text = re.sub(r"^module @\S+", "module @M", head) + "func.func public @main(" + ", ".join(sorted(params)) + \
        ") -> (" + body + sep + private
    ops = collections.Counter(m.group(1) for m in re.finditer(r"= \S+ (\w[\w-]*)\(", lowered.compile().as_text()))
    return text, dict(sorted(ops.items()))


def fingerprints() -> dict[str, tuple[str, dict[str, int]]]:
    """Every function's canonical text and op counts, for the reference and the Pallas (interpret) kernels."""
    out = {}
    for name, kcfg in (("reference", REFERENCE), ("pallas", KernelConfig(impl="pallas", interpret=True))):
        cfg = tiny_target_config(num_layers=4, vocab_size=2048)
        dcfg = tiny_draft_config(cfg, ("full_attention", "sliding_attention"), block_size=16, sliding_window=8)
        target, draft = synthetic.synthetic_target(cfg, kcfg=kcfg), synthetic.synthetic_draft(dcfg, kcfg=kcfg)
        for mode in ("ar", "ddtree"):
            engine = Engine.from_loaded(target, draft if mode != "ar" else None,
                                        EngineConfig(mode=mode, budget=12, max_ctx=256))
            tstate, dstate = engine._empty_states()
            state = DecodeState(target=tstate, draft=dstate, root=jnp.int32(1), remaining=jnp.int32(10),
                                done=jnp.bool_(False))
            weights = (engine.tweights, engine.dweights)
            out[f"{name}_step_{mode}"] = canonical(
                engine.step, (*weights, state, jnp.full(MAX_STOP_IDS, -1, jnp.int32)), weights)
        tstate, dstate = engine._empty_states()
        out[f"{name}_prefill"] = canonical(
            engine.tsplit.chunk, (engine.tweights, cfg, tstate, jnp.zeros(64, jnp.int32), jnp.int32(40),
                                  engine.drafter.taps, False), engine.tweights, static=(1, 5, 6), kcfg=kcfg)
        out[f"{name}_extend"] = canonical(
            engine.extend, (engine.dweights, dstate, jnp.zeros((64, len(dcfg.target_layer_ids), cfg.hidden_size)),
                            jnp.int32(40)), engine.dweights)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--compare", type=Path, help="another run's --out to compare with")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name, (text, ops) in fingerprints().items():
        (args.out / f"{name}.mlir").write_text(text)
        summary[name] = {"sha1": hashlib.sha1(text.encode()).hexdigest(), "lines": text.count("\n"), "ops": ops}
        print(f"{name:24s} {summary[name]['sha1']}  {summary[name]['lines']:6d} lines  {sum(ops.values()):6d} ops")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.compare is None:
        return 0
    other = json.loads((args.compare / "summary.json").read_text())
    same = True
    for name, s in summary.items():
        text, ops = s["sha1"] == other[name]["sha1"], s["ops"] == other[name]["ops"]
        same &= text and ops
        print(f"{name:24s} text {'identical' if text else 'DIFFERS'}, op counts {'equal' if ops else 'DIFFER'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
