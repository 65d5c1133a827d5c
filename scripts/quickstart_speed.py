"""The README's quick-start command in DDTree and AR mode, alternated over several rounds (a shared machine's speed
drifts between runs), with the decode rate each run's --stats line reports.

    python scripts/quickstart_speed.py --rounds 4 --budgets default,22 --out scripts/results/quickstart_speed_cpu.json

Each entry of --budgets is a DDTree run per round: `default` is the command as the README gives it (the backend's
default budget), a number adds `--budget N`. The speedups are against AR's runs of the same rounds.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import environment  # noqa: E402

PROMPT = "class Stack:\n    def __init__(self):\n"
STATS_TAG = re.compile(r"^\[([^\]]+)\]", re.M)
STATS = re.compile(r"acceptance length ([\d.]+).*then ([\d.]+) tok/s")


def run(mode: str, budget: str = "default") -> dict:
    """One quick-start run: acceptance length and tok/s after the first step, from --stats."""
    cmd = [sys.executable, "-m", "dflash_jax.generate", "--raw", "--prompt", PROMPT, "--stats", "--mode", mode]
    if budget != "default":
        cmd += ["--budget", budget]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    match = STATS.search(done.stderr)
    if not match:
        raise RuntimeError(f"no --stats line in: {done.stderr[-500:]}")
    return {"accept_length": float(match.group(1)), "tokens_per_s": float(match.group(2)),
            "text_head": done.stdout[:80],
            "settings": STATS_TAG.search(done.stderr).group(1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budgets", default="default", help="comma-separated: default (the backend's) or numbers")
    args = ap.parse_args(argv)
    runs = {"ar": [], **{f"ddtree {b}": [] for b in args.budgets.split(",")}}
    for r in range(args.rounds):
        for name in runs:
            mode, _, budget = name.partition(" ")
            runs[name].append(run(mode, budget or "default"))
            print(f"round {r + 1} {name}: {runs[name][-1]['tokens_per_s']:.1f} tok/s", flush=True)
    med = {name: statistics.median(x["tokens_per_s"] for x in rows) for name, rows in runs.items()}
    speedups = {name: {"per_round": [d["tokens_per_s"] / a["tokens_per_s"] for d, a in zip(rows, runs["ar"])],
                       "of_medians": med[name] / med["ar"]} for name, rows in runs.items() if name != "ar"}
    report = {**environment(), "prompt": PROMPT, "runs": runs, "median_tokens_per_s": med, "speedups": speedups}
    args.out.write_text(json.dumps(report, indent=1))
    print(f"AR {med['ar']:.1f} tok/s")
    for name, s in speedups.items():
        print(f"{name} [{runs[name][0]['settings']}]: {med[name]:.1f} tok/s (AL {runs[name][0]['accept_length']:.2f}), "
              f"{s['of_medians']:.2f}x AR (per round {', '.join(f'{x:.2f}' for x in s['per_round'])})")


if __name__ == "__main__":
    main()
