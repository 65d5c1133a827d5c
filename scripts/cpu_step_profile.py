"""Where the shipped pair's decode step spends its time on a CPU: XLA:CPU's own op timings from a jax.profiler trace.

    python scripts/cpu_step_profile.py --budgets 8,22 --out scripts/results/cpu_step_profile.json

For the AR step and DDTree steps at each budget (chain seed off, as the engine's default is on a CPU at budget 8),
jitted as the engine runs them: wall time per step (median of --steps), then a trace of --steps steps whose op
events, summed over the threads that ran them (XLA:CPU's workers and the caller), are grouped into the target's
matrix products, the drafter's, the vocabulary head (the target's lm_head, used by both) and everything else. Each
product is named by its weight; the table compares the target's products at the step's row count with AR's one row.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import environment  # noqa: E402

from dflash_jax import assets  # noqa: E402
from dflash_jax.defaults import resolve_engine, resolve_kernels  # noqa: E402
from dflash_jax.engine.generate import Engine  # noqa: E402
from dflash_jax.load import load_draft, load_target  # noqa: E402
from dflash_jax.tokenizer import load_tokenizer  # noqa: E402

PROMPT = "class Stack:\n    def __init__(self):\n"
# an HLO instruction: its name, its result shape, and (for a product) the weight parameter among its operands
BOOKKEEPING = re.compile(r"ThunkExecutor|ThreadPool|Threadpool|^end: ")  # executor events, not ops
PRODUCT = re.compile(r"^(ynn_fusion|xnn_fusion|onednn|dot)")  # XLA:CPU's names for matrix products, by library
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]")
# a weight parameter of the step, named by its path in the engine's split weights (tweights, dweights)
WEIGHT = re.compile(r"%(tweights|dweights)__([\w]+?)__\.?\d*[,)]")


def instructions(hlo: str) -> dict[str, tuple[list[int], str | None]]:
    """HLO instruction name -> (result dims, the weight parameter it reads, if any) for the entry computation."""
    out = {}
    for line in hlo.splitlines():
        m = INSTRUCTION.match(line)
        if m and m.group(1) not in out:
            w = WEIGHT.search(line)
            dims = [int(d) for d in m.group(3).split(",") if d]
            out[m.group(1)] = (dims, f"{w.group(1)[0]}:{re.sub('_{3,}', '.', w.group(2)).strip('_')}" if w else None)
    return out


def op_seconds(trace_dir: str) -> collections.Counter:
    """Seconds per XLA:CPU op name over a trace, summed over the threads that ran them (executor events left out)."""
    path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
    totals = collections.Counter()
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):  # the Eigen pool's threads and the caller's, which runs ops too
                continue
            for ev in line.events:
                if not BOOKKEEPING.search(ev.name):
                    totals[ev.name] += ev.duration_ns * 1e-9
    return totals


def profile(engine: Engine, ids: list[int], stop_ids: list[int], steps: int) -> dict:
    """Wall ms per step and op ms per step, grouped, for one engine."""
    state, _ = engine.start(ids, 4 * steps + 8, stop_ids)
    stops = engine.stop_array(stop_ids)
    hlo = engine.step.lower(engine.tweights, engine.dweights, state, stops).compile().as_text()
    for _ in range(2):
        state, _ = engine.step(engine.tweights, engine.dweights, state, stops)
    jax.block_until_ready(state)
    wall = []
    for _ in range(steps):
        t = time.perf_counter()
        state, _ = engine.step(engine.tweights, engine.dweights, state, stops)
        jax.block_until_ready(state)
        wall.append(time.perf_counter() - t)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                state, _ = engine.step(engine.tweights, engine.dweights, state, stops)
            jax.block_until_ready(state)
        ops = op_seconds(trace_dir)
    info = instructions(hlo)
    groups, products = collections.Counter(), collections.Counter()
    for name, secs in ops.items():
        dims, weight = info.get(name, ([], None))
        ms = 1e3 * secs / steps
        if weight is None or not PRODUCT.match(name):
            groups["other ops"] += ms
            continue
        group = "vocabulary head" if weight.endswith("lm_head.weight") else \
            ("target products" if weight.startswith("t:") else "drafter products")
        groups[group] += ms
        products[f"{weight} [{','.join(map(str, dims))}]"] += ms
    return {"wall_ms": 1e3 * statistics.median(wall), "op_ms": dict(groups), "thread_ms": sum(groups.values()),
            "products_ms": dict(sorted(products.items()))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="8,22")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    target = load_target(assets.DEFAULT_TARGET, progress=False, kcfg=resolve_kernels())
    draft = load_draft(assets.DEFAULT_DRAFT, target.config, progress=False, kcfg=target.kcfg)
    tok = load_tokenizer(assets.DEFAULT_TARGET)
    ids = tok.encode(PROMPT)
    runs = {"ar": profile(Engine.from_loaded(target, None, resolve_engine("ar", max_ctx=512)), ids, tok.stop_ids,
                          args.steps)}
    for b in [int(x) for x in args.budgets.split(",") if x]:
        ecfg = resolve_engine("ddtree", budget=b, chain_seed=False, max_ctx=512)
        runs[f"ddtree {b}"] = profile(Engine.from_loaded(target, draft, ecfg), ids, tok.stop_ids, args.steps)
    report = {**environment(), "impl": target.kcfg.impl, "prompt": PROMPT, "steps": args.steps, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".txt").write_text(table(report))
    print(table(report))


def table(report: dict) -> str:
    """Per step: wall ms, op ms by group (both threads), and the target's products at the step's rows vs AR's."""
    runs = report["runs"]
    groups = ["target products", "vocabulary head", "drafter products", "other ops"]
    lines = [f"# the shipped pair's decode step on {report['device']} ({report['backend']}), jax {report['jax']}, "
             f"{report['date']}; ms per step, ops summed over the threads that ran them",
             f"{'step':>10} {'wall':>7} {'ops':>7} " + " ".join(f"{g:>16}" for g in groups)]
    for name, r in runs.items():
        lines.append(f"{name:>10} {r['wall_ms']:7.2f} {r['thread_ms']:7.2f} "
                     + " ".join(f"{r['op_ms'].get(g, 0.0):16.2f}" for g in groups))
    ar = {k.split(" [")[0]: v for k, v in runs["ar"]["products_ms"].items() if k.startswith("t:")}
    for name, r in runs.items():
        if name == "ar":
            continue
        mine = {k.split(" [")[0]: v for k, v in r["products_ms"].items() if k.startswith("t:")}
        both = [w for w in mine if w in ar]
        if both:
            ratio = sum(mine[w] for w in both) / sum(ar[w] for w in both)
            lines.append(f"{name}: the target's {len(both)} products take {ratio:.2f}x their one-row (AR) time")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
