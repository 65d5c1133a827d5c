"""GPU time of a decode step from a jax.profiler trace: kernel launches, busy and idle time, and the kernels by name.

    python scripts/gpu_step_profile.py --out scripts/results/gpu_step_profile_h100.json [--model 27b] [--modes ar]

Makes the pair as scripts/bench.py does (the synthetic 27B on the device, or `--model tiny`), generates from a
random prompt with each engine and traces `--steps` decode steps after the first. From the GPU streams' events:
the span from the first kernel's start to the last one's end, the time at least one kernel ran (busy), the rest
(idle: the GPU waiting for the host to launch), and each kernel name's launches and time, per step.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import add_engine_flags, engine_settings, environment, gpu_events  # noqa: E402


def is_collective(kernel: str) -> bool:
    """Whether a GPU kernel is a collective between devices (NCCL's kernels, XLA's all-reduce / all-gather)."""
    k = kernel.lower().replace("-", "").replace("_", "")
    return "nccl" in k or "allreduce" in k or "allgather" in k


def summarize(events: list[tuple[str, int, int]], steps: int, top: int = 15) -> dict:
    """Per step: span, busy (the union of the kernels' intervals), idle, launches, and the `top` kernels by time."""
    if not events:
        return {"steps": steps, "kernels": 0}
    ivs = sorted((s, s + d) for _, s, d in events)
    busy, (cur_s, cur_e) = 0, ivs[0]
    for s, e in ivs[1:]:
        if s > cur_e:
            busy, cur_s = busy + cur_e - cur_s, s
        cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = ivs[-1][1] - ivs[0][0]
    time_by, count_by = collections.Counter(), collections.Counter()
    for name, _, d in events:
        time_by[name] += d
        count_by[name] += 1
    per = lambda ns: ns / 1e6 / steps  # noqa: E731  (ns over the trace -> ms per step)
    collective = sum(d for name, _, d in events if is_collective(name))
    return {"steps": steps, "span_ms": per(span), "busy_ms": per(busy), "idle_ms": per(span - busy),
            "collective_ms": per(collective), "launches": len(events) / steps,
            "top": [{"name": n, "ms": per(t), "launches": count_by[n] / steps} for n, t in time_by.most_common(top)]}


def table(report: dict) -> str:
    lines = [f"# {report['device']}, jax {report['jax']}, {report['date']}; model {report['model']}; ms per step"]
    for mode, r in report["modes"].items():
        if not r.get("kernels", 1):
            lines.append(f"{mode}: no GPU kernel events in the trace")
            continue
        lines.append(f"{mode}: span {r['span_ms']:.2f}, busy {r['busy_ms']:.2f}, idle {r['idle_ms']:.2f} "
                     f"({100 * r['idle_ms'] / r['span_ms']:.0f} %), collectives {r['collective_ms']:.2f}, "
                     f"{r['launches']:.0f} launches")
        for k in r["top"]:
            lines.append(f"   {k['name'][:72]:72s} {k['ms']:7.3f} ms  x{k['launches']:5.1f}")
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
    ap.add_argument("--top", type=int, default=15, help="kernel names listed per mode, longest first")
    add_engine_flags(ap)
    args = ap.parse_args(argv)
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
        report["modes"][mode] = summarize(gpu_events(trace_dir), tracer.traced_steps, args.top)
        print(table({**report, "modes": {mode: report["modes"][mode]}}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".txt").write_text(table(report))


if __name__ == "__main__":
    main()
