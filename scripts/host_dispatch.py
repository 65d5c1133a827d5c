"""Is the decode step bound by the host? The host time to dispatch one step against the device time of one.

    python scripts/host_dispatch.py --out host_dispatch.json [--model 27b|tiny] [--modes ar,ddtree] [--devices N]
        [any engine flag of bench.py]

For each mode it builds the engine as bench.py does (the function the commands build theirs with), prefills a
512-token prompt, and then for 1, 10 and 40 steps dispatched back to back measures the host's time to return from
the calls (`dispatch_ms`, per step) and the time until the last step's state is ready (`total_ms`, per step); last
the engine's own decode loop (one step queued ahead, its tokens read every step; `loop_ms`). Where dispatch_ms
comes close to total_ms, the device waits on the host: the step is as slow as XLA launching its kernels, and fewer
launches (or command buffers holding more of them) make it faster, where faster kernels would not. XLA_FLAGS set
in the environment apply to every program (e.g. `--xla_gpu_enable_command_buffer=` to see the step without CUDA
graphs). With --coordinator, --num_processes and --process_id (as generate's) it runs over the devices of several
processes, e.g. one process per GPU of one host, which launch their devices' kernels each from its own thread;
process 0 reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bench  # noqa: E402
from benchlib import engine_settings, environment  # noqa: E402
from dflash_jax.engine.generate import Engine  # noqa: E402
from dflash_jax.engine.sampling import GREEDY  # noqa: E402
from dflash_jax.multihost import parallel_from_flags  # noqa: E402

CALLS = (1, 10, 40)
PROMPT_LEN = 512


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this script's flags, `modes` a list, and bench.py's flags for the models and the engine)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--modes", default="ar,ddtree", help="decoding modes to time, comma-separated (ar, ddtree)")
    ap.add_argument("--loop_steps", type=int, default=40, help="steps of the engine's own decode loop")
    own, rest = ap.parse_known_args(argv)
    modes = own.modes.split(",")
    if set(modes) - {"ar", "ddtree"}:
        raise SystemExit(f"--modes {own.modes}: give ar, ddtree or both")
    own.modes = modes
    if own.loop_steps < 2:
        raise SystemExit(f"--loop_steps {own.loop_steps}: at least 2 (the first step is not timed)")
    return own, rest


def dispatch_rows(engine: Engine, state, first: int, loop_steps: int) -> dict:
    """dispatch_ms and total_ms per step for each of CALLS steps queued back to back, then the decode loop's ms."""
    stops, params = engine.stop_array([]), engine.tsplit.replicated(GREEDY.device())
    for _ in range(3):  # compiled and warm
        state, out = engine.step(engine.tweights, engine.dweights, state, stops, params)
    jax.block_until_ready((state, out))
    rows = []
    for n in CALLS:
        t0 = time.perf_counter()
        for _ in range(n):
            state, out = engine.step(engine.tweights, engine.dweights, state, stops, params)
        t1 = time.perf_counter()
        jax.block_until_ready((state, out))
        rows.append(dict(steps=n, dispatch_ms=1e3 * (t1 - t0) / n, total_ms=1e3 * (time.perf_counter() - t0) / n))
    gen = engine.decode(state, first, 10 ** 6, (), on_tokens=bench._step_limit(loop_steps))
    return dict(queued=rows, loop_ms=1e3 * (gen.decode_s - gen.first_step_s) / max(gen.steps - 1, 1),
                loop_steps=gen.steps)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, rest = parse_args(argv)
    args = bench.parse_args(["--out", str(own.out)] + rest)
    pcfg = parallel_from_flags(args, "host_dispatch.py", several=True)
    base, kcfg = engine_settings(args)
    for mode in own.modes:  # refused before the models are made
        per_step = 1 if mode == "ar" else base.budget + 1  # tokens a step may commit
        need = PROMPT_LEN + (3 + sum(CALLS) + own.loop_steps) * per_step
        if need > base.max_ctx:
            raise SystemExit(f"--max_ctx {base.max_ctx}: {mode} needs {need} for the prompt and the steps")
    lead = pcfg.process_id == 0  # the process that reports
    target, draft, _ = bench.make_models(args.model, kcfg, print if lead else lambda *_: None, pcfg)
    prompt = np.random.default_rng(0).integers(0, target.config.vocab_size, PROMPT_LEN).tolist()
    res = {**environment(), "argv": argv, "devices": pcfg.devices,
           "processes": pcfg.num_processes, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    for mode in own.modes:
        engine = bench.engine_for(target, draft, dataclasses.replace(base, mode=mode), parallel=pcfg, kcfg=kcfg)
        state, first = engine.start(prompt, engine.ecfg.max_ctx - PROMPT_LEN)
        res[mode] = dict(arguments=len(jax.tree.leaves((engine.tweights, engine.dweights))),
                         **dispatch_rows(engine, state, first, own.loop_steps))
        q = res[mode]["queued"][-1]
        if lead:
            print(f"{mode}: {res[mode]['arguments']} argument arrays; {q['steps']} steps queued: host "
                  f"{q['dispatch_ms']:.2f} ms a step, device {q['total_ms']:.2f}; decode loop "
                  f"{res[mode]['loop_ms']:.2f} ms a step", flush=True)
    if lead:
        own.out.parent.mkdir(parents=True, exist_ok=True)
        own.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
