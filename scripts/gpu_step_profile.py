"""GPU time of a decode step from a jax.profiler trace: kernel launches, busy and idle time, and the kernels by name.

    python scripts/gpu_step_profile.py --out scripts/results/gpu_step_profile_h100.json [--model 27b] [--modes ar]

Makes the pair as scripts/bench.py does (the synthetic 27B on the device, or `--model tiny`), generates from a
random prompt with each engine and traces `--steps` decode steps after the first. From the GPU streams' events:
the span from the first kernel's start to the last one's end, the time at least one kernel ran (busy), the rest
(idle: the GPU waiting for the host to launch), the kernel time of each category (quantized products, delta rule,
attention, conv, collectives, XLA's GEMMs, layout work, other) and each kernel name's launches and time, per step:
every name in the JSON, the `--top` longest printed. `summarize` is also what `bench.py --profile` reports with.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import add_engine_flags, engine_settings, environment, gpu_events  # noqa: E402


# What each kernel of a step is, by its name: the first pattern that matches wins (collectives first: XLA names the
# fusions around an all-reduce after the jax op, `psum_*`); `other` takes the rest (XLA's elementwise and reduction
# fusions, softmax, sampling).
CATEGORIES = (
    ("collectives", None),  # is_collective
    ("quantized products", re.compile(r"^(qmatmul|gemv_int8|gemv_q)")),
    ("delta rule", re.compile(r"^gdn_")),
    ("attention", re.compile(r"^tree_attention")),
    ("conv", re.compile(r"^tree_conv")),
    ("XLA GEMMs", re.compile(r"gemm|cublas|cutlass|nvjet|xmma|gemv|matmul", re.I)),
    ("layout", re.compile(r"transpose|copy|pad|concatenate|memcpy|memset|slice", re.I)),
    ("other", re.compile(r"")),
)


def is_collective(kernel: str) -> bool:
    """Whether a GPU kernel is a collective between devices (NCCL's kernels, XLA's all-reduce / all-gather /
    reduce-scatter / all-to-all / collective-permute, and the fusions XLA names after a jax psum)."""
    k = kernel.lower().replace("-", "").replace("_", "")
    return any(word in k for word in ("nccl", "allreduce", "allgather", "reducescatter", "alltoall",
                                      "collectivepermute", "psum"))


def category(kernel: str) -> str:
    """The CATEGORIES entry a kernel name falls in."""
    if is_collective(kernel):
        return "collectives"
    return next(name for name, pattern in CATEGORIES[1:] if pattern.search(kernel))


def summarize(events: list[tuple[str, int, int]], steps: int) -> dict:
    """Per step (of `steps`, e.g. decode steps or a prefill's 64-token blocks): span, busy (the union of the kernels'
    intervals), idle (span less busy), launches, the kernel time and launches of each category (CATEGORIES, in
    that order; they may add up to more than busy where streams overlap) and of every kernel name, longest first.
    No events (a CPU's trace): {"steps", "kernels": []}."""
    if not events:
        return {"steps": steps, "kernels": []}
    ivs = sorted((s, s + d) for _, s, d in events)
    busy, (cur_s, cur_e) = 0, ivs[0]
    for s, e in ivs[1:]:
        if s > cur_e:
            busy, cur_s = busy + cur_e - cur_s, s
        cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e in ivs) - ivs[0][0]
    time_by, count_by = collections.Counter(), collections.Counter()
    for name, _, d in events:
        time_by[name] += d
        count_by[name] += 1
    per = lambda ns: ns / 1e6 / steps  # noqa: E731  (ns over the trace -> ms per step)
    kernels = [{"name": n, "category": category(n), "ms": per(t), "launches": count_by[n] / steps}
               for n, t in sorted(time_by.items(), key=lambda item: (-item[1], item[0]))]
    cats = {name: {"ms": 0.0, "launches": 0.0} for name, _ in CATEGORIES}
    for k in kernels:
        cats[k["category"]]["ms"] += k["ms"]
        cats[k["category"]]["launches"] += k["launches"]
    return {"steps": steps, "span_ms": per(span), "busy_ms": per(busy), "idle_ms": per(span - busy),
            "collective_ms": cats["collectives"]["ms"], "launches": len(events) / steps, "categories": cats,
            "kernels": kernels}


def profile_lines(label: str, r: dict, top: int = 25, unit: str = "step") -> list[str]:
    """A summary in words: span, busy, idle and launches, the category table (kernel ms and launches a `unit`, share
    of the busy time) and the `top` kernel names by time."""
    if not r["kernels"]:
        return [f"{label}: no GPU kernel events in the trace (a {jax.default_backend()} run has none)"]
    lines = [f"{label}: ms a {unit}: span {r['span_ms']:.2f}, busy {r['busy_ms']:.2f}, idle {r['idle_ms']:.2f} "
             f"({100 * r['idle_ms'] / r['span_ms']:.0f} %), collectives {r['collective_ms']:.2f}, "
             f"{r['launches']:.1f} launches; {r['steps']} {unit}s traced"]
    lines.append(f"   {'category':<20} {'ms':>8} {'launches':>9} {'% busy':>7}")
    busy = r["busy_ms"] or float("inf")  # kernels of no duration: no share
    for name, c in r["categories"].items():
        lines.append(f"   {name:<20} {c['ms']:>8.3f} {c['launches']:>9.1f} {100 * c['ms'] / busy:>7.1f}")
    lines.append(f"   {'idle':<20} {r['idle_ms']:>8.3f}")
    lines.append(f"   the {min(top, len(r['kernels']))} longest of {len(r['kernels'])} kernel names:")
    for k in r["kernels"][:top]:
        lines.append(f"   {k['name'][:72]:72s} {k['ms']:7.3f} ms  x{k['launches']:6.1f}  {k['category']}")
    return lines


# an optimized HLO instruction and the jax op it came from:
# `%loop_add_fusion.170 = ... metadata={op_name="jit(_step)/add"`
_HLO_OP = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = [^\n]*?metadata=\{op_name="([^"]*)"', re.M)


def by_op(kernels: list[dict], hlo: str) -> list[dict]:
    """A mode's kernels (`summarize`'s "kernels") grouped by what made them: the Pallas kernels and the quantized
    products by their category or name, XLA's fusions by the jax op in their metadata in the step's optimized HLO
    text `hlo` (XLA_FLAGS=--xla_dump_to; a trace names fusion `loop_add_fusion.170` `loop_add_fusion_170`), nested
    jit names folded (`jit(_step)/jit(tree_conv)/jit(_pad)/pad` -> `tree_conv/_pad/pad`); a kernel the HLO does not
    name keeps its own. Longest first: {"op", "ms", "launches", "kernels"}."""
    ops = {}
    for name, op in _HLO_OP.findall(hlo):
        ops.setdefault(name, op)
    groups: dict[str, dict] = {}
    for k in kernels:
        if k["category"] == "quantized products":
            op = "quantized products"
        elif k["category"] in ("delta rule", "attention", "conv"):
            op = k["name"]
        else:
            op = ops.get(re.sub(r"_(\d+)$", r".\1", k["name"])) or ops.get(k["name"]) or k["name"]
            op = "/".join(re.sub(r"^jit\((.*)\)$", r"\1", part) for part in op.split("/") if part != "jit(_step)")
        g = groups.setdefault(op, {"op": op, "ms": 0.0, "launches": 0.0, "kernels": 0})
        g["ms"] += k["ms"]
        g["launches"] += k["launches"]
        g["kernels"] += 1
    return sorted(groups.values(), key=lambda g: (-g["ms"], g["op"]))


def op_lines(label: str, groups: list[dict], top: int = 25) -> list[str]:
    """`by_op`'s groups in words, the `top` longest."""
    lines = [f"{label}: kernel ms and launches a step by the jax op that made them"]
    for g in groups[:top]:
        lines.append(f"   {g['op'][:72]:72s} {g['ms']:7.3f} ms  x{g['launches']:6.1f}")
    return lines


def table(report: dict, top: int = 25) -> str:
    """The report's modes in words (`profile_lines`)."""
    lines = [f"# {report['device']}, jax {report['jax']}, {report['date']}; model {report['model']}; ms per step"]
    for mode, r in report["modes"].items():
        lines += profile_lines(mode, r, top)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import bench

    from dflash_jax.profiling import StepTrace

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", choices=["27b", "tiny"], default="27b")
    ap.add_argument("--modes", default="ar,ddtree")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt_len", type=int, default=512)
    ap.add_argument("--max_ctx", type=int, default=4096)
    ap.add_argument("--top", type=int, default=25, help="kernel names printed per mode, longest first (the JSON has "
                    "them all)")
    ap.add_argument("--by_op", nargs=2, metavar=("REPORT", "HLO"), default=None,
                    help="instead of profiling: a written report's (--out JSON) modes' kernels grouped by the jax op "
                         "that made them, from the step's optimized HLO text (by_op)")
    add_engine_flags(ap)
    args = ap.parse_args(argv)
    if args.by_op:
        report, hlo = json.loads(Path(args.by_op[0]).read_text()), Path(args.by_op[1]).read_text()
        for mode in (m for m in args.modes.split(",") if m in report["modes"]):  # the HLO is one mode's step
            print("\n".join(op_lines(mode, by_op(report["modes"][mode]["kernels"], hlo), args.top)))
        return
    base, kcfg = engine_settings(args)  # as generate resolves its flags, for a DDTree (the AR rows share it)
    target, draft, _ = bench.make_models(args.model, kcfg)
    prompt = np.random.default_rng(0).integers(0, target.config.vocab_size, args.prompt_len).tolist()
    report = {**environment(), "model": args.model, "args": vars(args) | {"out": str(args.out)},
              "engine": dataclasses.asdict(base), "kernels": dataclasses.asdict(kcfg), "modes": {}}
    for mode in args.modes.split(","):
        engine = bench.engine_for(target, draft, dataclasses.replace(base, mode=mode))
        engine.generate(prompt, 4, bench.NO_STOPS)  # compile outside the trace
        trace_dir = tempfile.mkdtemp()
        tracer = StepTrace(trace_dir, steps=args.steps)
        engine.generate(prompt, 4 * args.steps + 8, bench.NO_STOPS, on_tokens=tracer)
        tracer.close()
        report["modes"][mode] = summarize(gpu_events(trace_dir), tracer.traced_steps)
        print(table({**report, "modes": {mode: report["modes"][mode]}}, args.top), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".txt").write_text(table(report, args.top))


if __name__ == "__main__":
    main()
