"""Does speculative decoding emit what AR emits? Each prompt decoded in ar, chain and DDTree at the budgets asked,
greedy or sampled with a seed, and every configuration's tokens compared with AR's.

    python scripts/exactness.py --target T.gguf --draft DIR --sets humaneval --budgets 8,22 \
        --temperature 0.7 --top_p 0.95 --seed 0 --out results.json

With no --target/--draft it checks the pair shipped in the package. Per configuration it prints how many prompts are
identical to AR; for each that is not, the first position where they differ and the margin there: the gap between
the two best logits (greedy) or the two best perturbed scores (sampling: logits / T, filtered, plus the position's
Gumbel noise) of a teacher-forced forward of the prompt and AR's common prefix, and that gap over the largest
|logit| ("rel"); with top_p, also the nucleus's slack (`nucleus_slack`). A divergence at a margin of a few float32
roundings of the logits, or at a nucleus edge that tiny, is a near-tie, which summation order alone can flip; a large
margin with a large slack is a bug.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchlib import (add_engine_flags, add_pair_flags, engine_settings, environment, first_difference,  # noqa: E402
                      load_pair, pair_paths, sampling_settings)


def margin(target, prompt: list[int], common: list[int], sp, kv_types: tuple[str, str], parallel=None) -> dict:
    """The decision margin at the token after prompt + common, with K and V caches of kv_types: top-2 gap of the
    logits or the perturbed scores. `parallel`: the ParallelConfig a sharded target was split for (default: one
    device)."""
    import jax.numpy as jnp

    from dflash_jax.config import SINGLE_DEVICE
    from dflash_jax.engine.sampling import gumbel_noise, perturbed_scores
    from dflash_jax.score import score

    ids = np.asarray(prompt + common)
    logits = jnp.asarray(score(target, ids, kv_type=kv_types[0], v_type=kv_types[1],
                               parallel=parallel or SINGLE_DEVICE).logits[-1:])
    scores = logits
    if not sp.greedy:
        noise = gumbel_noise(jnp.uint32(sp.seed), jnp.asarray([len(ids)]), logits.shape[-1])
        scores = perturbed_scores(logits, noise, sp.device())
    top2 = np.sort(np.asarray(scores[0], np.float64))[-2:]
    gap = float(top2[1] - top2[0])
    scale = float(np.max(np.abs(np.asarray(logits))))
    out = {"margin": gap, "rel": gap / scale if scale else float("nan")}
    if not sp.greedy and sp.top_p < 1:
        out["nucleus_slack"] = nucleus_slack(np.asarray(logits[0], np.float64) / sp.temperature, sp.top_p)
    return out


def nucleus_slack(z: np.ndarray, top_p: float) -> float:
    """How near the nucleus's edge was to moving: the least distance between top_p and the cumulative probability
    (descending order) at the token that reaches it or the one before. Where it is tiny, rounding can move a token
    across the edge, which changes the draw even when the perturbed scores are far apart."""
    p = np.exp(np.sort(z)[::-1] - z.max())
    cum = np.cumsum(p / p.sum())
    at = int(np.argmax(cum >= top_p))
    return float(min(abs(cum[i] - top_p) for i in (at - 1, at) if i >= 0))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_flags(ap, budgets="8,22")
    ap.add_argument("--out", type=Path, default=None, help="results JSON")
    add_engine_flags(ap)
    args = ap.parse_args(argv)

    from dflash_jax import prompt_sets
    from dflash_jax.engine.generate import Engine

    sp = sampling_settings(args)
    base, kcfg = engine_settings(args)  # as generate resolves its flags
    target, draft, tok = load_pair(args, kcfg)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    report = {**environment(), **dict(zip(("target", "draft"), pair_paths(args))), "n_gen": args.n_gen,
              "sampling": dataclasses.asdict(sp), "kernels": dataclasses.asdict(kcfg), "kv_type": base.kv_type,
              "command": " ".join(["scripts/exactness.py", *(argv if argv is not None else sys.argv[1:])]),
              "sets": {}}
    lines = [f"# {report['device']} ({report['backend']}), jax {report['jax']}, {report['date']}; "
             f"{sp.describe()}; n_gen {args.n_gen}; {kcfg.describe()}; {base.kv_type} KV cache"]
    for spec in args.sets.split(","):
        prompts = [tok.encode(text) for _, text in prompt_sets.load(spec, args.limit)]
        max_ctx = -(-(max(map(len, prompts)) + args.n_gen) // 256) * 256
        name = Path(spec).stem if spec != "humaneval" else spec
        rows = report["sets"][name] = []
        reference = None
        for mode, budget in [("ar", 0), ("chain", 0)] + [("ddtree", b) for b in budgets]:
            ecfg = dataclasses.replace(base, mode=mode, budget=budget or base.budget, max_ctx=max_ctx)
            engine = Engine.from_loaded(target, draft if mode != "ar" else None, ecfg)
            outputs = [engine.generate(ids, args.n_gen, tok.stop_ids, sampling=sp).tokens for ids in prompts]
            if reference is None:
                reference = outputs
                continue
            diverged = []
            for i, (got, want) in enumerate(zip(outputs, reference)):
                at = first_difference(got, want)
                if at is not None:
                    diverged.append({"prompt": i, "position": at,
                                     **margin(target, prompts[i], want[:at], sp, base.kv_types)})
            label = f"{mode} {budget or ''}".strip()
            rows.append({"mode": mode, "budget": budget or None, "same_as_ar": len(prompts) - len(diverged),
                         "prompts": len(prompts), "diverged": diverged})
            lines.append(f"{name:>10} {label:>10}: {len(prompts) - len(diverged)}/{len(prompts)} identical to AR"
                         + "".join(f"\n{'':>12}prompt {d['prompt']}: differs at token {d['position']}, margin "
                                   f"{d['margin']:.3g} (rel {d['rel']:.2g})"
                                   + (f", nucleus slack {d['nucleus_slack']:.2g}" if "nucleus_slack" in d else "")
                                   for d in diverged))
            print(lines[-1], file=sys.stderr, flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(report, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
