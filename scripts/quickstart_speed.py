"""The README's quick-start command in DDTree and AR mode, alternated over several rounds (a shared machine's speed
drifts between runs), with the decode rate each run's --stats line reports.

    python scripts/quickstart_speed.py --rounds 3 --out scripts/results/quickstart_cpu.json
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
STATS = re.compile(r"acceptance length ([\d.]+).*then ([\d.]+) tok/s")


def run(mode: str) -> dict:
    """One quick-start run: acceptance length and tok/s after the first step, from --stats."""
    cmd = [sys.executable, "-m", "dflash_jax.generate", "--raw", "--prompt", PROMPT, "--stats", "--mode", mode]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    match = STATS.search(done.stderr)
    if not match:
        raise RuntimeError(f"no --stats line in: {done.stderr[-500:]}")
    return {"accept_length": float(match.group(1)), "tokens_per_s": float(match.group(2)),
            "text_head": done.stdout[:80]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    runs = {"ddtree": [], "ar": []}
    for r in range(args.rounds):
        for mode in runs:
            runs[mode].append(run(mode))
            print(f"round {r + 1} {mode}: {runs[mode][-1]['tokens_per_s']:.1f} tok/s", flush=True)
    med = {mode: statistics.median(x["tokens_per_s"] for x in rows) for mode, rows in runs.items()}
    per_round = [d["tokens_per_s"] / a["tokens_per_s"] for d, a in zip(runs["ddtree"], runs["ar"])]
    report = {**environment(), "prompt": PROMPT, "runs": runs, "median_tokens_per_s": med,
              "speedup_per_round": per_round, "speedup_of_medians": med["ddtree"] / med["ar"]}
    args.out.write_text(json.dumps(report, indent=1))
    print(f"DDTree {med['ddtree']:.1f} tok/s (AL {runs['ddtree'][0]['accept_length']:.2f}), AR {med['ar']:.1f} tok/s: "
          f"{report['speedup_of_medians']:.2f}x (per round {', '.join(f'{s:.2f}' for s in per_round)})")


if __name__ == "__main__":
    main()
