"""Budget research: acceptance length, step time and tokens/s over DDTree budget x top-K x chain seed, a fitted
verify-cost model (verify time vs tree size), a table and a PNG plot (issue 7).

    python scripts/budget_sweep.py --out scripts/results/budget_sweep_tiny_cpu.json --sets humaneval --limit 8
    python scripts/budget_sweep.py --synthetic 27b --error_rate 0.12 --out scripts/results/budget_sweep_27b_h100.json

A real pair (`--target`/`--draft`, default the shipped one) is measured with real speculative decoding over prompt
sets, every output checked against AR's. `--synthetic 27b` (or `tiny`) measures the synthetic full-size pair of
scripts/bench.py in forced-acceptance mode: the drafter runs for its cost and proposes the target's own greedy
continuation with errors at `--error_rate` (the true token at rank 2 or 3), so AL there shows how the tree's shape
catches those errors, not what a trained drafter would reach. The verify of N = budget + 1 nodes is also timed
alone for every budget and fitted by least squares as a line in N and as a line in the row tile the products pad
N to (benchlib.fit_verify_cost).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import add_engine_flags, engine_settings, environment, fit_verify_cost  # noqa: E402


def plot(report: dict, path: Path) -> None:
    """AL, tokens/s and verify time vs budget, one line per (top-K, chain seed), into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    rows = report["results"]
    for topk, seed in sorted({(r["topk"], r["chain_seed"]) for r in rows}):
        sel = sorted((r for r in rows if r["topk"] == topk and r["chain_seed"] == seed), key=lambda r: r["budget"])
        label = f"top-K {topk}, chain seed {'on' if seed else 'off'}"
        axes[0].plot([r["budget"] for r in sel], [r["al"] for r in sel], "o-", label=label)
        axes[1].plot([r["budget"] for r in sel], [r["tok_s"] for r in sel], "o-", label=label)
    if report.get("ar_tok_s"):
        axes[1].axhline(report["ar_tok_s"], color="gray", ls="--", label="AR")
    pts = report["verify_ms"]
    fit = report["verify_fit"]["n"]
    ns = np.array(sorted(int(n) for n in pts))
    axes[2].plot(ns, [pts[str(n)] for n in ns], "o", label="verify, measured")
    axes[2].plot(ns, fit["a_ms"] + fit["b_ms"] * ns, "-", label=f"fit {fit['a_ms']:.2f} + {fit['b_ms']:.3f} N ms")
    if report.get("ar_step_ms"):
        axes[2].axhline(report["ar_step_ms"], color="gray", ls="--", label="AR step")
    for ax, (x, y) in zip(axes, [("budget", "acceptance length"), ("budget", "tokens/s"),
                                 ("tree nodes N (budget + 1)", "verify ms")]):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(report["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verify_fit_line(fit: dict) -> str:
    """Both verify-cost models in one line."""
    n, tile = fit["n"], fit["tile"]
    return (f"verify(N) = {n['a_ms']:.3f} + {n['b_ms']:.4f} N ms (largest residual {100 * n['max_rel_residual']:.1f} "
            f"%), = {tile['a_ms']:.3f} + {tile['b_ms']:.4f} tile(N) ms ({100 * tile['max_rel_residual']:.1f} %)")


def table(report: dict) -> str:
    """The sweep as a text table, and the fitted verify cost."""
    lines = [f"# {report['title']}",
             f"{'budget':>6} {'top-K':>5} {'seed':>5} {'AL':>6} {'step ms':>8} {'tok/s':>8} {'vs AR':>6}"]
    for r in sorted(report["results"], key=lambda r: (r["topk"], not r["chain_seed"], r["budget"])):
        vs = f"{r['tok_s'] / report['ar_tok_s']:.2f}x" if report.get("ar_tok_s") else "-"
        lines.append(f"{r['budget']:>6} {r['topk']:>5} {'on' if r['chain_seed'] else 'off':>5} {r['al']:6.2f} "
                     f"{r['step_ms']:8.2f} {r['tok_s']:8.1f} {vs:>6}")
    lines.append(verify_fit_line(report["verify_fit"]) + f"; AR step {report.get('ar_step_ms', 0):.2f} ms")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="results JSON; a .txt table and a .png plot beside it")
    ap.add_argument("--target", default=None, help="default: the shipped pair")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--synthetic", choices=["27b", "tiny"], default=None, help="forced acceptance on a synthetic pair")
    ap.add_argument("--error_rate", type=float, default=0.12, help="forced mode's error rate")
    ap.add_argument("--sets", default="humaneval", help="prompt sets (real pair): humaneval, gsm8k, math500, JSONL")
    ap.add_argument("--limit", type=int, default=8, help="first N prompts of each set (0: all)")
    ap.add_argument("--n_gen", type=int, default=128)
    ap.add_argument("--budgets", default="4,8,16,22,32,48")
    ap.add_argument("--topks", default="4,8")
    ap.add_argument("--chain_seeds", default="on,off")
    ap.add_argument("--iters", type=int, default=10, help="calls per verify timing (median)")
    ap.add_argument("--time_limit", type=float, default=0, help="seconds; no new configuration starts after it")
    ap.add_argument("--from_json", type=Path, default=None,
                    help="rewrite the table and plot of an earlier results file (refitting the verify cost) and exit")
    add_engine_flags(ap)  # the sweep varies budget, top-K and chain seed; the rest is the user's default
    args = ap.parse_args(argv)

    if args.from_json:
        report = json.loads(args.from_json.read_text())
        report["verify_fit"] = fit_verify_cost([(int(n), ms) for n, ms in report["verify_ms"].items()])
        write_outputs(report, args.out)
        return

    import jax

    import bench
    from acceptance import measure

    from dflash_jax import assets, prompt_sets
    from dflash_jax.load import load_draft, load_target
    from dflash_jax.tokenizer import load_tokenizer

    t_start = time.monotonic()
    budgets = [int(b) for b in args.budgets.split(",") if b]
    topks = [int(k) for k in args.topks.split(",") if k]
    seeds = [s.strip() == "on" for s in args.chain_seeds.split(",") if s]
    base, kcfg = engine_settings(args)
    if args.synthetic:
        target, draft, _ = bench.make_models(args.synthetic, kcfg, log=lambda msg: None)
        prompt = np.random.default_rng(0).integers(0, target.config.vocab_size, 512).tolist()
        prompts, stops, name = [prompt], [], f"synthetic {args.synthetic}, forced error rate {args.error_rate}"
        max_ctx = 4096
    else:
        target_path, draft_path = args.target or assets.DEFAULT_TARGET, args.draft or assets.DEFAULT_DRAFT
        target = load_target(target_path, progress=False, kcfg=kcfg)
        draft = load_draft(draft_path, target.config, progress=False, kcfg=kcfg)
        tok = load_tokenizer(target_path)
        prompts = [tok.encode(text) for spec in args.sets.split(",") for _, text in prompt_sets.load(spec, args.limit)]
        stops, name = tok.stop_ids, f"{Path(target_path).name} + {Path(draft_path).name}, {args.sets}"
        max_ctx = -(-(max(map(len, prompts)) + args.n_gen) // 256) * 256
    report = {**environment(), "kernels": dataclasses.asdict(kcfg), "kv_type": base.kv_type, "n_gen": args.n_gen,
              "prompts": len(prompts),
              "title": f"{name}: {len(prompts)} prompt(s), n_gen {args.n_gen}; {jax.devices()[0].device_kind}, jax "
                       f"{jax.__version__}, {time.strftime('%Y-%m-%d')}",
              "results": [], "verify_ms": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        args.out.write_text(json.dumps(report, indent=1))

    base = dataclasses.replace(base, max_ctx=max_ctx)
    ar = bench.engine_for(target, draft, dataclasses.replace(base, mode="ar"))
    reference, r = measure(ar, prompts, args.n_gen, stops, None)
    report.update(ar_tok_s=r["tok_s"], ar_step_ms=1e3 * r["decode_s"] / max(r["steps"], 1))
    for budget, topk, seed in itertools.product(budgets, topks, seeds):
        if args.time_limit and time.monotonic() - t_start > args.time_limit:
            print(f"--time_limit: stopping before budget {budget}, top-K {topk}", file=sys.stderr)
            break
        if topk > budget and topk != topks[0]:
            continue  # a top-K wider than the budget is cut to it: the same tree as a narrower one
        ecfg = dataclasses.replace(base, budget=budget, topk=topk, chain_seed=seed)
        engine = bench.engine_for(target, draft, ecfg, forced=bool(args.synthetic))
        if args.synthetic:
            row, _ = bench.forced_run(engine, draft, prompt, reference[0], args.error_rate, args.n_gen)
            r = dict(al=row["accept_length"], tok_s=row["tokens_per_s"], step_ms=row["ms_per_step"],
                     same_as_ar=int(row["follows_sequence"]))
        else:
            _, m = measure(engine, prompts, args.n_gen, stops, reference)
            r = dict(al=m["al"], tok_s=m["tok_s"], step_ms=1e3 * m["decode_s"] / max(m["steps"], 1),
                     same_as_ar=m["same_as_ar"])
        if str(budget + 1) not in report["verify_ms"]:
            state, _ = engine.start(prompts[0], max_ctx - len(prompts[0]), stops)
            phases = bench.phase_times(engine, state, args.iters, only_verify=True)
            report["verify_ms"][str(budget + 1)] = phases["verify"]
        report["results"].append(dict(budget=budget, topk=topk, chain_seed=seed, **r))
        print(f"budget {budget:>3} top-K {topk} seed {'on' if seed else 'off'}: AL {r['al']:.2f}, "
              f"{r['tok_s']:.1f} tok/s, step {r['step_ms']:.2f} ms", file=sys.stderr, flush=True)
        save()
    report["verify_fit"] = fit_verify_cost([(int(n), ms) for n, ms in report["verify_ms"].items()])
    write_outputs(report, args.out)


def write_outputs(report: dict, out: Path) -> None:
    """The results JSON, its .txt table and .png plot."""
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".txt").write_text(table(report))
    plot(report, out.with_suffix(".png"))
    print(table(report))


if __name__ == "__main__":
    main()
