"""Full-size decode benchmark on one device: AR vs chain vs DDTree on a synthetic Qwen3.5-27B Q4_K_M (issue 7).

    python scripts/bench.py --out scripts/results/bench_27b_h100.json [--profile DIR]

In one run: the device-to-device copy rate and the read-stream rate (benchlib.read_rate); the synthetic 27B target
(exact shapes, stock Q4_K_M types) and 1.73B bf16 drafter made on the device (dflash_jax/testing/synthetic.py); AR
tokens/s and time to first token against the weight-streaming roofline (the step's weights read once at the
read-stream rate); per-phase step times (draft, tree build, verify, accept + commit) for each DDTree budget
and the chain, each phase jitted alone (calls queued back to back, median of batches), beside the fused step's time
in the real decode loop; end-to-end tokens/s in forced-acceptance mode (the real drafter runs for its cost, its
proposals replaced by the target's own greedy continuation with errors at a rate calibrated to each acceptance
length); AR and DDTree steps at long
contexts (a committed cache of random keys and values); peak device memory; compile time per jitted function.
The JSON is rewritten after each section (`--time_limit` keeps what finished); a table is printed last.
`--model tiny` runs the same on a tiny random pair (a quick check, also on a CPU).

The engine and kernel configuration come from the flags `generate` takes (--budget, --topk, --chain_seed, --kv_type,
--kv_type_k, --kv_type_v, --draft_ctx, --mgpu; plus --impl and --small_rows), resolved by the same function
(dflash_jax/defaults.py): with no flags the benchmark runs what `generate` runs on this device, for a DDTree. The pair
is laid out once, for the tree modes, and the AR rows run that layout too (every device class lays out ar as it does
the tree modes). Each forced run records
where its tokens first differ from AR's (`differs_from_ar_at`: None where they are equal, speculative decoding's
exactness on the 27B).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import (add_engine_flags, copy_rate, engine_settings, environment, first_difference,  # noqa: E402
                      fit_verify_cost, gpu_events_by_device, memory, memory_accounting, memory_line, read_rate)

from exactness import margin  # noqa: E402
from gpu_step_profile import profile_lines, summarize  # noqa: E402

from dflash_jax import kv_quant as kvq  # noqa: E402
from dflash_jax.config import (MAX_TREE_NODES, PREFILL_BLOCK, SINGLE_DEVICE, EngineConfig, KernelConfig,  # noqa: E402
                               ParallelConfig, check_prefill_chunk)
from dflash_jax.engine import tree as tree_lib  # noqa: E402
from dflash_jax.engine.generate import Engine  # noqa: E402
from dflash_jax.engine.sampling import GREEDY  # noqa: E402
from dflash_jax.engine.state import tree_bytes  # noqa: E402
from dflash_jax.engine.step import emit_width, step_tree  # noqa: E402
from dflash_jax.gguf import tensor_specs  # noqa: E402
from dflash_jax.generate import JIT_CACHE_MIN_COMPILE_S, enable_jit_cache, fit_max_ctx, kv_cache_words  # noqa: E402
from dflash_jax.multihost import add_process_arguments, parallel_from_flags  # noqa: E402
from dflash_jax.parallel import ShardedTarget  # noqa: E402
from dflash_jax.models import target as target_model  # noqa: E402
from dflash_jax.profiling import CompileLog, StepTrace  # noqa: E402
from dflash_jax.testing import synthetic  # noqa: E402
from dflash_jax.testing.oracle import ForcedDrafter  # noqa: E402
from dflash_jax.testing.tiny import tiny_draft_config, tiny_target_config  # noqa: E402

NO_STOPS = ()


# ---------------------------------------------------------------------------------------------------------------
# Models and memory

def make_models(kind: str, kcfg: KernelConfig, log=print, parallel: ParallelConfig = SINGLE_DEVICE):
    """(target, draft, info) for `27b` (synthetic full size) or `tiny`, laid out for `kcfg` as load_target lays out a
    real pair (over `parallel`'s devices, where there are several, a ShardedTarget made straight into its shards as
    load_sharded loads one); info: seconds and bytes (a sharded target's over all its devices, each replicated
    tensor once)."""
    t0 = time.perf_counter()
    stored: dict[str, int] = {}

    def progress(name: str, nbytes: int) -> None:
        stored[name] = nbytes
        if len(stored) % 100 == 0:
            log(f"  {len(stored)} tensors, {sum(stored.values()) / 1e9:.1f} GB")

    if kind == "27b":
        target, draft = synthetic.synthetic_27b(kcfg, on_tensor=progress, parallel=parallel)
    else:
        cfg = tiny_target_config(num_layers=4, vocab_size=2048)  # 3 Gated DeltaNet layers, then attention
        target = (synthetic.synthetic_sharded(cfg, kcfg, parallel, on_tensor=progress) if parallel.devices > 1
                  else synthetic.synthetic_target(cfg, kcfg=kcfg, on_tensor=progress))
        draft = synthetic.synthetic_draft(tiny_draft_config(cfg, block_size=16), kcfg=kcfg)
    weights = target.weights if isinstance(target, ShardedTarget) else target
    jax.block_until_ready((weights, draft))
    # the bytes one decode step streams: every matrix but the embedding table (read by row), in its GGUF size
    specs = tensor_specs(target.config)
    matrices = {n: b for n, b in stored.items() if n != "token_embd.weight" and specs[n].kind != "dense"}
    info = dict(make_s=time.perf_counter() - t0, target_gguf_bytes=sum(stored.values()),
                step_weight_bytes=sum(matrices.values()),
                target_device_bytes=tree_bytes(weights),
                draft_device_bytes=tree_bytes(draft))
    return target, draft, info


def engine_for(target, draft, ecfg: EngineConfig, forced: bool = False, parallel: ParallelConfig = SINGLE_DEVICE,
               kcfg: KernelConfig | None = None) -> Engine:
    """An engine over the loaded pair, as the commands build theirs (Engine.from_loaded: the target split over
    `parallel`'s devices, laid out for `kcfg`, default the target's); forced wraps the drafter in ForcedDrafter
    (params set by `forced_params`)."""
    kcfg = target.kcfg if kcfg is None else kcfg
    engine = Engine.from_loaded(target, None if ecfg.mode == "ar" else draft, ecfg, parallel, kcfg)
    if forced and ecfg.mode != "ar":
        drafter = ForcedDrafter(engine.drafter, target.config.vocab_size)
        return Engine(target.config, target, ecfg, drafter,
                      {"real": draft, "sequence": jnp.zeros(1, jnp.int32), "error_rate": jnp.float32(0)},
                      kcfg=kcfg, parallel=parallel)
    return engine


def forced_params(engine: Engine, draft, prompt_len: int, continuation: list[int], error_rate: float) -> dict:
    """ForcedDrafter params: the continuation at its absolute positions (the first token sits at prompt_len)."""
    seq = np.zeros(engine.ecfg.max_ctx + MAX_TREE_NODES, np.int32)
    seq[prompt_len:prompt_len + len(continuation)] = continuation
    return {"real": draft, "sequence": jnp.asarray(seq), "error_rate": jnp.float32(error_rate)}


# ---------------------------------------------------------------------------------------------------------------
# Timing pieces

def pipelined_seconds(fn, carry, iters: int = 10, batches: int = 3):
    """Seconds per call of carry = fn(carry) with `iters` calls dispatched back to back and one wait at the end
    (median over batches, after a warm-up call): the device time of a call, as in the engine's own loop, where the
    next step is dispatched while one runs; a wait after every call would add the host's dispatch of a function
    with a thousand parameter arrays. Returns (seconds, the last carry)."""
    carry = jax.block_until_ready(fn(carry))
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(iters):
            carry = fn(carry)
        carry = jax.block_until_ready(carry)
        times.append((time.perf_counter() - t0) / iters)
    return float(np.median(times)), carry


def stateless_seconds(fn, *args, iters: int = 10) -> float:
    """pipelined_seconds for a function of fixed arguments (its calls are independent)."""
    return pipelined_seconds(lambda _: fn(*args), None, iters)[0]


def decode_step_ms(engine: Engine, state, first: int, steps: int) -> tuple[float, dict]:
    """Mean ms per step of the engine's own decode loop over `steps` steps after the first (which may compile),
    and the generation's figures."""
    gen = engine.decode(state, first, 10 ** 6, NO_STOPS, on_tokens=_step_limit(steps + 1))
    ms = 1e3 * (gen.decode_s - gen.first_step_s) / max(gen.steps - 1, 1)
    return ms, dict(steps=gen.steps, accept_length=gen.mean_accept_length)


def _step_limit(steps: int):
    """on_tokens that halts the decode loop after `steps` steps (the first call is the prefill's token)."""
    calls = [0]

    def on_tokens(tokens):
        calls[0] += 1
        return calls[0] > steps

    return on_tokens


def phase_times(engine: Engine, state, iters: int, only_verify: bool = False) -> dict:
    """Each phase of one DDTree/chain step jitted alone, in ms: draft, tree build, verify, accept + commit (the
    target's commit and the drafter's context extend). The state is donated and threaded through."""
    tcfg, tp, dp, kcfg = engine.tcfg, engine.tweights, engine.dweights, engine.kcfg
    drafter, ecfg = engine.drafter, engine.ecfg
    width = emit_width(ecfg, drafter.block_size)
    taps = drafter.taps
    # the weights as the step takes them (engine.tweights, engine.dweights), merged into modules at trace time
    target_of, draft_of = (lambda w: nnx.merge(engine.tgraph, w)), (lambda w: nnx.merge(engine.dgraph, w))
    draft_fn = jax.jit(lambda dp, ds, tp, root, pos: drafter.propose(draft_of(dp), ds, target_of(tp), root, pos,
                                                                     width - 1))
    build_fn = jax.jit(functools.partial(step_tree, ecfg))
    verify_fn = jax.jit(lambda tp, ts, tokens, parents: target_model.verify(target_of(tp), tcfg, ts, tokens, parents,
                                                                            taps, kcfg), donate_argnums=(1,))

    def accept_commit(dp, carry, verified, tlogits, tapped, tree):
        ts, ds = carry
        posterior = jnp.argmax(tlogits, axis=-1).astype(jnp.int32)
        accepted = tree_lib.accept(tree, verified.block.anc, posterior, jnp.int32(10 ** 6), jnp.full(8, -1))
        leaf = jnp.argmax(tree.depths).astype(jnp.int32)  # commit the deepest path: the cost of a long acceptance
        ts = target_model.commit(ts, verified, leaf, kcfg)
        path = target_model.path_nodes(verified.block, leaf, width)
        ds = drafter.extend(draft_of(dp), ds, tapped[path], tree.depths[leaf] + 1)
        return (ts, ds), accepted

    commit_fn = jax.jit(accept_commit, donate_argnums=(1,))
    ts, ds, root = state.target, state.draft, state.root
    out = {}
    logits = draft_fn(dp, ds, tp, root, ts.length)
    tree = build_fn(root, logits)
    sec, ts = pipelined_seconds(lambda s: verify_fn(tp, s, tree.tokens, tree.parents)[2], ts, iters)
    out["verify"] = 1e3 * sec
    out["verify_tokens"] = int(tree.tokens.shape[0])
    if only_verify:
        return out
    out["draft"] = 1e3 * stateless_seconds(draft_fn, dp, ds, tp, root, ts.length, iters=iters)
    out["tree"] = 1e3 * stateless_seconds(build_fn, root, logits, iters=iters)
    tlogits, tapped, ts, verified = verify_fn(tp, ts, tree.tokens, tree.parents)
    sec, (ts, ds) = pipelined_seconds(lambda c: commit_fn(dp, c, verified, tlogits, tapped, tree)[0], (ts, ds),
                                      iters)
    out["accept_commit"] = 1e3 * sec
    out["sum"] = out["draft"] + out["tree"] + out["verify"] + out["accept_commit"]
    return out


# Slots of random rows fake_context makes at a time: its only temporaries are one page's float32 rows and their
# quantization (16 MiB of rows for the 27B's 4 KV heads x 256), never a whole cache in float32 (16 GiB for the 27B's
# keys at 256K).
FILL_PAGE = 4096


@functools.partial(jax.jit, static_argnames=("pages", "page"), donate_argnums=0)
def fill_random(cache, key: jax.Array, pages: int, page: int):
    """A stacked cache [layers, slots, ...] (float or blocks, donated) with random rows (normal x 0.5, stored in its
    KV type) at slots 0 .. pages * page - 1 of every layer, written page by page in place. A page that would pass the
    cache's end is written ending at it. An update of a slice, not a scatter: XLA's CPU backend scatters into a
    bfloat16 array through a float32 copy of all of it."""
    rest = cache.shape[2:]

    def body(i, c):
        rows = kvq.stored(jax.random.normal(jax.random.fold_in(key, i), (1, page, *rest), jnp.float32) * 0.5, c)
        at = lambda x: (i // pages, (i % pages) * page) + (0,) * (x.ndim - 2)  # noqa: E731
        return jax.tree.map(lambda x, r: jax.lax.dynamic_update_slice(x, r, at(x)), c, rows)

    return jax.lax.fori_loop(0, cache.shape[0] * pages, body, cache)


def fake_context(state, length: int, seed: int = 0):
    """The decode state (donated) with `length` committed tokens of random keys and values (target and drafter
    caches; a drafter's ring filled whole), for timing long contexts without prefilling them; GDN and conv state stay
    as they were."""
    key = jax.random.key(seed)
    # placed as the engine's own state is: committed over a mesh, uncommitted on one device, where the step compiled
    # ahead (EngineConfig.compile_ahead) was lowered for an uncommitted state and a committed one compiles it again
    committed = any(x.committed for x in jax.tree.leaves(state))

    def rand(x, i, ring=False):  # slots 0..length-1 of each layer (all of a ring's), a page at a time
        n = min(length, x.shape[1]) if ring else length
        if n > x.shape[1]:
            raise ValueError(f"a context of {length} tokens does not fit a cache of {x.shape[1]} slots")
        size = max(1, min(FILL_PAGE, n))
        return fill_random(x, jax.random.fold_in(key, i), pages=-(-n // size), page=size)

    def placed(like):  # the new length where the old one lies (over a mesh, another placement compiles the step again)
        return jax.device_put(jnp.int32(length), like.sharding) if committed else jnp.int32(length)

    t = state.target
    t = dataclasses.replace(t, k=rand(t.k, 0), v=rand(t.v, 1), length=placed(t.length))
    d = state.draft
    if d is not None:
        d = dataclasses.replace(d, k=tuple(rand(x, 2 + 2 * g, ring) for g, (x, ring) in enumerate(zip(d.k, d.rings))),
                                v=tuple(rand(x, 3 + 2 * g, ring) for g, (x, ring) in enumerate(zip(d.v, d.rings))),
                                length=placed(d.length))
    state = dataclasses.replace(state, target=t, draft=d)
    # over a mesh every leaf committed where it lies, as a step's outputs are: a state half committed (the filled
    # caches and the length) and half not (the rest, as `start` left it) compiled the step a second time
    return jax.device_put(state, jax.tree.map(lambda x: x.sharding, state)) if committed else state


# ---------------------------------------------------------------------------------------------------------------
# Sections

def forced_run(engine: Engine, draft, prompt: list[int], sequence: list[int], error_rate: float, n_gen: int,
               realign: int = 5) -> tuple[dict, list[int]]:
    """One forced-acceptance generation: its figures and the sequence it followed. Random weights have near-ties
    that the verify's rounding (which depends on the tree's layout) can break otherwise than AR did; where the run
    leaves the sequence, the sequence is re-anchored on the run's own output and the run repeated (`realign` times)."""
    seq = list(sequence)
    for attempt in range(realign + 1):
        engine.dparams = forced_params(engine, draft, len(prompt), seq, error_rate)
        gen = engine.generate(prompt, n_gen, NO_STOPS)
        follows = gen.tokens == seq[:len(gen.tokens)]
        if attempt == 0:  # speculative decoding's exactness: the first run against AR's own tokens
            first_diff = first_difference(gen.tokens, seq[:len(gen.tokens)])
        if follows or attempt == realign:
            break
        seq = gen.tokens + seq[len(gen.tokens):]
    row = dict(error_rate=error_rate, accept_length=gen.mean_accept_length, tokens_per_s=gen.steady_tokens_per_s,
               steps=gen.steps, ms_per_step=1e3 * (gen.decode_s - gen.first_step_s) / max(gen.steps - 1, 1),
               follows_sequence=follows, realigned=attempt, differs_from_ar_at=first_diff)
    return row, seq


def calibrate(engine: Engine, draft, prompt: list[int], sequence: list[int], al_goal: float, n_gen: int,
              tries: int = 8) -> tuple[dict, list[dict], list[int]]:
    """Bisect the error rate (in log space) until the forced acceptance length is within 5 % of al_goal (AL moves
    in steps as errors come and go, so closer may not exist): the closest row, every try, and the sequence as last
    re-anchored."""
    lo, hi, rate = 1e-4, 0.999, 0.2
    best, rows, seq = None, [], list(sequence)
    for _ in range(tries):
        row, seq = forced_run(engine, draft, prompt, seq, rate, n_gen)
        rows.append(row)
        if best is None or abs(row["accept_length"] - al_goal) < abs(best["accept_length"] - al_goal):
            best = row
        if abs(row["accept_length"] - al_goal) <= 0.05 * al_goal:
            break
        lo, hi = (rate, hi) if row["accept_length"] > al_goal else (lo, rate)
        rate = float(np.sqrt(lo * hi))
    return dict(best, al_goal=al_goal), rows, seq


def oracle_ms(engine: Engine, iters: int) -> float:
    """The forced drafter's own logits (random draws over the vocabulary), which its draft phase includes."""
    from dflash_jax.testing.oracle import oracle_logits

    width = emit_width(engine.ecfg, engine.drafter.block_size)
    fn = jax.jit(lambda seq, pos, rate: oracle_logits(seq, pos, width - 1, engine.tcfg.vocab_size, rate,
                                                      engine.drafter.seed))
    return 1e3 * stateless_seconds(fn, engine.dparams["sequence"], jnp.int32(100), jnp.float32(0.1), iters=iters)


SECTIONS = ("ar", "forced", "long", "steps", "compiled_memory")  # the default run
# on request: prompt lengths x prefill chunk sizes; a fresh process's TTFT with an empty and a warm compilation cache;
# and one such process's own measure (what `ttft` starts)
MORE_SECTIONS = ("prefill", "ttft", "first_token")


def merge(parts: list[str]) -> dict:
    """One results dict from several runs' files, each as FILE:SECTION[+SECTION...] (sections: forced, long,
    steps, memory, prefill, ttft, ...); the first file also gives the device, copy rate, models and AR figures (those
    it has). Step rows of later files replace earlier rows of the same mode and budget, prefill rows those of the same
    chunk and prompt length. Every file is listed under "sources"."""
    out: dict = {}
    rows: dict = {}
    prefill: dict = {}
    for part in parts:
        path, _, names = part.partition(":")
        run = json.loads(Path(path).read_text())
        if not out:
            out = {k: run[k] for k in ("device", "backend", "jax", "python", "date", "model", "copy_rate", "read_rate",
                                       "models", "ar") if k in run}
            out["sources"], out["compile"] = [], {}
        out["sources"].append(dict(file=Path(path).name, date=run["date"], sections=names.split("+"),
                                   ar_tokens_per_s=run.get("ar", {}).get("tokens_per_s"),
                                   copy_rate=run.get("copy_rate")))
        out["compile"][Path(path).name] = run.get("compile", [])
        for name in names.split("+"):
            if name == "steps":
                rows.update({(r["mode"], r["budget"]): r for r in run["steps"]})
                out["step_error_rate"], out["oracle_ms"] = run["step_error_rate"], run.get("oracle_ms")
            elif name == "prefill":
                prefill.update({(r["chunk"], r["prompt_len"]): r for r in run["prefill"]})
            elif name == "memory":
                out["memory_after_max_ctx_runs"] = run["memory_after_max_ctx_runs"]
            elif name == "forced":
                out["forced"], out["forced_tries"] = run["forced"], run["forced_tries"]
            else:
                out[name] = run[name]
    out["steps"] = sorted(rows.values(), key=lambda r: (r["mode"] != "ddtree", r["budget"]))
    if prefill:
        out["prefill"] = [prefill[k] for k in sorted(prefill)]
    out["args"] = {"max_ctx": 4096, "merged": parts}
    return out


def int_list(text: str, flag: str) -> list[int]:
    """A comma-separated list of positive integers, or SystemExit naming the flag."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"{flag} {text!r}: expected comma-separated positive integers")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's flags; unset engine flags take the device class's defaults, as `generate`'s do."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--merge", nargs="+", default=None, metavar="FILE:SECTIONS",
                    help="write one results file from earlier runs' files instead of running (see merge())")
    ap.add_argument("--model", choices=["27b", "tiny"], default="27b")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"any of {', '.join(SECTIONS + MORE_SECTIONS)} (default: {', '.join(SECTIONS)})")
    ap.add_argument("--budgets", default="22,4,8,16,32,48,63")
    ap.add_argument("--chain", action=argparse.BooleanOptionalAction, default=True, help="time the chain too")
    ap.add_argument("--als", default="4,6.14,7.04,8.31,12", help="acceptance lengths for the forced runs")
    ap.add_argument("--forced_budget", type=int, default=None, help="the forced runs' DDTree budget (default: the "
                    "engine's, --budget)")
    ap.add_argument("--step_error_rate", type=float, default=0,
                    help="forced error rate of the per-budget rows (0: the one calibrated for AL 8.31, else 0.1)")
    ap.add_argument("--prompt_len", type=int, default=512)
    ap.add_argument("--n_gen", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed at long contexts")
    ap.add_argument("--iters", type=int, default=10, help="calls per phase timing (median)")
    ap.add_argument("--phases", action=argparse.BooleanOptionalAction, default=True,
                    help="time each steps row's phases, each jitted apart, and the oracle (--no-phases: the fused "
                         "step alone, which skips their compiles, for a quick A/B)")
    ap.add_argument("--max_ctx", type=int, default=4096)
    ap.add_argument("--long", default="4096,32768", help="contexts to time AR and DDTree steps at")
    ap.add_argument("--long_slots", type=int, default=0, metavar="N",
                    help="time every --long context in a cache of N slots, so each mode compiles its programs once "
                         "rather than once per context (default 0: each context its own cache of context + 512)")
    ap.add_argument("--long_phases", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the DDTree step's phases at each long context (each phase compiles alone)")
    ap.add_argument("--devices", default="1", help="local devices to split the target over, tensor-parallel (a count, "
                    "or 'all'), as generate's --devices")
    add_process_arguments(ap)
    ap.add_argument("--profile", default=None, help="write jax.profiler traces into this new folder: 8 AR steps "
                    "(DIR/ar), 8 forced steps of the first tree engine (DIR/ddtree-22), one warm prefill per chunk "
                    "size (DIR/prefill-CHUNK); each summarized per GPU into the JSON's profile and printed")
    ap.add_argument("--prefill_lens", default="512,8192,32768", help="prompt lengths of the prefill section")
    ap.add_argument("--prefill_chunks", default=None,
                    help="prefill chunk sizes of the prefill section, comma-separated multiples of 64 (default: the "
                         "engine's, --prefill_chunk)")
    ap.add_argument("--prefill_calls", type=int, default=3, help="warm calls per prefill row (median)")
    ap.add_argument("--jit_cache", default="", help="JAX's persistent compilation cache for this run, as generate's "
                    "--jit_cache (default: off); the ttft section's processes each get one of their own")
    ap.add_argument("--program_cache", action=argparse.BooleanOptionalAction, default=True,
                    help="keep the lowered step and prefill chunk in --jit_cache's folder where it is on, as "
                         "generate's --program_cache (default: on)")
    ap.add_argument("--jit_cache_min_s", type=float, default=JIT_CACHE_MIN_COMPILE_S,
                    help="programs compiled faster than this are not kept in --jit_cache (default: generate's)")
    ap.add_argument("--ttft_mode", choices=("ar", "ddtree"), default="ar",
                    help="the decoding mode whose time to first token the ttft and first_token sections take (ddtree:"
                         " also the drafter's context and the tree step compile before the first step's tokens)")
    ap.add_argument("--time_limit", type=float, default=0, help="seconds; sections past it are skipped")
    add_engine_flags(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    run(parse_args(argv), argv)


def run(args: argparse.Namespace, argv: list[str]) -> None:
    """The sections `args` asks for (see main); `argv`, the flags `args` came from, are passed on to the processes
    the ttft section starts."""
    if args.merge:
        res = merge(args.merge)
        args.out.write_text(json.dumps(res, indent=1, default=float))
        args.out.with_suffix(".txt").write_text(summary(res) + "\n")
        print(summary(res))
        return
    pcfg = parallel_from_flags(args, "bench.py")  # first: joining other processes precedes any other use of JAX
    clock_at_start = time.time()
    sections = set(args.sections.split(","))
    unknown = sections - set(SECTIONS + MORE_SECTIONS)
    if unknown:
        raise SystemExit(f"--sections: unknown {', '.join(sorted(unknown))} (any of "
                         f"{', '.join(SECTIONS + MORE_SECTIONS)})")
    lens, chunks = int_list(args.prefill_lens, "--prefill_lens"), None
    if args.prefill_chunks is not None:
        chunks = [check_prefill_chunk(c) for c in int_list(args.prefill_chunks, "--prefill_chunks")]
    if args.prefill_calls < 1:
        raise SystemExit(f"--prefill_calls {args.prefill_calls}: at least one warm call is needed")
    if args.long_slots and "long" in sections:
        longest = max(int_list(args.long, "--long"))
        if args.long_slots < longest + 512:
            raise SystemExit(f"--long_slots {args.long_slots}: the longest --long context ({longest}) needs "
                             f"{longest + 512} slots (512 past it for the timed steps' commits)")
    if args.profile and any(Path(args.profile).rglob("*.xplane.pb")):
        raise SystemExit(f"--profile {args.profile}: holds an earlier run's traces, which would be summed with this "
                         "run's: give a new or empty folder")
    t_start = time.perf_counter()
    over = lambda: args.time_limit and time.perf_counter() - t_start > args.time_limit  # noqa: E731
    res: dict = {"model": args.model, "args": vars(args) | {"out": str(args.out)}}

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1, default=float))

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f} s] {msg}", flush=True)

    enable_jit_cache(args.jit_cache, args.jit_cache_min_s)
    compiles = CompileLog().__enter__()
    if "ttft" in sections:  # first: JAX takes most of a GPU's memory in the first process that uses it
        res["ttft"] = cold_ttft(argv, log)
    res = {**environment(), **res}
    if args.profile:
        res["profile"] = {}
    save()
    if sections <= {"ttft"}:
        return finish(res, compiles, save, t_start)
    gpu = jax.default_backend() == "gpu"
    if sections - {"first_token"}:  # a fresh process's time to first token is timed without them
        res["copy_rate"], res["read_rate"] = copy_rate(1.0 if gpu else 0.125), read_rate(4.0 if gpu else 0.125)
        log(f"copy rate {res['copy_rate'] / 1e9:.0f} GB/s (read + write), read stream "
            f"{res['read_rate'] / 1e9:.0f} GB/s")
    base, kcfg = engine_settings(args)  # what `generate` runs with the same flags (a DDTree; AR rows below)
    res["engine"], res["kernels"] = dataclasses.asdict(base), dataclasses.asdict(kcfg)
    log(f"{kcfg.describe()}; {kv_cache_words(base)}, DDTree budget {base.budget}")
    if pcfg.devices > 1 and args.long_phases and "long" in sections:
        raise SystemExit("--devices: a sharded target's long-context step is timed whole (add --no-long_phases); "
                         "timing its phases apart is not implemented")
    res["devices"] = pcfg.devices
    # on several devices made straight into its shards, which every engine of the run shares
    target, draft, info = make_models(args.model, kcfg, log, pcfg)
    build = functools.partial(engine_for, parallel=pcfg, kcfg=kcfg)  # every engine of the run: on --devices
    weights = target.weights if isinstance(target, ShardedTarget) else target
    res["models"] = info | {"memory_after_load": memory(),
                            "accounting": memory_accounting({"target": weights, "drafter": draft})}
    log(f"models made in {info['make_s']:.0f} s: target {info['target_device_bytes'] / 1e9:.2f} GB on device, "
        f"drafter {info['draft_device_bytes'] / 1e9:.2f} GB")
    log(memory_line("after the models", res["models"]["accounting"]))
    save()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, target.config.vocab_size, args.prompt_len).tolist()
    if "first_token" in sections:
        res["first_token"] = first_token(build(target, draft, dataclasses.replace(base, mode=args.ttft_mode)), prompt,
                                         compiles, info["make_s"], clock_at_start)
        log(f"first token: TTFT {res['first_token']['ttft_s']:.2f} s after {info['make_s']:.1f} s of model build")
        save()
    # the weights read once at the read-stream rate
    floor_ms = 1e3 * info["step_weight_bytes"] / res["read_rate"] if "read_rate" in res else None

    # What the compiled steps need beside their arguments (XLA's buffer assignment): the engine's working memory
    if "compiled_memory" in sections:
        res["compiled_memory"] = []
        for ctx in [args.max_ctx] + [int(x) for x in args.long.split(",") if x]:
            for mode in ("ar", "ddtree"):
                engine = build(target, draft, dataclasses.replace(base, mode=mode, max_ctx=ctx))
                state, _ = engine.start(prompt, ctx - len(prompt), NO_STOPS)
                row = dict(context=ctx, mode=mode, state_bytes=tree_bytes(state),
                           **compiled_memory(engine.step, engine.tweights, engine.dweights, state,
                                             engine.stop_array(())))
                res["compiled_memory"].append(row)
                log(f"compiled {mode} step at {ctx}: state {row['state_bytes'] / 2**20:.0f} MiB, temporaries "
                    f"{row['temp_bytes'] / 2**20:.0f} MiB")
                del state
        save()
    if sections & {"ar", "forced", "steps"}:  # the forced runs follow the AR's greedy continuation
        ar = build(target, draft, dataclasses.replace(base, mode="ar"))
        sequence, ar_ms = time_ar(args, ar, prompt, floor_ms, res, log)
        if args.profile:
            res["profile"]["ar"] = trace_decode(ar, prompt, args, log)
        del ar
        save()

    # Forced acceptance at DDTree-22: tokens/s at each acceptance length
    rate_for_steps = args.step_error_rate or 0.1
    if "forced" in sections:
        res["forced"], res["forced_tries"] = [], []
        forced_budget = args.forced_budget or base.budget
        engine = build(target, draft, dataclasses.replace(base, budget=forced_budget), forced=True)
        for goal in [float(a) for a in args.als.split(",") if a]:
            if over():
                break
            row, tries, sequence = calibrate(engine, draft, prompt, sequence, goal, args.n_gen)
            row.update(budget=forced_budget, speedup=row["tokens_per_s"] / res["ar"]["tokens_per_s"])
            res["forced"].append(row)
            res["forced_tries"].append(tries)
            if goal == 8.31 and not args.step_error_rate:
                rate_for_steps = row["error_rate"]
            log(f"forced AL {row['accept_length']:.2f} (goal {goal}): {row['tokens_per_s']:.1f} tok/s, "
                f"{row['speedup']:.2f} x AR, error rate {row['error_rate']:.4f}, {len(tries)} tries")
            save()
        if args.profile:
            engine.dparams = forced_params(engine, draft, len(prompt), sequence, rate_for_steps)
            res["profile"][trace_label(engine)] = trace_decode(engine, prompt, args, log)

    if sections & {"ar", "forced", "steps", "long"}:
        res["memory_after_max_ctx_runs"] = memory()

    # Long contexts: AR and DDTree-22 steps over a committed cache of random keys and values
    if "long" in sections:
        res["long"] = []
        for length in [int(x) for x in args.long.split(",") if x]:
            if over():
                break
            ctx = args.long_slots or length + 512  # room for the timed commits past the faked length
            row = dict(context=length, slots=ctx, budget=base.budget)
            for mode in ("ar", "ddtree"):
                engine = build(target, draft, dataclasses.replace(base, mode=mode, max_ctx=ctx))
                state, first = engine.start(prompt, ctx - len(prompt), NO_STOPS)
                row[f"{mode}_state_bytes"] = tree_bytes(state)
                row[f"{mode}_accounting"] = memory_accounting({"target": weights, "drafter": draft, "state": state})
                log(memory_line(f"with the {mode} state of context {ctx}", row[f"{mode}_accounting"]))
                if mode == "ddtree" and args.long_phases:
                    row["phases_ms"] = phase_times(engine, fake_context(state, length), args.iters)
                    state, first = engine.start(prompt, ctx - len(prompt), NO_STOPS)
                row[f"{mode}_step_ms"], _ = decode_step_ms(engine, fake_context(state, length), first, args.steps)
                del state
            row["memory"] = memory()
            row["ddtree_over_ar"] = row["ddtree_step_ms"] / row["ar_step_ms"]
            res["long"].append(row)
            log(f"context {length}: AR step {row['ar_step_ms']:.2f} ms, DDTree-{base.budget} step "
                f"{row['ddtree_step_ms']:.2f} ms; {row['memory']}")
            save()
    # Per-phase step times for each budget (and the chain), forced at one error rate, beside the fused step
    if "steps" in sections:
        res["steps"], res["step_error_rate"] = [], rate_for_steps
        configs = [("ddtree", int(b)) for b in args.budgets.split(",") if b] + ([("chain", 15)] if args.chain else [])
        for mode, budget in configs:
            if over():
                log("time limit: skipping the remaining budgets")
                break
            engine = build(target, draft, dataclasses.replace(base, mode=mode, budget=budget), forced=True)
            engine.dparams = forced_params(engine, draft, len(prompt), sequence, rate_for_steps)
            if pcfg.devices == 1 and args.phases:  # the phases jitted apart take one device's target
                state, first = engine.start(prompt, args.max_ctx - len(prompt), NO_STOPS)
                phases = phase_times(engine, state, args.iters)
                del state
            else:
                phases = None
            row, _ = forced_run(engine, draft, prompt, sequence, rate_for_steps, args.n_gen)
            if args.profile and not set(res["profile"]) - {"ar"}:  # the first tree engine's steps
                engine.dparams = forced_params(engine, draft, len(prompt), sequence, rate_for_steps)
                res["profile"][trace_label(engine)] = trace_decode(engine, prompt, args, log)
            row = dict(mode=mode, budget=budget, phases_ms=phases, step_ms=row["ms_per_step"],
                       step_over_ar=row["ms_per_step"] / ar_ms, accept_length=row["accept_length"],
                       tokens_per_s=row["tokens_per_s"], follows_sequence=row["follows_sequence"],
                       differs_from_ar_at=row["differs_from_ar_at"])
            if not res["steps"] and phases is not None:
                res["oracle_ms"] = oracle_ms(engine, args.iters)
            diff = row["differs_from_ar_at"]
            if diff is not None:  # a near-tie, or a break of exactness: the top-2 logit gap there tells which
                row["margin_at_difference"] = margin(target, prompt, sequence[:diff], GREEDY, base.kv_types,
                                                      pcfg)
            res["steps"].append(row)
            at = "" if diff is None else f" (top-2 logit gap {row['margin_at_difference']['margin']:.2g})"
            log(f"{mode} {budget}: step {row['step_ms']:.2f} ms ({row['step_over_ar']:.2f} x AR), AL "
                f"{row['accept_length']:.2f}, {row['tokens_per_s']:.1f} tok/s, "
                f"{'equal to AR' if diff is None else f'differs from AR at token {diff}{at}'}" +
                ("" if phases is None else "; phases " +
                 ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if k != "verify_tokens")))
            save()

    # Prefill at each prompt length and chunk size: an AR engine per chunk size, its context fitting the longest
    if "prefill" in sections:
        res["prefill"] = []
        ctx = fit_max_ctx(0, max(lens), 2)
        rows = [(chunk, length) for chunk in chunks or [base.prefill_chunk] for length in lens]
        engine = None
        for chunk, length in rows:
            if over():
                log(f"time limit: skipping {len(rows) - len(res['prefill'])} prefill rows")
                break
            if engine is None or engine.ecfg.prefill_chunk != chunk:
                engine = build(target, draft, dataclasses.replace(base, mode="ar", max_ctx=ctx, prefill_chunk=chunk))
            ids = rng.integers(0, target.config.vocab_size, length).tolist()
            row = time_prefill(engine, ids, args.prefill_calls, compiles)
            res["prefill"].append(row)
            log(prefill_line(row))
            if args.profile and f"prefill-{chunk}" not in res["profile"]:  # the first length of each chunk size
                res["profile"][f"prefill-{chunk}"] = trace_prefill(engine, ids, args, log)
            save()

    finish(res, compiles, save, t_start)


def time_ar(args: argparse.Namespace, ar: Engine, prompt: list[int], floor_ms: float, res: dict,
            log) -> tuple[list[int], float]:
    """AR time to first token (cold: with compiling, then warm) and decode rate against the roofline, into
    res["ar"]; its greedy continuation and step ms."""
    t0 = time.perf_counter()
    gen = ar.generate(prompt, 2, NO_STOPS)
    cold = time.perf_counter() - t0
    gen = ar.generate(prompt, args.n_gen, NO_STOPS)
    ar_ms = 1e3 * (gen.decode_s - gen.first_step_s) / max(gen.steps - 1, 1)
    res["ar"] = dict(ttft_cold_s=cold, ttft_s=gen.prefill_s + gen.first_step_s, prefill_s=gen.prefill_s,
                     prompt_len=args.prompt_len, step_ms=ar_ms, tokens_per_s=gen.steady_tokens_per_s,
                     roofline_ms=floor_ms, roofline_fraction=floor_ms / ar_ms, n_gen=args.n_gen,
                     continuation_head=gen.tokens[:32])
    log(f"AR: {gen.steady_tokens_per_s:.1f} tok/s, step {ar_ms:.2f} ms, roofline {floor_ms:.2f} ms "
        f"({floor_ms / ar_ms:.2f}); TTFT {res['ar']['ttft_s']:.3f} s warm, {cold:.1f} s cold")
    return gen.tokens, ar_ms


def first_generation(engine: Engine, prompt: list[int], compiles: CompileLog):
    """`generate` of the prompt and 2 tokens (prefill, first token, one step), and what compiled during it: the
    differences of compiles.totals() (compiles, trace/lower/compile seconds, persistent-cache hits and requests)."""
    before = compiles.totals()
    gen = engine.generate(prompt, 2, NO_STOPS)
    after = compiles.totals()
    return gen, {k: after[k] - before[k] for k in after}


def time_prefill(engine: Engine, prompt: list[int], calls: int, compiles: CompileLog) -> dict:
    """One prefill row: the prompt through `generate` (prefill, first token, one step: TTFT = prefill + first step, as
    time_ar's) once as it comes (an engine's first call compiles: `first_compiles` and `first_compile_s`, trace +
    lower + compile, say how much), then `calls` times warm (medians); tok/s of the warm prefill; XLA's memory
    analysis of the compiled prefill chunk and the device's memory after the row."""
    gen, compiled = first_generation(engine, prompt, compiles)
    row = dict(chunk=engine.ecfg.prefill_chunk, prompt_len=len(prompt), max_ctx=engine.ecfg.max_ctx, calls=calls,
               first_prefill_s=gen.prefill_s, first_ttft_s=gen.prefill_s + gen.first_step_s,
               first_compiles=compiled["compiles"],
               first_compile_s=compiled["trace_s"] + compiled["lower_s"] + compiled["compile_s"])
    warm = []
    for _ in range(calls):
        gen = None  # the last state freed before the next is made, as in a user's process
        gen = engine.generate(prompt, 2, NO_STOPS)
        warm.append((gen.prefill_s, gen.prefill_s + gen.first_step_s))
    row["prefill_s"], row["ttft_s"] = (float(x) for x in np.median(warm, axis=0))
    row["tokens_per_s"] = len(prompt) / row["prefill_s"]
    # the compiled chunk of the engine's prefill (the program its calls ran, found in jax's cache: no compile)
    split, chunk = engine.tsplit, engine.ecfg.prefill_chunk
    m = compiled_memory(split.chunk, split.weights, engine.tcfg, gen.state.target, jnp.zeros(chunk, jnp.int32),
                        jnp.int32(chunk), (), False, kcfg=engine.kcfg)
    del gen
    # everything a chunk's call holds: its arguments (weights, state), outputs not written in place, temporaries
    row.update(chunk_memory=m, chunk_peak_bytes=m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] +
               m["temp_bytes"], state_bytes=engine.state_bytes(), memory=memory())
    return row


def prefill_line(r: dict) -> str:
    """A prefill row in words (the run's log)."""
    peak = r["memory"].get("peak_bytes_in_use")
    return (f"prefill, chunk {r['chunk']}, {r['prompt_len']} tokens: {r['tokens_per_s']:.0f} tok/s, prefill "
            f"{r['prefill_s']:.3f} s, TTFT {r['ttft_s']:.3f} s warm; first call {r['first_ttft_s']:.2f} s "
            f"({r['first_compiles']} compiles, {r['first_compile_s']:.1f} s); temporaries "
            f"{r['chunk_memory']['temp_bytes'] / 2**20:.0f} MiB, the chunk's call "
            f"{r['chunk_peak_bytes'] / 2**30:.2f} GiB"
            + ("" if peak is None else f", device peak so far {peak / 2**30:.2f} GiB"))


def first_token(engine: Engine, prompt: list[int], compiles: CompileLog, build_s: float, clock_at_start: float
                ) -> dict:
    """This process's first generation of the prompt (`first_generation`, in the engine's mode: --ttft_mode): TTFT
    (prefill + first step, as time_ar's), what compiled in it, the model build's seconds, and the wall clock
    (time.time) at run's start and at the first step's token, for `cold_ttft`."""
    clock = time.time()
    gen, compiled = first_generation(engine, prompt, compiles)
    ttft = gen.prefill_s + gen.first_step_s
    return dict(mode=engine.ecfg.mode, prompt_len=len(prompt), ttft_s=ttft, prefill_s=gen.prefill_s, build_s=build_s,
                **compiled, clock_at_start=clock_at_start, clock_at_token=clock + ttft)


def cold_ttft(argv: list[str], log) -> list[dict]:
    """Time to first token (--ttft_mode) in two fresh processes of this script (its flags `argv`, the sections
    first_token), sharing a new persistent compilation cache (`--jit_cache`, set as generate sets its own): the first
    starts with it empty, the second with what the first wrote. Each row is the process's `first_token` with the
    seconds from its launch to run's start (interpreter, imports) and from its launch to the first token less its
    model build (the synthetic model is made on the device, where a user's process reads a GGUF)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_ttft_") as tmp:
        for cache in ("empty", "warm"):
            out = Path(tmp) / f"{cache}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--sections", "first_token", "--out",
                   str(out), "--jit_cache", os.path.join(tmp, "jit")]  # the last of a repeated flag counts
            launched = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"the {cache}-cache process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            child = json.loads(out.read_text())["first_token"]
            rows.append(dict(cache=cache, **child, start_s=child["clock_at_start"] - launched,
                             to_token_less_build_s=child["clock_at_token"] - launched - child["build_s"]))
            log(ttft_line(rows[-1]))
    return rows


def ttft_line(r: dict) -> str:
    """A fresh process's time to first token in words (`cold_ttft`'s rows; `first_token`'s without the cache and the
    launch)."""
    where = f", {r['cache']} cache" if "cache" in r else ""
    launch = (f"; launch to first token {r['to_token_less_build_s']:.1f} s less the model build"
              if "to_token_less_build_s" in r else "")
    return (f"TTFT of a fresh process{where}: {r['ttft_s']:.2f} s ({r.get('mode', 'ar')}, {r['prompt_len']} tokens; "
            f"trace {r['trace_s']:.1f} s, lower {r['lower_s']:.1f} s, compile {r['compile_s']:.1f} s over "
            f"{r['compiles']} programs, {r['cache_hits']} found in the cache){launch}; "
            f"model build {r['build_s']:.1f} s")


PROFILE_STEPS = 8  # decode steps a --profile trace holds


def trace_label(engine: Engine) -> str:
    """The name of an engine's decode trace (its folder under --profile and its key in the JSON's profile)."""
    return "ar" if engine.ecfg.mode == "ar" else f"{engine.ecfg.mode}-{engine.ecfg.budget}"


def trace_decode(engine: Engine, prompt: list[int], args: argparse.Namespace, log) -> dict:
    """A jax.profiler trace of PROFILE_STEPS decode steps (after the first, which may compile; the generation halts
    after them) into args.profile/`trace_label`, summarized per GPU (`profiled`)."""
    label = trace_label(engine)
    tracer = StepTrace(str(Path(args.profile) / label), steps=PROFILE_STEPS, inner=_step_limit(PROFILE_STEPS + 2))
    engine.generate(prompt, args.n_gen, NO_STOPS, on_tokens=tracer)
    tracer.close()
    return profiled(label, tracer.directory, tracer.traced_steps, "step", log)


def trace_prefill(engine: Engine, prompt: list[int], args: argparse.Namespace, log) -> dict:
    """A jax.profiler trace of one warm prefill of `prompt` (engine.start: the prompt's chunks, the last padded, and
    the first token) into args.profile/prefill-CHUNK, summarized per GPU per 64-token block of the chunks computed."""
    chunk = engine.ecfg.prefill_chunk
    label = f"prefill-{chunk}"
    directory = Path(args.profile) / label
    with jax.profiler.trace(str(directory)):
        state, _ = engine.start(prompt, 2, NO_STOPS)
        jax.block_until_ready(state)
    del state
    blocks = -(-len(prompt) // chunk) * chunk // PREFILL_BLOCK
    return dict(profiled(label, str(directory), blocks, f"{PREFILL_BLOCK}-token block", log), prompt_len=len(prompt),
                chunk=chunk)


def profiled(label: str, directory: str, steps: int, unit: str, log) -> dict:
    """The trace under `directory` summarized per GPU (gpu_step_profile.summarize, over `steps` of `unit`), each
    GPU's summary logged (its categories and the 25 longest kernel names)."""
    gpus = {gpu: summarize(events, steps) for gpu, events in gpu_events_by_device(directory).items()}
    log(f"profile of {steps} {unit}s ({label}) written to {directory}")
    for gpu, r in gpus.items():
        print("\n".join(profile_lines(f"{label} {gpu}", r, 25, unit)), flush=True)
    if not gpus:
        log(profile_lines(label, summarize([], steps))[0])
    return dict(dir=directory, steps=steps, unit=unit, gpus=gpus)


def finish(res: dict, compiles: CompileLog, save, t_start: float) -> None:
    """Close the compile log, save the results and print the compile table and the summary."""
    compiles.__exit__()
    res["compile"] = compiles.rows()
    res["seconds"] = time.perf_counter() - t_start
    save()
    print(compiles.table(min_seconds=1.0))
    print(summary(res))


def compiled_memory(jitted, *args, **kwargs) -> dict:
    """XLA's memory analysis of a jitted function compiled for these arguments: bytes of arguments, outputs,
    outputs aliased to (donated) arguments, and temporaries."""
    m = jitted.lower(*args, **kwargs).compile().memory_analysis()
    return dict(argument_bytes=int(m.argument_size_in_bytes), output_bytes=int(m.output_size_in_bytes),
                alias_bytes=int(m.alias_size_in_bytes), temp_bytes=int(m.temp_size_in_bytes))


def summary(res: dict) -> str:
    """The short table printed last."""
    lines = []
    for r in res.get("compiled_memory", []):
        lines.append(f"compiled {r['mode']} step, context {r['context']}: state {r['state_bytes'] / 2**20:.0f} MiB, "
                     f"temporaries {r['temp_bytes'] / 2**20:.0f} MiB")
    if {"ar", "long"} & set(res):
        lines += decode_summary(res)
    if res.get("prefill"):
        lines.append(f"{'prefill':<8} {'chunk':>6} {'tokens':>7} {'tok/s':>8} {'prefill s':>9} {'TTFT s':>8} "
                     f"{'1st call s':>10} {'compiles':>8} {'chunk GiB':>9} {'peak GiB':>8}")
    for r in res.get("prefill", []):
        peak = r["memory"].get("peak_bytes_in_use")
        lines.append(f"{'':<8} {r['chunk']:>6} {r['prompt_len']:>7} {r['tokens_per_s']:>8.1f} {r['prefill_s']:>9.3f} "
                     f"{r['ttft_s']:>8.3f} {r['first_ttft_s']:>10.2f} {r['first_compiles']:>8} "
                     f"{r['chunk_peak_bytes'] / 2**30:>9.2f} " + (f"{'-':>8}" if peak is None else
                                                                  f"{peak / 2**30:>8.2f}"))
    for label, p in res.get("profile", {}).items():
        for gpu, r in p.get("gpus", {}).items():
            if r["kernels"]:
                lines.append(f"profile {label} {gpu}, ms a {p['unit']}: span {r['span_ms']:.2f}, busy "
                             f"{r['busy_ms']:.2f}, idle {r['idle_ms']:.2f} ({r['launches']:.0f} launches); "
                             + ", ".join(f"{name} {c['ms']:.2f}" for name, c in r["categories"].items()))
    if "accounting" in res.get("models", {}):
        lines.append(memory_line("after the models", res["models"]["accounting"]))
    for r in res.get("long", []):
        lines += [memory_line(f"with the {mode} state at context {r['context']}", r[f"{mode}_accounting"])
                  for mode in ("ar", "ddtree") if f"{mode}_accounting" in r]
    lines += [ttft_line(r) for r in res.get("ttft", []) + ([res["first_token"]] if "first_token" in res else [])]
    return "\n".join(lines)


def decode_summary(res: dict) -> list[str]:
    """The summary's lines of the decode sections (ar, forced, steps, long)."""
    lines = []
    read = f"; read {res['read_rate'] / 1e9:.0f} GB/s" if "read_rate" in res else ""
    lines.append(f"{res['device']} jax {res['jax']} {res['date']}; copy {res['copy_rate'] / 1e9:.0f} GB/s{read}; model "
                 f"{res['model']} ({res['models']['step_weight_bytes'] / 1e9:.2f} GB streamed per step)")
    if "ar" in res:
        ar = res["ar"]
        lines.append(f"AR {ar['tokens_per_s']:.1f} tok/s, step {ar['step_ms']:.2f} ms = {ar['roofline_fraction']:.2f}"
                     f" of the roofline ({ar['roofline_ms']:.2f} ms); TTFT {ar['ttft_s']:.3f} s ({ar['prompt_len']}"
                     " tokens)")
    if res.get("steps"):
        lines.append(f"{'mode':>7} {'budget':>6} {'draft':>7} {'tree':>7} {'verify':>7} {'commit':>7} {'step':>7} "
                     f"{'x AR':>5} {'AL':>5} {'tok/s':>6}")
    for r in res.get("steps", []):
        p = r["phases_ms"] or {}
        cols = " ".join(f"{p[k]:>7.2f}" if k in p else f"{'-':>7}" for k in ("draft", "tree", "verify",
                                                                            "accept_commit"))
        lines.append(f"{r['mode']:>7} {r['budget']:>6} {cols} {r['step_ms']:>7.2f} {r['step_over_ar']:>5.2f} "
                     f"{r['accept_length']:>5.2f} {r['tokens_per_s']:>6.1f}")
    points = [(r["phases_ms"]["verify_tokens"], r["phases_ms"]["verify"]) for r in res.get("steps", [])
              if r["phases_ms"]]
    if points:
        fit = fit_verify_cost(points)
        n, tile = fit["n"], fit["tile"]
        lines.append(f"verify ms = {n['a_ms']:.2f} + {n['b_ms']:.3f} N (residual <= "
                     f"{100 * n['max_rel_residual']:.0f} %); = {tile['a_ms']:.2f} + {tile['b_ms']:.3f} tile(N) "
                     f"(<= {100 * tile['max_rel_residual']:.0f} %)")
    for r in res.get("forced", []):
        lines.append(f"forced DDTree-{r['budget']}: AL {r['accept_length']:.2f} (goal {r['al_goal']}) "
                     f"{r['tokens_per_s']:.1f} tok/s = {r['speedup']:.2f} x AR")
    for r in res.get("long", []):
        lines.append(f"context {r['context']}: AR {r['ar_step_ms']:.2f} ms, DDTree-{r.get('budget', 22)} "
                     f"{r['ddtree_step_ms']:.2f} ms "
                     f"({r['ddtree_over_ar']:.2f} x), peak {r['memory'].get('peak_bytes_in_use', 0) / 2**30:.1f} GiB")
    if "memory_after_max_ctx_runs" in res:
        peak = res["memory_after_max_ctx_runs"].get("peak_bytes_in_use", 0)
        lines.append(f"peak device memory through the {res['args']['max_ctx']}-token runs: {peak / 2**30:.1f} GiB")
    return lines


if __name__ == "__main__":
    main()
