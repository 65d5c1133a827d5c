"""A 4-turn agent-like conversation through the server's worker, with and without the prefix cache (issue 44, item 4).

    python scripts/prefix_cache_bench.py --out scripts/results/prefix_cache_27b_h100.json

The synthetic Qwen3.5-27B pair of scripts/bench.py (exact shapes, random weights; `--model tiny` for a quick run,
also on a CPU), the engine configured by the flags `serve` resolves (benchlib.engine_settings), served by the
server's own Worker: requests queued, streamed back and timed from submission to the first streamed token (TTFT).
Each turn sends the main conversation (a system prompt of --system random token ids, then per turn a user message of
--user ids after the earlier turns and their replies of --reply generated tokens: an ~8K-token history by the fourth
turn) and then a side request with the same system prompt and a user message of --side ids (a sub-agent's task),
which takes the device's state. Requests carry the snapshot points a ChatML-style template gives: the system
prompt's end (where another conversation parts) and the prompt's end (where the next turn does).

Without the cache (`--prefix_cache_gb 0` on serve: only the last request's state is reused) the main conversation
finds the side request's state and prefills its whole history every turn; with it, it continues from the snapshot of
its last reply's end, and the side request from the system prompt's. Printed and written per turn and run: tokens
prefilled, TTFT, and whether the replies of the two runs are equal. `--side 0` leaves the side requests out (then
both runs continue the live state). The results file records device, jax version, date and the command.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import add_engine_flags, engine_settings, environment  # noqa: E402

from dflash_jax.server.request import GenRequest  # noqa: E402
from dflash_jax.server.worker import Worker  # noqa: E402
from dflash_jax.tokenizer import Tokenizer  # noqa: E402


def id_tokenizer(vocab_size: int) -> Tokenizer:
    """A tokenizer for a model without one: each id decodes to its own text `<id>`, and no id ends a reply."""
    return Tokenizer(None, [f"<{i}>".encode() for i in range(vocab_size)], {}, None, None)


async def ask(worker: Worker, request: GenRequest) -> dict:
    """Submit a request and read its stream: the TTFT, the token counts, the reply's text and the cache after it."""
    t0 = time.perf_counter()
    job = worker.submit(request, asyncio.get_running_loop(), "bench")
    ttft, pieces = None, []
    async for piece in job.pieces():
        ttft = time.perf_counter() - t0 if ttft is None else ttft
        pieces.append(piece)
    n, cached = len(request.ids), job.outcome.cached_tokens
    return dict(prompt=n, cached=cached, prefilled=n - cached, ttft_s=ttft, text="".join(pieces),
                cache_snapshots=len(worker.cache), cache_bytes=worker.cache.nbytes)


def reply_ids(text: str) -> list[int]:
    """The ids of an `id_tokenizer` reply's text."""
    return [int(t) for t in text[1:-1].split("><")] if text else []


async def conversation(worker: Worker, args: argparse.Namespace, vocab: int, seed: int = 0) -> list[dict]:
    """The turns of the main conversation and its side requests: one row per request."""
    rng = np.random.default_rng(seed)
    draw = lambda n: rng.integers(0, vocab, n).tolist()  # noqa: E731
    system, rows = draw(args.system), []
    history = list(system)
    for turn in range(1, args.turns + 1):
        history += draw(args.user)
        main = await ask(worker, GenRequest(list(history), args.reply, history=len(history), shared=len(system)))
        rows.append(dict(turn=turn, request="main", **main))
        history += reply_ids(main["text"])
        if args.side:
            side = system + draw(args.side)
            rows.append(dict(turn=turn, request="side", **await ask(
                worker, GenRequest(side, args.side_reply, history=len(side), shared=len(system)))))
    return rows


def run_worker(engine, tok: Tokenizer, cache_bytes: int, args: argparse.Namespace, seed: int = 0) -> list[dict]:
    """One conversation through a fresh worker with a prefix cache of `cache_bytes` (its snapshots go with it)."""
    worker = Worker(engine, tok, max_queue=4, prefix_cache_bytes=cache_bytes)
    try:
        return asyncio.run(conversation(worker, args, tok.vocab_size, seed))
    finally:
        worker.close()
        del worker
        gc.collect()


def table(res: dict) -> str:
    """Per request: tokens prefilled and TTFT without and with the cache."""
    lines = [f"{res['device']}, jax {res['jax']}, {res['date']}: {res['model']} pair, {res['engine']['mode']}, "
             f"prefix cache {res['args']['prefix_cache_gb']:g} GiB",
             f"{'':>20} | {'without cache':^18} | {'with cache':^18} |",
             f"{'turn':>4} {'request':>7} {'prompt':>7} | {'prefilled':>9} {'ttft ms':>8} | {'prefilled':>9} "
             f"{'ttft ms':>8} | same reply"]
    for off, on in zip(res["without_cache"], res["with_cache"]):
        lines.append(f"{off['turn']:>4} {off['request']:>7} {off['prompt']:>7} | {off['prefilled']:>9} "
                     f"{1e3 * off['ttft_s']:>8.1f} | {on['prefilled']:>9} {1e3 * on['ttft_s']:>8.1f} | "
                     f"{on['same_reply']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", choices=["27b", "tiny"], default="27b")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=6144, help="system prompt tokens")
    ap.add_argument("--user", type=int, default=384, help="tokens of each user message of the main conversation")
    ap.add_argument("--reply", type=int, default=64, help="tokens of each main reply")
    ap.add_argument("--side", type=int, default=256, help="user tokens of each side request (0: none)")
    ap.add_argument("--side_reply", type=int, default=16)
    ap.add_argument("--max_ctx", type=int, default=8192)
    ap.add_argument("--prefix_cache_gb", type=float, default=4.0, help="the cache's budget in the run with it")
    add_engine_flags(ap)
    args = ap.parse_args(argv)
    longest = args.system + args.turns * args.user + (args.turns - 1) * args.reply
    if longest + args.reply > args.max_ctx:
        ap.error(f"the last turn's {longest} prompt tokens + {args.reply} do not fit --max_ctx {args.max_ctx}")
    return args


def main(argv: list[str] | None = None) -> None:
    import bench

    from dflash_jax.engine.generate import Engine

    args = parse_args(argv)
    ecfg, kcfg = engine_settings(args)
    target, draft, info = bench.make_models(args.model, kcfg, log=lambda msg: None)
    engine = Engine.from_loaded(target, None if ecfg.mode == "ar" else draft, ecfg)
    tok = id_tokenizer(target.config.vocab_size)
    command = ["python", "scripts/prefix_cache_bench.py", *(sys.argv[1:] if argv is None else argv)]
    res = {**environment(), "command": " ".join(command),
           "model": args.model, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "engine": dataclasses.asdict(ecfg), "kernels": dataclasses.asdict(kcfg), "models": info,
           "state_bytes": engine.state_bytes()}
    # compile everything the timed runs use (prefill, step, snapshot and restore copies) on a short conversation
    short = argparse.Namespace(**{**vars(args), "turns": 2, "system": 96, "user": 16, "reply": 4, "side": 8,
                                  "side_reply": 2})
    for cache_bytes in (0, int(args.prefix_cache_gb * 2**30)):
        run_worker(engine, tok, cache_bytes, short, seed=1)
    res["without_cache"] = run_worker(engine, tok, 0, args)
    res["with_cache"] = run_worker(engine, tok, int(args.prefix_cache_gb * 2**30), args)
    for off, on in zip(res["without_cache"], res["with_cache"]):
        on["same_reply"] = off.pop("text") == on.pop("text")
    summary = table(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=float))
    args.out.with_suffix(".txt").write_text(summary + "\n")
    print(summary)


if __name__ == "__main__":
    main()
