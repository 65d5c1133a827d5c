"""Timing helpers shared by the benchmark scripts: device-to-device copy rate and median wall time of jitted calls.

A jitted call is timed from dispatch to `block_until_ready`, after a warm-up call that compiles it; callers put
enough work in one call (many layers' weights, several times the L2) that dispatch is a small part of it.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import platform
import statistics
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.allocator import current_allocator
from dflash_jax.config import COMPILE_AHEAD, DRAFT_RULES, IMPLS, KV_TYPES, NUMERICS, EngineConfig, KernelConfig
from dflash_jax.engine.state import tree_bytes
from dflash_jax.generate import resolve_flags


def add_engine_flags(ap: argparse.ArgumentParser, mode: str = "ddtree") -> None:
    """The decoding and kernel flags of a benchmark, named as `generate`'s: unset, each takes the device class's
    default (dflash_jax/defaults.py), so that with no flags a benchmark runs what a user runs."""
    ap.set_defaults(mode=mode)
    ap.add_argument("--budget", type=int, default=None, help="DDTree budget (default: the device's, as generate)")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--chain_seed", action=argparse.BooleanOptionalAction, default=None,
                    help="seed the DDTree with the draft's top-1 chain (default: when the budget exceeds its depth)")
    ap.add_argument("--kv_type", choices=KV_TYPES, default=None, help="KV cache type (default: the device's)")
    ap.add_argument("--kv_type_k", choices=KV_TYPES, default=None, help="the keys' KV cache type (default: --kv_type)")
    ap.add_argument("--kv_type_v", choices=KV_TYPES, default=None,
                    help="the values' KV cache type (default: --kv_type)")
    ap.add_argument("--draft_ctx", type=int, default=None,
                    help="the drafter's full-attention layers see the last this many tokens (0: all; default: "
                         "generate's)")
    ap.add_argument("--prefill_chunk", type=int, default=None,
                    help="prompt tokens per compiled prefill call, a multiple of 64 (default: generate's)")
    ap.add_argument("--impl", choices=("auto",) + IMPLS, default="auto",
                    help="kernels: auto (the device's), reference, pallas (interpret mode on a CPU)")
    ap.add_argument("--mgpu", action=argparse.BooleanOptionalAction, default=None,
                    help="Q4_K/Q6_K matrices in the Mosaic GPU layout (default: the device's; Hopper only)")
    # generate's absl spellings of the negations, so one set of flags serves both
    ap.add_argument("--nomgpu", dest="mgpu", action="store_false", help=argparse.SUPPRESS)
    ap.add_argument("--mgpu_attention", action=argparse.BooleanOptionalAction, default=None,
                    help="tree attention over bf16 and q8_0 caches on the Mosaic GPU kernel (default: the device's; "
                         "Hopper only)")
    ap.add_argument("--nomgpu_attention", dest="mgpu_attention", action="store_false", help=argparse.SUPPRESS)
    ap.add_argument("--nochain_seed", dest="chain_seed", action="store_false", help=argparse.SUPPRESS)
    ap.add_argument("--small_rows", type=int, default=None,
                    help="quantized matrices of fewer rows go to XLA's product as float32 (default: KernelConfig's)")
    ap.add_argument("--numerics", choices=NUMERICS, default=None,
                    help="exact (speculative decoding emits what AR emits) or fast (not exact); default: the device's")
    ap.add_argument("--draft_rule", choices=DRAFT_RULES, default="coupled",
                    help="what a sampled step builds its tree from (generate's --draft_rule)")
    ap.add_argument("--compile_ahead", action=argparse.BooleanOptionalAction, default=COMPILE_AHEAD,
                    help="compile the step on a thread while the prompt is prefilled (generate's --compile_ahead)")
    ap.add_argument("--nocompile_ahead", dest="compile_ahead", action="store_false", help=argparse.SUPPRESS)


def add_pair_flags(ap: argparse.ArgumentParser, budgets: str) -> None:
    """The pair and prompt-set flags of the scripts that decode prompt sets (acceptance.py, exactness.py), with their
    sampling flags (`sampling_settings` reads them)."""
    ap.add_argument("--target", default=None, help="default: the shipped pair")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--sets", default="humaneval", help="comma-separated: humaneval, or JSONL paths")
    ap.add_argument("--limit", type=int, default=0, help="first N prompts of each set (0: all)")
    ap.add_argument("--n_gen", type=int, default=128)
    ap.add_argument("--budgets", default=budgets, help="DDTree budgets (ar and chain always run)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top_p", type=float, default=1.0)
    ap.add_argument("--top_k", type=int, default=0)
    ap.add_argument("--min_p", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)


def sampling_settings(args: argparse.Namespace):
    """The SamplingParams of `add_pair_flags`' sampling flags."""
    from dflash_jax.engine.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.seed)


def pair_paths(args: argparse.Namespace) -> tuple[str, str]:
    """The target's and the drafter's paths of `add_pair_flags`' --target/--draft (default: the shipped pair)."""
    from dflash_jax import assets

    return args.target or assets.DEFAULT_TARGET, args.draft or assets.DEFAULT_DRAFT


def load_pair(args: argparse.Namespace, kcfg: KernelConfig):
    """(target, draft, tokenizer) of `add_pair_flags`' --target/--draft (default: the shipped pair), laid out for
    kcfg."""
    from dflash_jax.load import load_draft, load_target
    from dflash_jax.tokenizer import load_tokenizer

    target_path, draft_path = pair_paths(args)
    target = load_target(target_path, progress=False, kcfg=kcfg)
    return target, load_draft(draft_path, target.config, progress=False, kcfg=kcfg), load_tokenizer(target_path)


def engine_settings(args: argparse.Namespace) -> tuple[EngineConfig, KernelConfig]:
    """The engine and kernel configuration of `add_engine_flags`' flags, by the function `generate`, `chat` and
    `serve` resolve theirs with."""
    max_ctx = getattr(args, "max_ctx", EngineConfig.max_ctx)  # scripts that fit the context to their prompts set it
    return resolve_flags(args, max_ctx=max_ctx, impl=args.impl, small_rows=args.small_rows)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where token lists a and b differ (the shorter's length where one is a prefix of the other),
    None if they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def median_seconds(fn, *args, iters: int = 10) -> float:
    """Median wall time of fn(*args) over `iters` runs after one warm-up run."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_rate(gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written): the faster of a plain copy
    and an elementwise scale of a `gib` GiB array (the higher ceiling makes every ratio against it conservative)."""
    n = int(gib * 2**30) // 4
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    ops = (jax.jit(lambda a: a * 1.0001), jax.jit(jnp.copy))
    return max(2 * x.nbytes / median_seconds(op, x, iters=20) for op in ops)


def read_rate(gib: float = 4.0) -> float:
    """Device read bandwidth in bytes/s: the faster of two reductions (a float32-accumulated sum and a max) of a `gib`
    GiB bfloat16 array, which read it once and write nothing. A decode step only reads its weights, so this, not the
    copy rate (half of whose bytes are writes), is its floor: about 3.5-3.9 TB/s on an H200 against 1.4 TB/s of reads
    in a copy (issue 41)."""
    n = int(gib * 2**30) // 2
    x = jax.random.normal(jax.random.key(1), (n,), jnp.bfloat16)
    ops = (jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), jax.jit(jnp.max))
    rate = max(x.nbytes / median_seconds(op, x, iters=20) for op in ops)
    del x
    return rate


def memory(device: jax.Device | None = None) -> dict:
    """Device memory in use and its peak so far (bytes), where the backend reports them (default: JAX's first
    device)."""
    stats = (device or jax.devices()[0]).memory_stats() or {}
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use") if k in stats}


def device_buffers(arrays, device: jax.Device) -> dict[int, jax.ShapeDtypeStruct]:
    """The buffers on `device` of these arrays (a pytree's leaves, or jax.live_arrays()), by address (a buffer two
    arrays share is one entry), each as its shape and dtype; deleted (donated) arrays and leaves that are no arrays
    are left out."""
    out = {}
    for x in arrays:
        if not isinstance(x, jax.Array) or x.is_deleted():
            continue
        for shard in x.addressable_shards:
            if shard.device == device:
                out[shard.data.unsafe_buffer_pointer()] = jax.ShapeDtypeStruct(shard.data.shape, x.dtype)
    return out


def memory_accounting(named: dict[str, Any], device: jax.Device | None = None, largest: int = 5) -> dict:
    """Where a device's memory goes (default: JAX's first device): `memory()`; the bytes of the live arrays' buffers
    on it (jax.live_arrays(), int4 two to a byte, as tree_bytes counts); the bytes there of each of the `named`
    pytrees (e.g. target, drafter, state); the live bytes in none of them, and the `largest` such buffers (shape,
    dtype, bytes); and, where the device reports its use, the bytes in use that no live array holds, once the
    device has finished what was queued."""
    device = device or jax.devices()[0]
    # an array dropped while work queued on it has not run keeps its buffer until that work is done
    jax.block_until_ready(jax.live_arrays())
    live = device_buffers(jax.live_arrays(), device)
    owned = {name: device_buffers(jax.tree.leaves(tree), device) for name, tree in named.items()}
    others = sorted(((tree_bytes(s), s) for ptr, s in live.items() if not any(ptr in o for o in owned.values())),
                    key=lambda item: -item[0])
    out = dict(memory(device), live_bytes=sum(tree_bytes(s) for s in live.values()), live_buffers=len(live),
               named={name: sum(tree_bytes(s) for s in o.values()) for name, o in owned.items()},
               other_bytes=sum(b for b, _ in others),
               other_largest=[dict(shape=list(s.shape), dtype=str(s.dtype), bytes=b) for b, s in others[:largest]])
    if "bytes_in_use" in out:
        out["not_in_live_arrays_bytes"] = out["bytes_in_use"] - out["live_bytes"]
    return out


def memory_line(what: str, m: dict) -> str:
    """A `memory_accounting` in words (GB: 1e9 bytes)."""
    gb = lambda b: f"{b / 1e9:.2f}"  # noqa: E731
    use = (f"in use {gb(m['bytes_in_use'])} GB (peak {gb(m['peak_bytes_in_use'])}), "
           if "peak_bytes_in_use" in m else "")
    gap = (f"; in use but in no live array {gb(m['not_in_live_arrays_bytes'])} GB"
           if "not_in_live_arrays_bytes" in m else "")
    largest = ", ".join(f"{o['dtype']}{o['shape']} {gb(o['bytes'])}" for o in m["other_largest"])
    return (f"memory {what}: {use}live arrays {gb(m['live_bytes'])} GB in {m['live_buffers']} buffers ("
            + "".join(f"{name} {gb(b)}, " for name, b in m["named"].items()) + f"other {gb(m['other_bytes'])}"
            + (f": largest {largest}" if largest else "") + ")" + gap)


def gpu_events_by_device(trace_dir: str) -> dict[str, list[tuple[str, int, int]]]:
    """(name, start ns, duration ns) of every event on the GPU streams of the trace under `trace_dir`, by GPU (the
    trace's plane name, e.g. /device:GPU:0)."""
    out: dict[str, list[tuple[str, int, int]]] = {}
    for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
        for plane in jax.profiler.ProfileData.from_file(path).planes:
            if "GPU" not in plane.name:
                continue
            for line in plane.lines:
                if "Stream" in line.name:
                    out.setdefault(plane.name, []).extend((ev.name, ev.start_ns, ev.duration_ns)
                                                          for ev in line.events)
    return out


def gpu_events(trace_dir: str) -> list[tuple[str, int, int]]:
    """(name, start ns, duration ns) of every event on the GPU streams of the trace under `trace_dir`, every GPU's."""
    return [ev for events in gpu_events_by_device(trace_dir).values() for ev in events]


def traced_gpu_events(fn, *args, calls: int = 3) -> list[tuple[str, int, int]]:
    """`gpu_events` of a trace of `calls` calls of fn(*args), after a warm-up call (which compiles it); the trace
    is read and deleted."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        return gpu_events(trace_dir)


def kernel_seconds_by_name(fn, *args, calls: int = 3) -> dict[str, float]:
    """GPU time of one fn(*args) call per kernel name: the durations of a trace of `calls` calls' GPU events summed
    by name, over `calls` ({} with no GPU)."""
    seconds = {}
    for name, _, ns in traced_gpu_events(fn, *args, calls=calls):
        seconds[name] = seconds.get(name, 0.0) + ns / 1e9 / calls
    return seconds


def kernel_seconds(fn, *args, calls: int = 3) -> float:
    """GPU kernel time of one fn(*args) call: the summed durations of the events on the GPU streams of a trace of
    `calls` calls, over `calls`; dispatch, waits and gaps between launches are left out (0 with no GPU)."""
    return sum(kernel_seconds_by_name(fn, *args, calls=calls).values())


def parse_options(text: str) -> dict[str, int | str]:
    """`KEY=VALUE,KEY=VALUE` (e.g. `block_n=64,num_warps=8`) as a dict, integers where they parse; an empty string
    gives {}."""
    return {key: int(value) if value.lstrip("-").isdigit() else value
            for key, value in (item.split("=") for item in text.split(",") if item)}


def concatenated(sequences: list, length: int, count: int) -> list[np.ndarray]:
    """`count` token sequences of `length` ids made by concatenating `sequences` in order (cycling when they run
    short): long prompts from a set of short ones."""
    pool = np.concatenate([np.asarray(s, np.int32) for s in sequences])
    pool = np.tile(pool, -(-length * count // len(pool)))
    return [pool[i * length:(i + 1) * length] for i in range(count)]


def environment() -> dict:
    """Device, jax version and date for a results file."""
    dev = jax.devices()[0]
    return {"device": getattr(dev, "device_kind", str(dev)), "backend": jax.default_backend(),
            "jax": jax.__version__, "python": platform.python_version(),
            "date": datetime.date.today().isoformat(), "allocator": current_allocator()}


def attention_heads() -> dict[str, tuple[int, int, int]]:
    """(query heads, KV heads, head_dim) of the 27B target's attention and its drafter's, from their configs."""
    from dflash_jax.config import load_draft_config, load_target_config
    from dflash_jax.testing.synthetic import DRAFT_27B, TARGET_27B

    configs = {"target": load_target_config(TARGET_27B), "drafter": load_draft_config(DRAFT_27B)}
    return {name: (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) for name, cfg in configs.items()}


def gdn_layer_inputs(seed: int, layers: int, n: int, h: int, dk: int, dv: int) -> tuple[list[dict], jax.Array]:
    """Random delta-rule inputs of n tokens for each of `layers` layers (separate arrays, as the model has them:
    unit keys, scaled unit queries, log-decays in (-1, 0], beta in (0, 1)) and their stacked states."""
    key = jax.random.split(jax.random.key(seed), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    per_layer = [dict(q=unit(jax.random.normal(jax.random.fold_in(key[0], i), (n, h, dk))) * dk ** -0.5,
                      k=unit(jax.random.normal(jax.random.fold_in(key[1], i), (n, h, dk))),
                      v=jax.random.normal(jax.random.fold_in(key[2], i), (n, h, dv)),
                      g=-jax.random.uniform(jax.random.fold_in(key[3], i), (n, h)),
                      beta=jax.random.uniform(jax.random.fold_in(key[4], i), (n, h))) for i in range(layers)]
    return per_layer, jax.random.normal(key[5], (layers, h, dk, dv)) * 0.1


def fit_verify_cost(points: list[tuple[int, float]]) -> dict:
    """Least-squares models of verify time (ms) vs tree size N: linear in N, t = a + b N, and linear in the row
    tile the products pad N to (pallas_kernels/tiles.dot_tile: 16, 32, 64), t = a + b tile(N); each with its
    largest relative residual."""
    import numpy as np

    from pallas_kernels.tiles import dot_tile

    t = np.array([p[1] for p in points], float)
    out = {}
    for name, x in (("n", [p[0] for p in points]), ("tile", [dot_tile(p[0]) for p in points])):
        x = np.array(x, float)
        if len(set(x)) < 2:
            a, b = float(t.mean()), 0.0
        else:
            b, a = np.polyfit(x, t, 1)
        out[name] = {"a_ms": float(a), "b_ms": float(b), "max_rel_residual": float(np.max(np.abs(a + b * x - t) / t))}
    return out
