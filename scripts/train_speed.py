"""Training throughput of a small Qwen3.5-architecture target and of a DFlash drafter on it (issue 8's planning).

    python scripts/train_speed.py --out scripts/results/train_speed_<device>.json

Random tokens (speed does not depend on the values); the first step (compiling) is timed apart from the next ones.
Reports steps/s, sequences/s and tokens/s, parameter counts and peak device memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import environment  # noqa: E402

from dflash_jax.training.draft_trainer import BlockConfig, draft_config_for, draft_trainer  # noqa: E402
from dflash_jax.training.loop import TrainConfig  # noqa: E402
from dflash_jax.training.target_lm import code_target_config, target_trainer, to_engine  # noqa: E402


def timed(trainer, data, steps: int) -> dict:
    params, opt = trainer.init()
    n_params = sum(x.size for x in jax.tree.leaves(params))
    key = jax.random.key(0)
    t0 = time.perf_counter()
    params, opt, m = trainer.step_fn(params, opt, trainer.frozen, jnp.asarray(data[0]), key)
    jax.block_until_ready(m)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(steps):
        params, opt, m = trainer.step_fn(params, opt, trainer.frozen, jnp.asarray(data[(i + 1) % len(data)]), key)
    jax.block_until_ready(m)
    per_step = (time.perf_counter() - t0) / steps
    b, s = data.shape[1:]
    return dict(params=int(n_params), first_step_s=first, step_s=per_step, seq_per_s=b / per_step,
                tokens_per_s=b * s / per_step, loss=float(m["loss"])), params


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--draft_layers", type=int, default=2)
    ap.add_argument("--anchors", type=int, default=64)
    args = ap.parse_args(argv)
    cfg = code_target_config(args.hidden, args.layers, args.vocab, 3 * args.hidden)
    rows = []
    for batch in args.batch:
        data = np.random.default_rng(0).integers(0, args.vocab, (4, batch, args.seq_len)).astype(np.int32)
        tc = TrainConfig(steps=1000, batch=batch, seq_len=args.seq_len)
        r, params = timed(target_trainer(cfg, tc), data, args.steps)
        rows.append(dict(kind="target", batch=batch, seq_len=args.seq_len, **r))
        print(rows[-1], flush=True)
        dcfg = draft_config_for(cfg, args.vocab - 1, layers=args.draft_layers, block_size=16)
        r, _ = timed(draft_trainer(dcfg, cfg, to_engine(params), tc, BlockConfig(anchors=args.anchors)), data,
                     args.steps)
        rows.append(dict(kind="draft", batch=batch, seq_len=args.seq_len, anchors=args.anchors,
                         draft_layers=args.draft_layers, **r))
        print(rows[-1], flush=True)
    stats = jax.devices()[0].memory_stats() or {}
    out = dict(environment(), target=dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab),
               peak_bytes=stats.get("peak_bytes_in_use"), results=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"\n{'kind':7s} {'batch':>5s} {'params':>9s} {'first s':>8s} {'step ms':>8s} {'seq/s':>7s} {'tok/s':>9s}")
    for r in rows:
        print(f"{r['kind']:7s} {r['batch']:5d} {r['params'] / 1e6:8.2f}M {r['first_step_s']:8.1f} "
              f"{r['step_s'] * 1e3:8.1f} {r['seq_per_s']:7.1f} {r['tokens_per_s']:9.0f}")
    print(f"peak device memory {out['peak_bytes'] or 0:,} bytes")


if __name__ == "__main__":
    main()
