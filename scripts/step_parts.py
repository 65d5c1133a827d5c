"""Where a decode step of the shipped tiny pair goes: each part jitted alone (median of 20 calls), on this machine.

    python scripts/step_parts.py --out scripts/results/step_parts_cpu.json

Parts: the AR step (a one-token verify) with the matrices as stored (Q4_K, dequantized at every call) and as
`load_target` prepares them; the drafter's block; the DDTree builder (its top_k behind an optimization barrier:
without it XLA on CPU lowered top_k to a full sort, docs/history.md); the target's verify of 1, 5, 16 and 23 nodes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import environment, median_seconds  # noqa: E402

from dflash_jax import assets  # noqa: E402
from dflash_jax.defaults import resolve_engine, resolve_kernels  # noqa: E402
from dflash_jax.engine import tree as tree_lib  # noqa: E402
from dflash_jax.engine.generate import Engine  # noqa: E402
from dflash_jax.gguf import GGUFModel  # noqa: E402
from dflash_jax.load import load_draft, load_target  # noqa: E402
from dflash_jax.models import target as T  # noqa: E402
from dflash_jax.tokenizer import load_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    target = load_target(assets.DEFAULT_TARGET, progress=False, kcfg=resolve_kernels())
    draft = load_draft(assets.DEFAULT_DRAFT, target.config, progress=False, kcfg=target.kcfg)
    model = GGUFModel(assets.DEFAULT_TARGET)  # the matrices as stored (QTensors), before prepare_matrices
    stored = T.target_from_tensors(model.config, {n: jax.tree.map(jnp.asarray, model.load(n)) for n in model.tensors})
    tok = load_tokenizer(assets.DEFAULT_TARGET)
    engine = Engine.from_loaded(target, draft, resolve_engine("ddtree", budget=22, max_ctx=256))
    state, _ = engine.start(tok.encode("class Stack:\n    def __init__(self):\n"), 64, tok.stop_ids)
    ms = {}

    def part(name, fn, *a):
        ms[name] = 1e3 * median_seconds(jax.jit(fn), *a, iters=20)
        print(f"{name:>40}: {ms[name]:7.2f} ms", flush=True)

    taps = engine.drafter.taps
    for label, params in (("stored", stored), ("prepared", target)):
        part(f"AR step, matrices {label}", lambda s, t, p: T.verify(p, target.config, s, t, jnp.full(1, -1, jnp.int32),
                                                                    taps, target.kcfg)[0],
             state.target, state.root[None], params)
    part("drafter block, 15 rows of head", lambda s, r, p: engine.drafter.propose(draft, s, target, r,
                                                                                  p, 15),
         state.draft, state.root, state.target.length)
    logits = engine.drafter.propose(draft, state.draft, target, state.root, state.target.length, 15)
    part("build_tree 22", lambda r, x: tree_lib.build_tree(r, x, 22, 8, True), state.root, logits)
    nodes = tree_lib.build_tree(state.root, logits, 22, 8, True)
    for n in (1, 5, 16, 23):
        part(f"verify {n} nodes", lambda s, t, pa: T.verify(target, target.config, s, t, pa, taps,
                                                            target.kcfg)[0],
             state.target, nodes.tokens[:n], nodes.parents[:n])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**environment(), "impl": target.kcfg.impl, "ms": ms}, indent=1))


if __name__ == "__main__":
    main()
