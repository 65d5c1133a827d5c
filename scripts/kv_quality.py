"""Teacher-forced quality of each KV cache type against a float32 KV cache: the mean KL divergence KL(p_f32 || p_type)
of every position's next-token distribution and the top-1 agreement (argmax equal), on one target, over a prompt
set's prompts, token-id files, and long sequences made by concatenating the prompts.

    python scripts/kv_quality.py --out scripts/results/kv_quality.json
    python scripts/kv_quality.py --target tests/fixtures/tiny-qwen35/model-q4_k_m.gguf --sets "" \\
        --ids tests/fixtures/tiny-qwen35/tokens.npy --long 1024 --out fixture.json

With no --target it measures the target shipped in the package on HumanEval's prompts (raw text: it is a code
model). Each sequence is scored as `python -m dflash_jax.score` scores it (the prompt prefilled in chunks, every
position's logits kept), so every position reads the cache as decoding would: the earlier chunks' rows quantized, its
own chunk's rows rounded as the cache will hold them. The reference kernels by default (`--impl pallas` for the
device's). The results file (JSON, with a .txt table beside it) records the device, jax version, date and
command.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchlib import concatenated, environment  # noqa: E402

from dflash_jax.config import IMPLS, KV_TYPES  # noqa: E402


def sequences(tok, sets: list[str], ids: list[str], limit: int, long: int, n_long: int) -> dict[str, list[np.ndarray]]:
    """Token sequences by group: each set's prompts (tokenized raw), each --ids file, and `n_long` sequences of `long`
    tokens made by concatenating all of them in order (cycling when they run short)."""
    from dflash_jax import prompt_sets
    from dflash_jax.score import read_ids

    groups = {}
    for spec in sets:
        name = Path(spec).stem if spec.endswith(".jsonl") else spec
        groups[name] = [np.asarray(tok.encode(text), np.int32) for _, text in prompt_sets.load(spec, limit)]
    for spec in ids:
        groups[Path(spec).stem] = [read_ids(spec, "--ids").astype(np.int32)]
    if long:
        groups[f"long {long}"] = concatenated([s for group in groups.values() for s in group], long, n_long)
    return groups


def divergence(ref: np.ndarray, got: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per position: KL(softmax(ref) || softmax(got)) in nats and whether the argmaxes agree (float64)."""
    lp, lq = (x.astype(np.float64) - np.logaddexp.reduce(x.astype(np.float64), axis=-1, keepdims=True)
              for x in (ref, got))
    return np.sum(np.exp(lp) * (lp - lq), axis=-1), np.argmax(ref, -1) == np.argmax(got, -1)


def split_type(spec: str) -> tuple[str, str]:
    """(K's type, V's type) of a --types entry: a type for both, or K/V (e.g. q8_0/bf16)."""
    k, _, v = spec.partition("/")
    return k, v or k


def measure(model, groups: dict[str, list[np.ndarray]], types: list[str], chunk: int) -> list[dict]:
    """One row per (group, type): mean KLD, top-1 agreement and positions, over every position of the group's
    sequences (and a row per type over all groups)."""
    from dflash_jax.kv_quant import kv_type
    from dflash_jax.score import score

    slots = -(-max(len(s) for g in groups.values() for s in g) // chunk) * chunk  # one compilation per type
    pairs = {t: split_type(t) for t in types}
    kl = {(g, t): [] for g in groups for t in types}
    agree = {(g, t): [] for g in groups for t in types}
    for g, seqs in groups.items():
        for ids in seqs:
            ref = score(model, ids, chunk=chunk, kv_type="f32", slots=slots).logits
            for t in types:
                k, v = pairs[t]
                d, a = divergence(ref, score(model, ids, chunk=chunk, kv_type=k, v_type=v, slots=slots).logits)
                kl[g, t].append(d)
                agree[g, t].append(a)
        print(f"{g}: {len(seqs)} sequences, {sum(map(len, seqs))} tokens", file=sys.stderr, flush=True)

    def row(group, t, d, a):
        bits = sum(kv_type(x).bits for x in pairs[t]) / 2
        return {"group": group, "kv_type": t, "bits": bits, "positions": int(d.size),
                "mean_kld": float(d.mean()), "top1_agreement": float(a.mean())}

    rows = [row(g, t, np.concatenate(kl[g, t]), np.concatenate(agree[g, t])) for g in groups for t in types]
    for t in types:
        rows.append(row("all", t, np.concatenate([x for g in groups for x in kl[g, t]]),
                        np.concatenate([x for g in groups for x in agree[g, t]])))
    return rows


def table(report: dict) -> str:
    """The rows as a text table, after a line naming the run."""
    lines = [f"# {report['device']} ({report['backend']}, impl {report['impl']}), jax {report['jax']}, "
             f"{report['date']}; target {report['target']}; KLD vs f32 KV, nats per position",
             f"# {report['command']}",
             f"{'group':>14} {'kv_type':>10} {'bits':>5} {'positions':>9} {'mean KLD':>10} {'top-1 agree':>11}"]
    for r in report["rows"]:
        lines.append(f"{r['group']:>14} {r['kv_type']:>10} {r['bits']:5g} {r['positions']:9d} "
                     f"{r['mean_kld']:10.2e} {100 * r['top1_agreement']:10.2f}%")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="a qwen35 GGUF or HF directory (default: the shipped target)")
    ap.add_argument("--sets", default="humaneval", help="comma-separated prompt sets: humaneval, or JSONL paths")
    ap.add_argument("--ids", default="", help="comma-separated .npy files of token ids, one sequence each")
    ap.add_argument("--limit", type=int, default=16, help="first N prompts of each set (0: all)")
    ap.add_argument("--long", type=int, default=0, help="also sequences of this many tokens, concatenated prompts")
    ap.add_argument("--n_long", type=int, default=2, help="how many long sequences")
    ap.add_argument("--types", default=",".join(t for t in KV_TYPES if t != "f32"),
                    help="KV types against f32: a type for K and V, or K/V (e.g. q8_0/bf16); comma-separated")
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk (tokens per compiled call)")
    ap.add_argument("--impl", choices=IMPLS, default="reference", help="kernels (pallas: interpret mode on a CPU)")
    ap.add_argument("--out", type=Path, required=True, help="results JSON (a .txt table is written beside it)")
    args = ap.parse_args(argv)
    types = [t for t in args.types.split(",") if t]
    bad = [t for t in types if not all(x in KV_TYPES for x in split_type(t))]
    if bad:
        ap.error(f"--types: {', '.join(bad)} not among {', '.join(KV_TYPES)} (or K/V pairs of them)")

    from dflash_jax import assets
    from dflash_jax.defaults import resolve_kernels
    from dflash_jax.load import load_target, open_target, target_tokenizer

    kcfg = resolve_kernels("ddtree", impl=args.impl)
    opened = open_target(args.target or assets.DEFAULT_TARGET)
    groups = sequences(target_tokenizer(opened), [s for s in args.sets.split(",") if s],
                       [s for s in args.ids.split(",") if s], args.limit, args.long, args.n_long)
    model = load_target(opened, progress=False, kcfg=kcfg)
    target = Path(opened.path).resolve()
    report = {**environment(), "target": str(target.relative_to(ROOT) if target.is_relative_to(ROOT) else target),
              "impl": kcfg.impl,
              "command": " ".join(["python", "scripts/kv_quality.py", *(argv if argv is not None else sys.argv[1:])]),
              "chunk": args.chunk, "groups": {g: [len(s) for s in seqs] for g, seqs in groups.items()},
              "rows": measure(model, groups, types, args.chunk)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".txt").write_text(table(report))
    print(table(report))


if __name__ == "__main__":
    main()
