"""Acceptance length and decode speed of a target + drafter pair with real speculative decoding: AR, chain, and DDTree
at several budgets, over prompt sets, greedy or sampled (`--temperature`, `--top_p`, `--seed`; `--draft_rule` picks
what a sampled tree is built from), each run checked against AR's tokens.

    python scripts/acceptance.py --target T.gguf --draft DIR --sets humaneval,prompts.jsonl --out results.json

With no --target/--draft it measures the pair shipped in the package. Prompts are raw text (no chat template): the
shipped target is a code model. `--long N` replaces each set by `--n_long` prompts of N tokens made by concatenating
its prompts (contexts long enough for a drafter context bound to matter); `--draft_ctxs` runs chain and the trees at
each of several drafter context bounds (0: the whole context), against one AR reference. Each configuration is
compiled on the first prompt before the timed pass; the results file is rewritten after each configuration, so a run
stopped by --time_limit keeps what it finished.
AL is the mean tokens per decode step over all steps of the set (accepted draft tokens plus the bonus token);
tok/s is decoded tokens over decode time (the first token, from prefill, and the prefill are left out).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchlib import (add_engine_flags, add_pair_flags, concatenated, engine_settings, load_pair,  # noqa: E402
                      pair_paths, sampling_settings)


def configs(budgets: list[int], draft_ctxs: list[int]) -> list[tuple[str, int, int]]:
    """(mode, budget, drafter context bound) triples: AR first (the reference tokens), then per bound chain and
    DDTree per budget."""
    return [("ar", 0, 0)] + [(mode, b, ctx) for ctx in draft_ctxs for mode, b in
                             [("chain", 0)] + [("ddtree", b) for b in budgets]]


def measure(engine, prompts: list[list[int]], n_gen: int, stop_ids: list[int], reference: list[list[int]] | None,
            sampling=None):
    """One configuration over a prompt set: totals, the acceptance histogram, agreement with the reference."""
    from dflash_jax.engine.sampling import GREEDY

    sampling = sampling or GREEDY
    engine.generate(prompts[0], n_gen, stop_ids, sampling=sampling)  # compiles
    steps = tokens = same = 0
    seconds, hist, outputs = 0.0, [0] * (engine.width + 1), []
    for i, ids in enumerate(prompts):
        g = engine.generate(ids, n_gen, stop_ids, sampling=sampling)
        outputs.append(g.tokens)
        steps += g.steps
        tokens += sum(g.accept_lengths)
        seconds += g.decode_s
        for a in g.accept_lengths:
            hist[a] += 1
        same += reference is None or g.tokens == reference[i]
    return outputs, {"steps": steps, "decoded": tokens, "decode_s": seconds, "al": tokens / max(steps, 1),
                     "tok_s": tokens / seconds if seconds else 0.0, "same_as_ar": same, "histogram": hist[1:]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_flags(ap, budgets="4,8,16,22,32")
    ap.add_argument("--out", type=Path, required=True, help="results JSON (a .txt table is written beside it)")
    ap.add_argument("--time_limit", type=float, default=0, help="seconds; no new configuration starts after it")
    ap.add_argument("--long", type=int, default=0, help="prompts of this many tokens, each set's prompts concatenated")
    ap.add_argument("--n_long", type=int, default=4, help="how many --long prompts per set")
    ap.add_argument("--draft_ctxs", default="",
                    help="comma-separated drafter context bounds to run chain and the trees at (0: the whole context; "
                         "default: --draft_ctx alone)")
    add_engine_flags(ap)  # --budget sets the chain's engine; the trees take --budgets
    args = ap.parse_args(argv)

    import jax

    from dflash_jax import prompt_sets
    from dflash_jax.engine.generate import Engine

    t_start = time.monotonic()
    base, kcfg = engine_settings(args)  # as generate resolves its flags
    target, draft, tok = load_pair(args, kcfg)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    draft_ctxs = [int(c) for c in args.draft_ctxs.split(",") if c] or [base.draft_ctx or 0]
    dev = jax.devices()[0]
    report = {**dict(zip(("target", "draft"), pair_paths(args))), "device": getattr(dev, "device_kind", str(dev)),
              "backend": jax.default_backend(), "jax": jax.__version__, "python": platform.python_version(),
              "date": datetime.date.today().isoformat(), "n_gen": args.n_gen, "topk": base.topk,
              "chain_seed": {None: "auto", True: "on", False: "off"}[base.chain_seed], "kv_type": base.kv_type,
              "kv_types": base.kv_types, "kernels": dataclasses.asdict(kcfg), "impl": kcfg.impl,
              "draft_rule": base.draft_rule, "long": args.long,
              "command": " ".join(["python", "scripts/acceptance.py", *(argv if argv is not None else sys.argv[1:])]),
              "sets": {}}
    sampling = sampling_settings(args)
    report["sampling"] = dataclasses.asdict(sampling)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for spec in args.sets.split(","):
        prompts = [tok.encode(text) for _, text in prompt_sets.load(spec, args.limit)]
        if args.long:
            prompts = [p.tolist() for p in concatenated(prompts, args.long, args.n_long)]
        max_ctx = -(-(max(map(len, prompts)) + args.n_gen) // 256) * 256
        name = (Path(spec).stem if spec != "humaneval" else spec) + (f"-{args.long}" if args.long else "")
        rows = report["sets"][name] = {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                                       "results": []}
        reference = None
        for mode, budget, ctx in configs(budgets, draft_ctxs):
            if args.time_limit and time.monotonic() - t_start > args.time_limit:
                print(f"--time_limit: stopping before {name} {mode} {budget}", file=sys.stderr)
                break
            ecfg = dataclasses.replace(base, mode=mode, budget=budget or base.budget, max_ctx=max_ctx,
                                       draft_ctx=ctx or None)
            outputs, r = measure(Engine.from_loaded(target, draft if mode != "ar" else None, ecfg), prompts,
                                 args.n_gen, tok.stop_ids, reference, sampling)
            if mode == "ar":
                reference = outputs
            rows["results"].append({"mode": mode, "budget": budget or None, "draft_ctx": ctx or None, **r})
            print(f"{name:>12} {mode:>6} {budget or '':>3} {ctx or '':>5}  AL {r['al']:5.2f}  {r['tok_s']:8.1f} tok/s  "
                  f"same as AR {r['same_as_ar']}/{len(prompts)}", file=sys.stderr, flush=True)
            args.out.write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".txt").write_text(table(report))
    print(table(report))


def table(report: dict) -> str:
    """The results as a text table: AL and tok/s per set and configuration, with the speedup over AR."""
    sampled = report.get("sampling", {}).get("temperature", 0)
    bounded = any(r.get("draft_ctx") for s in report["sets"].values() for r in s["results"])
    how = (f"temperature {sampled:g}, top-p {report['sampling']['top_p']:g}, seed {report['sampling']['seed']}, "
           f"draft rule {report['draft_rule']}" if sampled else "greedy")
    lines = [f"# {report['device']} ({report['backend']}, impl {report['impl']}), jax {report['jax']}, "
             f"{report['date']}; n_gen {report['n_gen']}, top-K {report['topk']}, chain seed "
             f"{report.get('chain_seed', 'on')}; {how}",
             *([f"# {report['command']}"] if "command" in report else []),
             f"{'set':>12} {'mode':>6} {'budget':>6} {'AL':>6} {'tok/s':>9} {'vs AR':>6} {'same as AR':>11}"
             + (f" {'draft ctx':>9}" if bounded else "")]
    for name, s in report["sets"].items():
        ar = next((r["tok_s"] for r in s["results"] if r["mode"] == "ar"), None)
        for r in s["results"]:
            speed = f"{r['tok_s'] / ar:.2f}x" if ar else "-"
            lines.append(f"{name:>12} {r['mode']:>6} {r['budget'] or '':>6} {r['al']:6.2f} {r['tok_s']:9.1f} "
                         f"{speed:>6} {r['same_as_ar']:>5}/{s['prompts']}"
                         + (f" {'-' if r['mode'] == 'ar' else r.get('draft_ctx') or 'all':>9}" if bounded else ""))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
