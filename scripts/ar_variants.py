"""The synthetic 27B's AR (or DDTree) decode step under qmatmul kernel options, alternated in one process (one model
build).

    python scripts/ar_variants.py --out ar_variants.json --variants shipped gemv_asm=1 gemv_asm=1,gemv_prefetch=1
    python scripts/ar_variants.py --out tree.json --mode ddtree --variants shipped mma_stages_q4_k=3

A variant is `KEY=VALUE,...` over qmatmul's defaults (keys: gemv_asm, gemv_prefetch, mma_asm, mma_prefetch, int8_x,
int8_block_n, int8_columns, int8_warps, mma_stages_<format>, mma_x_view, mma_tile_math_<format> (f32, bf16x2, f16x2),
mgpu (the Mosaic GPU Q4_K kernel, with `--mgpu-layout`); `shipped` for none). Each
variant's step is compiled once, ahead of time, under its options (jax's caches cleared first, so the kernels are
traced again), and kept; then each round runs every variant in turn: an engine (`--mode`: ar, or ddtree at
`--budget`, whose verify multiplies budget + 1 tokens whatever the random drafter proposes) generates `--n_gen`
tokens after a random prompt `--repeats` times, and the step time is the median over those generations of the
decode time less the first step over the remaining steps.
Also listed: where each variant's greedy continuation first differs from the first variant's (options that change
float32 rounding may part the near-tied logits of random weights), from the compiling generation, whose prefill
ran under the same options. A table is printed last. `--model tiny` runs the same on a tiny random pair (a quick
check, also on a CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import NO_STOPS, engine_for, make_models  # noqa: E402
from benchlib import copy_rate, environment, parse_options, qmatmul_defaults, set_qmatmul_defaults  # noqa: E402

from pallas_kernels import qmatmul as qm  # noqa: E402

def _set_tile(index: int):
    def set_tile(value: int) -> None:
        tiles = list(qm.GEMV_INT8_TILES)
        tiles[index] = value
        qm.GEMV_INT8_TILES = tuple(tiles)
    return set_tile


# what each option key sets in qmatmul (its defaults tables)
SETTERS = {**{f"{kernel}_asm": (lambda v, k=kernel: qm.ASM.__setitem__(k, bool(v))) for kernel in qm.ASM},
           **{f"{kernel}_prefetch": (lambda v, k=kernel: qm.PREFETCH.__setitem__(k, v)) for kernel in qm.PREFETCH},
           "int8_x": lambda v: setattr(qm, "INT8_X", v),
           **{f"int8_{name}": _set_tile(i) for i, name in enumerate(("block_n", "columns", "warps"))},
           **{f"mma_stages_{fmt.lower()}": (lambda v, f=fmt: qm.MMA_STAGES.__setitem__(f, v))
              for fmt in qm.PACKED_FORMATS},
           "mma_x_view": lambda v: setattr(qm, "X_VIEW", bool(v)),
           "mgpu": lambda v: setattr(qm, "MGPU", bool(v)),
           **{f"mma_tile_math_{fmt.lower()}": (lambda v, f=fmt: qm.TILE_MATH.__setitem__(f, v))
              for fmt in qm.TILE_MATH}}


def options(spec: str) -> dict[str, int]:
    """KEY=VALUE options of a variant spec (`shipped`: none)."""
    opts = {} if spec == "shipped" else parse_options(spec)
    unknown = set(opts) - set(SETTERS)
    if unknown:
        raise SystemExit(f"unknown option(s) {', '.join(sorted(unknown))}; the keys are {', '.join(SETTERS)}")
    return opts


class AheadOfTime:
    """A jitted function compiled for the arguments of its first call and kept, immune to jax.clear_caches."""

    def __init__(self, jitted):
        self.jitted, self.compiled = jitted, None

    def __call__(self, *args):
        if self.compiled is None:
            self.compiled = self.jitted.lower(*args).compile()
        return self.compiled(*args)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (None: equal over the shorter)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", choices=["27b", "tiny"], default="27b", help="tiny: a quick check, also on a CPU")
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--mode", choices=["ar", "ddtree"], default="ar")
    ap.add_argument("--budget", type=int, default=22, help="DDTree's tree budget (--mode ddtree)")
    ap.add_argument("--variants", nargs="+", default=["shipped"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="generations timed per variant and round (median)")
    ap.add_argument("--n_gen", type=int, default=128)
    ap.add_argument("--prompt_len", type=int, default=64)
    ap.add_argument("--max_ctx", type=int, default=1024)
    ap.add_argument("--mgpu-layout", action="store_true",
                    help="pack Q4_K weights for the Mosaic GPU kernel too (qmatmul.MGPU_LAYOUT), so that the "
                         "variants mgpu=0 and mgpu=1 compare it with the Triton kernel on the same weights")
    args = ap.parse_args()
    variants = {spec: options(spec) for spec in args.variants}
    shipped = qmatmul_defaults()
    t_start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)  # noqa: E731
    res: dict = {**environment(), "args": vars(args) | {"out": str(args.out)}, "rows": []}
    scale = 1.0 if jax.default_backend() == "gpu" else 0.125
    res["copy_rate"] = copy_rate(scale)
    set_qmatmul_defaults({"MGPU_LAYOUT": args.mgpu_layout})  # at packing; `shipped` puts it back at the end
    target, draft, info = make_models(args.model, args.impl, log)
    floor_ms = 1e3 * info["step_weight_bytes"] / res["copy_rate"]
    log(f"copy rate {res['copy_rate'] / 1e9:.0f} GB/s, models made in {info['make_s']:.0f} s, "
        f"roofline {floor_ms:.2f} ms")
    prompt = np.random.default_rng(0).integers(0, target.config.vocab_size, args.prompt_len).tolist()
    first_tokens: list[int] | None = None
    engines, first = {}, {}
    try:
        for spec, opts in variants.items():
            set_qmatmul_defaults(shipped)
            for key, value in opts.items():
                SETTERS[key](value)
            jax.clear_caches()
            engine = engine_for(target, draft, args.mode, budget=args.budget, max_ctx=args.max_ctx)
            engine.step = AheadOfTime(engine.step)
            t0 = time.perf_counter()
            tokens = engine.generate(prompt, args.n_gen, NO_STOPS).tokens
            first_tokens = first_tokens or tokens
            engines[spec] = engine
            first[spec] = dict(compile_s=time.perf_counter() - t0, parts_at=first_difference(tokens, first_tokens),
                               asm=dict(qm.ASM), prefetch=dict(qm.PREFETCH), int8_x=qm.INT8_X,
                               int8_tiles=qm.GEMV_INT8_TILES, mma_stages=dict(qm.MMA_STAGES),
                               x_view=qm.X_VIEW, tile_math=dict(qm.TILE_MATH), mgpu=qm.MGPU)
            log(f"{spec:32s} compiled and run once in {first[spec]['compile_s']:.0f} s")
    finally:
        set_qmatmul_defaults(shipped)
    for rnd in range(args.rounds):
        for spec, engine in engines.items():
            times, lengths = [], []
            for _ in range(args.repeats):
                gen = engine.generate(prompt, args.n_gen, NO_STOPS)
                times.append(1e3 * (gen.decode_s - gen.first_step_s) / max(gen.steps - 1, 1))
                lengths.append(gen.mean_accept_length)
            step_ms, accept = statistics.median(times), statistics.mean(lengths)
            row = dict(variant=spec, round=rnd + 1, step_ms=step_ms, step_ms_each=times, accept_length=accept,
                       tokens_per_s=accept * 1e3 / step_ms, roofline_fraction=floor_ms / step_ms, **first[spec])
            res["rows"].append(row)
            log(f"{spec:32s} round {rnd + 1}: step {step_ms:.2f} ms ({floor_ms / step_ms:.2f} of roofline)")
            args.out.write_text(json.dumps(res, indent=1, default=float))
    res["copy_rate_after"] = copy_rate(scale)
    args.out.write_text(json.dumps(res, indent=1, default=float))
    print(f"\n# {res['device']}, jax {res['jax']}, {res['date']}; copy rate {res['copy_rate'] / 1e9:.0f} GB/s "
          f"(after: {res['copy_rate_after'] / 1e9:.0f}); roofline {floor_ms:.2f} ms")
    print(f"# {args.mode}" + (f", budget {args.budget}" if args.mode == "ddtree" else ""))
    print(f"{'variant':32s} round  step         AL  tok/s  step/roofline  greedy tokens part at")
    for r in res["rows"]:
        print(f"{r['variant']:32s} {r['round']:5d}  {r['step_ms']:6.2f} ms  {r['accept_length']:5.2f}  "
              f"{r['tokens_per_s']:5.1f}  {r['roofline_fraction']:13.2f}  {r['parts_at']}")


if __name__ == "__main__":
    main()
