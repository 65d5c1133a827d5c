"""Kernel benchmarks on the GPU, as ratios to the read-stream rate measured in the same run (benchlib.read_rate: a
reduction over a 4 GiB array, the floor of a kernel that only reads; the copy rate is recorded beside it).

    python scripts/bench_kernels.py --out scripts/results/kernels_<device>.json [--sweep] [--kernels ...]

qmatmul: every 27B matrix shape in its Q4_K_M type, at M = 1 and M = 32 tokens, against XLA's dequantize-then-dot
on the same weights. Rate = the weight's GGUF bytes / time (the packed layout reads up to 2.8% more; both are
listed). Each timed call runs the product over enough copies of the weight to be several times the L2, so the
weights stream from HBM. Each product has two times: the median wall time of a call over its copies (us, ratio),
which includes the call's dispatch and the wait for it, and the GPU kernel time of a traced call over its copies
(kernel_us, kernel_ratio: its GPU events summed, as benchlib.kernel_seconds), which does not; kernels_us splits it
by kernel (the product's own and XLA's around it), and each line names the longest. qmatmul runs the Triton layout's
route for each M (one token: the int8 GEMV for Q4_K/Q6_K, the float GEMV otherwise; more: the tensor-core kernel).
`--sweep` also times tile variants, `--splits` the K split over 1, 2, 4 and 8 programs, `--variants` any of
qmatmul's tuning arguments (e.g. `block_n=32,num_warps=8`), `--shard N` the matrices as one shard of the target
split N ways holds them (`--devices N`: 1/N of the rows, or of the columns of the all-reduced projections). The
drafter's bf16 matrices are not here: XLA's product serves them.

qmatmul_mgpu: the Mosaic GPU kernels on the 27B's Q4_K shapes (pallas_kernels/qmatmul_mgpu.py) and Q6_K ones
(qmatmul_mgpu_q6k.py) at each `--m`, beside qmatmul's Triton route on the same weights in the same run; its rate
also counts GGUF bytes (its layouts read 2.8 % and 1 % more). `--variants` options (`splits`, `stages`) apply to
both Mosaic kernels here.

qmatmul_groups: weights one x multiplies (an MLP's gate and up, a GDN layer's qkv and z, an attention's q and k) on
the Mosaic Q4_K kernel, a launch each against one launch for the group (`qmatmul_many`, which `kernels.linears`
takes), at each `--m`, with whether the two give the same bits.

tree_attention: a 23-node tree (`--attn_tokens`: other sizes, 1 for the AR step) over 4K and 32K committed tokens,
the target's 16 attention layers (24 query / 4 KV heads x 256) in one call, for each cache type of `--kv_types`
(default bf16; the block types are read as stored, the block's own rows in the cache's type, as the model passes
them); floor = the bytes it must read (K and V of the context as stored, the block's q/k/v) over the read-stream
rate. Also the jnp reference under XLA (over the dequantized cache). `--sweep` also times tiles (rows, keys, warps,
stages) at the default split and splits at the default tile. On a GPU, a bf16 or q8_0 cache also times the Mosaic
GPU kernel (tree_attention_mgpu.py, `{'mgpu': True}`) at its default split and at each `--attn_splits`.
`--attn_kernels` leaves out the others (triton, mosaic, xla: at 128K over q8_0 XLA's reference took 64 ms a call,
scripts/results/mgpu_attention_q8_0_before_whole_tiles_h200_nov29.json).

gdn: verify of a 23-node tree over the 48 GDN layers (48 heads of 128 x 128, float32 state), a 64-token prefill
chunk over the same layers, and the 48-layer path commit, against the AR step's weight-streaming time: the 27B
Q4_K_M matrices a decode step reads (every matrix but the embedding table) over the read-stream rate. Also the jnp
reference under XLA. `--sweep` also times the delta rule's tiles (`block_v` state columns x `num_warps`) for the AR
step's one token, the 23-node verify and the commit of one token and of the tree's path, each with the fraction of
output elements bitwise equal to the default tiles' (the tiles change how the work is split, not the order of any
sum, so every variant should give 1.0: a tile that gives less changes the numerics and is no tuning choice).

tree_attention and gdn results also carry the GPU kernel time of the call (kernel_us) and its split by kernel
(kernels_us); their lines give it in all and for the Pallas kernel alone.

tree_conv: the GDN layers' causal conv + SiLU (10240 channels) of a 23-node tree over the 48 layers, for channel
tiles of 32..256 and 1 or 4 warps, against the jnp reference under XLA.

qmatmul, tree_attention and gdn run under `--numerics` (default: this device's, as `generate` resolves it): exact
rounds every product alike at any row count, fast is the faster kernels (docs/architecture.md, "Numerics").
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import (copy_rate, environment, read_rate, gdn_layer_inputs, median_seconds,  # noqa: E402
                      kernel_seconds_by_name, parse_options)

from dflash_jax import kv_quant as kvq  # noqa: E402
from dflash_jax.config import KV_TYPES, NUMERICS, load_target_config  # noqa: E402
from dflash_jax.defaults import resolve_kernels  # noqa: E402
from dflash_jax.gguf import tensor_specs  # noqa: E402
from dflash_jax.models.target import Block  # noqa: E402
from dflash_jax.models.target import _conv_index as conv_index  # noqa: E402
from dflash_jax.parallel import shard_plan  # noqa: E402
from dflash_jax.quant import FORMATS, dequantize  # noqa: E402
from dflash_jax.testing.gguf_writer import q4_k_m_rule  # noqa: E402
from dflash_jax.testing.synthetic import random_matrix  # noqa: E402
from pallas_kernels import gdn  # noqa: E402
from pallas_kernels import qmatmul as qm  # noqa: E402
from pallas_kernels import qmatmul_mgpu as mg  # noqa: E402
from pallas_kernels import qmatmul_mgpu_q6k as q6  # noqa: E402
from pallas_kernels import reference as ref  # noqa: E402
from pallas_kernels.tree_attention import row_bytes, tree_attention  # noqa: E402
from pallas_kernels.tree_attention_mgpu import tree_attention as tree_attention_mgpu  # noqa: E402
from pallas_kernels.tree_conv import tree_conv  # noqa: E402

CONFIG_27B = Path(__file__).resolve().parents[1] / "configs" / "qwen3.5-27b.json"

# (name, fmt, N (out), K (in)) of the 27B's matrices; ffn_down and attn_qkv come in two types in Q4_K_M files.
SHAPES = [
    ("ffn_gate/up", "Q4_K", 17408, 5120),
    ("ffn_down", "Q4_K", 5120, 17408),
    ("ffn_down", "Q6_K", 5120, 17408),
    ("attn_qkv", "Q4_K", 10240, 5120),
    ("attn_qkv", "Q5_K", 10240, 5120),
    ("attn_gate", "Q4_K", 6144, 5120),
    ("ssm_out", "Q4_K", 5120, 6144),
    ("attn_q", "Q4_K", 12288, 5120),
    ("attn_output", "Q4_K", 5120, 6144),
    ("ssm_alpha", "Q8_0", 48, 5120),
    ("output", "Q6_K", 248320, 5120),
]
MIN_BYTES = 512 * 2**20  # stream at least this much per timed call (H100 L2: 50 MB)


def shard_shapes(shapes: list, n: int) -> list:
    """The matrices as shard 0 of the 27B split n ways holds them (`--shard`; parallel.shard_plan): those split by
    rows with 1/n of their rows, o_proj, out_proj and ffn_down (split by columns) with 1/n of their columns."""
    cfg = load_target_config(CONFIG_27B)
    plan, gdn_layer, attn_layer = shard_plan(cfg, n, 0), cfg.linear_attention_layers[0], cfg.full_attention_layers[0]
    out = []
    for name, fmt, rows, k in shapes:
        base = name.split("/")[0] + ".weight"  # ffn_gate/up: ffn_gate's
        layer = attn_layer if base in ("attn_q.weight", "attn_output.weight") else gdn_layer
        how, idx = plan[base if base == "output.weight" else f"blk.{layer}.{base}"]
        out.append((name, fmt, len(idx), k) if how == "rows" else (name, fmt, rows, len(idx)))
    return out


def _copies(fmt: str, n: int, k: int, min_bytes: int = MIN_BYTES):
    """Enough random copies of an [n, k] weight to stream `min_bytes`, with entries of about 1/sqrt(k) as a model's
    (random_matrix; float16 holds their scales for f16x2 tiles, where unit-scale random Q6_K scales overflow it)."""
    std = {}
    one = random_matrix(jax.random.key(0), fmt, (n, k), std)
    reps = max(2, min(64, math.ceil(min_bytes / one.nbytes)))
    return [random_matrix(jax.random.key(i), fmt, (n, k), std) for i in range(reps)], one.nbytes


def _times(run, x, weights, gguf_bytes: int, stream: float) -> dict:
    """Wall and (on a GPU) kernel time per product of `run(x, weights)`, with GGUF bytes/s and its ratio to `stream`."""
    t = median_seconds(run, x, weights) / len(weights)
    out = dict(us=t * 1e6, gguf_bytes=gguf_bytes, rate=gguf_bytes / t, ratio=gguf_bytes / t / stream)
    kernel = _kernel_times(run, x, weights, per=len(weights))
    if kernel:
        out.update(kernel, kernel_ratio=gguf_bytes / (kernel["kernel_us"] * 1e-6) / stream)
    return out


def _kernel_times(run, *args, per: int = 1) -> dict:
    """GPU time of `run(*args)` over `per` (us), as `kernel_times` gives it."""
    return kernel_times(kernel_seconds_by_name(run, *args), per)


def kernel_times(seconds_by_name: dict[str, float], per: int = 1) -> dict:
    """Seconds of a call by kernel name, over `per` (us): kernel_us in all and kernels_us by kernel (its own, XLA's
    around it); {} where a trace had no GPU events (a CPU run)."""
    per_kernel = {name: sec * 1e6 / per for name, sec in seconds_by_name.items()}
    total = sum(per_kernel.values())
    return dict(kernel_us=total, kernels_us=per_kernel) if total > 0 else {}


def _own_us(r: dict, name: str) -> float:
    """The GPU time of the kernels whose name holds `name` in a result with kernel times (us)."""
    return sum(us for kernel, us in r["kernels_us"].items() if name in kernel)


def _kernel_note(r: dict, name: str) -> str:
    """'kernels X us (NAME's Y us)' for a result with kernel times, else ''."""
    if "kernel_us" not in r:
        return ""
    return f"  kernels {r['kernel_us']:8.1f} us ({name} {_own_us(r, name):8.1f} us)"


def _line(name: str, fmt: str, m: int, what: str, r: dict) -> str:
    longest = f" (longest {max(r['kernels_us'].values()):.1f})" if "kernels_us" in r else ""
    kernel = f"  kernel {r['kernel_us']:7.1f} us {r['kernel_ratio']:5.2f}{longest}" if "kernel_us" in r else ""
    return (f"  {name:12s} {fmt} M={m:2d} {what:45s} {r['us']:8.1f} us {r['rate'] / 1e12:5.2f} TB/s  "
            f"{r['ratio']:5.2f} of read{kernel}")


def bench_qmatmul(ms: list[int], stream: float, sweep: bool, only: set[str] | None = None,
                  splits: bool = False, tiles: list[str] = (), extra: list[dict] = (), shapes: list = SHAPES,
                  min_bytes: int = MIN_BYTES, interpret: bool = False, exact: bool = True) -> list[dict]:
    """qmatmul (the Triton layout's route for each M under `exact`) and XLA's dequantize-then-dot on each shape at each
    M, with the variants asked for; `interpret` runs the kernels in interpret mode (a CPU check of the harness)."""
    rows = []
    for name, fmt, n, k in shapes:
        if only and f"{name}:{fmt}" not in only:
            continue
        qts, gguf_bytes = _copies(fmt, n, k, min_bytes)
        packed = [qm.pack(q.fmt, q.shape, q.data) for q in qts]
        for m in ms:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
            ref = qm.qmatmul_reference(x, packed[0], exact=exact)
            variants = [dict()]
            if sweep:
                variants += [dict(block_n=bn, columns=c, num_warps=nw)
                             for bn in (16, 32, 64) for c in (256, 512, 1024) for nw in (4, 8)]
            if splits:
                variants += [dict(splits=sp) for sp in (1, 2, 4, 8)]
            for t in tiles:  # BLOCK_N:COLUMNS:WARPS
                bn, cols, nw = (int(v) for v in t.split(":"))
                variants.append(dict(block_n=bn, columns=cols, num_warps=nw))
            variants += [{k: v for k, v in opts.items() if k != "m"} for opts in extra if opts.get("m", m) == m]
            for opts in variants:
                try:
                    run = jax.jit(lambda x, ws, o=opts: [qm.qmatmul(x, w, interpret=interpret, exact=exact, **o)
                                                         for w in ws])
                    out = run(x, packed)[0]
                    err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
                    times = _times(run, x, packed, gguf_bytes, stream)
                except Exception as e:  # a tile that does not compile is a result of the sweep, not a failure
                    print(f"  {name} {fmt} M={m} {opts}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                rows.append(dict(kernel="qmatmul", matrix=name, fmt=fmt, n=n, k=k, m=m, **(opts or {"tile": "default"}),
                                 packed_bytes=packed[0].nbytes, rel_err=err, **times))
                print(_line(name, fmt, m, str(opts or "default"), times) + f"  err {err:.1e}", flush=True)
            if not (sweep or splits) or m == ms[0]:
                xla = jax.jit(lambda x, ws: [jnp.dot(x, dequantize(w).astype(jnp.bfloat16).T,
                                                     preferred_element_type=jnp.float32) for w in ws])
                times = _times(xla, x, qts, gguf_bytes, stream)
                rows.append(dict(kernel="xla_dequant_dot", matrix=name, fmt=fmt, n=n, k=k, m=m, **times))
                print(_line(name, fmt, m, "XLA dequantize-then-dot", times), flush=True)
        del qts, packed
    return rows


def bench_qmatmul_mgpu(ms: list[int], stream: float, only: set[str] | None = None, extra: list[dict] = (),
                       shapes: list = SHAPES) -> list[dict]:
    """The Mosaic GPU kernels and qmatmul on each 27B Q4_K and Q6_K shape (of `shapes`) at each M, errors against the
    float32 product of the GGUF weights."""
    rows = []
    for name, fmt, n, k in shapes:
        if fmt not in ("Q4_K", "Q6_K") or (only and f"{name}:{fmt}" not in only):
            continue
        qts, gguf_bytes = _copies(fmt, n, k)
        module = mg if fmt == "Q4_K" else q6
        packed = {"qmatmul": [qm.pack(q.fmt, q.shape, q.data) for q in qts],
                  "qmatmul_mgpu": [module.pack(q.fmt, q.shape, q.data) for q in qts]}
        kernels = {"qmatmul": (qm.qmatmul, [dict()]), "qmatmul_mgpu": (module.qmatmul, [dict(), *extra])}
        exact_w = dequantize(qts[0])
        for m in ms:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
            exact = jnp.einsum("mk,nk->mn", x, exact_w, precision=jax.lax.Precision.HIGHEST)
            for kernel, (fn, variants) in kernels.items():
                weights = packed[kernel]
                for opts in variants:
                    run = jax.jit(lambda x, ws, fn=fn, o=opts: [fn(x, w, **o) for w in ws])
                    try:
                        first = run(x, weights[:1])[0]
                    except ValueError as e:  # an option this shape cannot take (a split that does not divide K)
                        print(f"  {name} {fmt} M={m} {opts}: {e}", flush=True)
                        continue
                    err = float(jnp.linalg.norm(first - exact) / jnp.linalg.norm(exact))
                    # bit for bit the same product on 8 more calls (XLA sums the K splits in a fixed order)
                    same = all(bool(jnp.array_equal(run(x, weights[:1])[0], first)) for _ in range(8))
                    times = _times(run, x, weights, gguf_bytes, stream)
                    rows.append(dict(kernel=kernel, matrix=name, fmt=fmt, n=n, k=k, m=m, **opts, rel_err=err,
                                     repeatable=same, **times))
                    print(_line(name, fmt, m, f"{kernel} {opts or ''}", times) + f"  err {err:.1e}"
                          + ("" if same else "  (not repeatable)"), flush=True)
        del qts, packed
    return rows


# weights one x multiplies, in one launch of the Mosaic kernel (kernels.linears): name, format, rows of each, K
GROUPS = [("ffn_gate+up", "Q4_K", (17408, 17408), 5120), ("attn_qkv+gate", "Q4_K", (10240, 6144), 5120),
          ("attn_q+k", "Q4_K", (12288, 1024), 5120)]


def bench_qmatmul_groups(ms: list[int], stream: float, groups: list = GROUPS) -> list[dict]:
    """Each group of weights (`GROUPS`) multiplied by one x: a launch of the Mosaic kernel per weight against one
    launch for the group (`qmatmul_many`), whose products must be the separate launches' bit for bit."""
    rows = []
    for name, fmt, ns, k in groups:
        module = mg if fmt == "Q4_K" else q6
        one = [random_matrix(jax.random.key(j), fmt, (n, k)) for j, n in enumerate(ns)]
        gguf_bytes = sum(q.nbytes for q in one)
        reps = max(2, min(64, math.ceil(MIN_BYTES / gguf_bytes)))
        copies = [tuple(module.pack(q.fmt, q.shape, q.data)
                        for q in (one if i == 0 else [random_matrix(jax.random.key(100 * i + j), fmt, (n, k))
                                                       for j, n in enumerate(ns)]))
                  for i in range(reps)]
        del one
        runs = {"a launch each": jax.jit(lambda x, gs: [[module.qmatmul(x, w) for w in g] for g in gs]),
                "one launch": jax.jit(lambda x, gs: [module.qmatmul_many(x, g) for g in gs])}
        for m in ms:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
            apart, together = (runs[r](x, copies[:1])[0] for r in runs)
            same = all(bool(jnp.array_equal(a, b)) for a, b in zip(apart, together))
            for what, run in runs.items():
                times = _times(run, x, copies, gguf_bytes, stream)
                rows.append(dict(kernel="qmatmul_group", matrix=name, fmt=fmt, rows=list(ns), k=k, m=m, how=what,
                                 bitwise_equal=same, **times))
                print(_line(name, fmt, m, what, times) + ("" if same else "  (NOT the separate launches' bits)"),
                      flush=True)
        del copies
    return rows


def _random_tree(n: int, seed: int = 0) -> jax.Array:
    """Ancestor-or-self mask of a bushy random tree of n nodes (parents within the previous 4 nodes)."""
    anc = jnp.eye(n, dtype=bool)
    parents = jax.random.randint(jax.random.key(seed), (n,), -4, 0) + jnp.arange(n)
    for i in range(1, n):
        anc = anc.at[i].set(anc[i] | anc[max(int(parents[i]), 0)])
    return anc


def _attention_caches(key: jax.Array, layers: int, slots: int, hkv: int, d: int, kind: str) -> list[tuple]:
    """Per layer, random K and V caches [slots, hkv, d] in KV type `kind` (drawn in bf16, then cast or quantized)."""
    draw = lambda k: kvq.stored(jax.random.normal(k, (slots, hkv, d), jnp.bfloat16),  # noqa: E731
                                kvq.empty(kind, (slots, hkv, d)))
    return [(draw(jax.random.fold_in(key[0], i)), draw(jax.random.fold_in(key[1], i))) for i in range(layers)]


ATTN_KERNELS = ("triton", "mosaic", "xla")


def bench_tree_attention(stream: float, sweep: bool, n: int = 23, contexts=(4096, 32768), exact: bool = True,
                         kv_types: tuple[str, ...] = ("bf16",), splits: tuple[int, ...] = (),
                         interpret: bool = False, mgpu_stages: tuple[int, ...] = (),
                         kernels: tuple[str, ...] = ATTN_KERNELS) -> list[dict]:
    """The 27B's tree attention (16 layers, `n` tree tokens) over a random cache of each context and type: the
    kernel at its defaults, at each prefix split of `splits`, with `sweep` at the tile variants and splits 8-64,
    and XLA's reference; `interpret` runs the kernel in interpret mode (a CPU check of the harness). On a GPU the
    Mosaic kernel also runs at its default pipeline depth and at each of `mgpu_stages`, each at the default split and
    at `splits`. `kernels`: which of the Triton kernel, the Mosaic one and XLA's reference
    (ATTN_KERNELS) to time."""
    if set(kernels) - set(ATTN_KERNELS):
        raise ValueError(f"tree attention kernels are {ATTN_KERNELS}, got {kernels}")
    cfg = load_target_config(CONFIG_27B)
    layers, hq, hkv, d = len(cfg.full_attention_layers), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    anc, lo = _random_tree(n), jnp.zeros(n, jnp.int32)
    rows = []
    for context, kind in itertools.product(contexts, kv_types):
        slots = context + 64
        key = jax.random.split(jax.random.key(context), 5)
        caches = _attention_caches(key, layers, slots, hkv, d, kind)
        q = jax.random.normal(key[2], (n, hq, d))
        kb, vb = (jax.random.normal(k, (n, hkv, d)) for k in key[3:5])
        # the block's rows as the cache holds them (cast or quantized), as models/target.py passes them
        kb, vb = kvq.stored(kb, caches[0][0]), kvq.stored(vb, caches[0][1])
        length = jnp.int32(context)
        stored = row_bytes(caches[0][0])
        floor_bytes = layers * (2 * context * hkv * stored + n * hq * d * 4 + 2 * n * hkv * row_bytes(kb))
        read = lambda cs: [(kvq.readable(kc), kvq.readable(vc)) for kc, vc in cs]  # noqa: E731
        rows_b = kvq.readable(kb), kvq.readable(vb)
        want = ref.tree_attention(q, *read(caches[:1])[0], length, *rows_b, anc, lo)
        variants = [dict()] + [dict(splits=sp) for sp in splits] if "triton" in kernels else []
        if sweep and "triton" in kernels:
            # tiles at the default split, then the split at the default tile (the 2026-11-23 and -27 files hold
            # an earlier sweep of splits x tiles: splits 8-64 changed little)
            variants += [dict(block_rows=r, block_k=b, num_warps=w, num_stages=st) for r in (32, 64, 128)
                         for b in (32, 64) for w in (4, 8) for st in (2, 3)]
            variants += [dict(splits=s) for s in (8, 32, 64)]
        if "mosaic" in kernels and kind in ("bf16", "q8_0") and not interpret and jax.default_backend() == "gpu":
            for stages in (None, *mgpu_stages):
                variants += [dict(mgpu=True, **({"stages": stages} if stages else {}),
                                  **({"splits": sp} if sp else {})) for sp in (None, *splits)]
        label = f"ctx={context:6d} N={n} {kind:5s}"
        for opts in variants:
            try:
                if opts.get("mgpu"):
                    sp, st = opts.get("splits"), opts.get("stages")  # None: the kernel's defaults
                    run = jax.jit(lambda q, cs, sp=sp, st=st: [
                        tree_attention_mgpu(q, kc, vc, length, kb, vb, anc, lo, splits=sp, exact=exact, stages=st)
                        for kc, vc in cs])
                else:
                    run = jax.jit(lambda q, cs, o=opts: [tree_attention(q, kc, vc, length, kb, vb, anc, lo,
                                                                        exact=exact, interpret=interpret, **o)
                                                         for kc, vc in cs])
                err = float(jnp.linalg.norm(run(q, caches)[0] - want) / jnp.linalg.norm(want))
                t = median_seconds(run, q, caches)
            except Exception as e:  # a variant that does not compile is a result of the sweep, not a failure
                print(f"  tree_attention {label} {opts}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            floor = floor_bytes / stream
            rows.append(dict(kernel="tree_attention_mgpu" if opts.get("mgpu") else "tree_attention", context=context,
                             n=n, layers=layers, kv_type=kind, **(opts or {"tile": "default"}),
                             us=t * 1e6, floor_us=floor * 1e6, floor_ratio=floor / t, rel_err=err,
                             **_kernel_times(run, q, caches)))
            print(f"  tree_attention {label} {str(opts or 'default'):45s} {t*1e6:8.1f} us "
                  f"(floor {floor*1e6:7.1f} us, {floor / t:4.2f} of it)  err {err:.1e}"
                  + _kernel_note(rows[-1], "tree_attention"), flush=True)
        if "xla" in kernels:  # the reference dequantizes each layer as the model's reference path does
            xla = jax.jit(lambda q, cs: [ref.tree_attention(q, kc, vc, length, *rows_b, anc, lo)
                                         for kc, vc in read(cs)])
            t = median_seconds(xla, q, caches)
            rows.append(dict(kernel="xla_tree_attention", context=context, n=n, layers=layers, kv_type=kind,
                             us=t * 1e6, floor_us=floor_bytes / stream * 1e6, floor_ratio=floor_bytes / stream / t,
                             **_kernel_times(xla, q, caches)))
            print(f"  tree_attention {label} {'XLA reference':45s} {t*1e6:8.1f} us"
                  + (f"  kernels {rows[-1]['kernel_us']:8.1f} us" if "kernel_us" in rows[-1] else ""), flush=True)
        del caches
    return rows


def weight_bytes_by_format() -> dict[str, int]:
    """Bytes of the 27B Q4_K_M matrices one decode step streams, by format: every matrix of the 64 layers and the
    output head (not the embedding table, read by row, nor the MTP block, which the engine does not run)."""
    cfg = load_target_config(CONFIG_27B)
    rule, totals = q4_k_m_rule(cfg), {}
    for name, spec in tensor_specs(cfg).items():
        block = int(name.split(".")[1]) if name.startswith("blk.") else -1
        if spec.kind != "matrix" or name == "token_embd.weight" or block >= cfg.num_layers:
            continue
        fmt = FORMATS[rule(name, spec).name]
        totals[fmt.name] = totals.get(fmt.name, 0) + math.prod(spec.shape) // fmt.block_size * fmt.type_size
    return totals


def ar_weight_bytes() -> int:
    """Bytes of the 27B Q4_K_M matrices one decode step streams (`weight_bytes_by_format`, summed)."""
    return sum(weight_bytes_by_format().values())


def bench_gdn(stream: float, n: int = 23, exact: bool = True) -> list[dict]:
    cfg = load_target_config(CONFIG_27B)
    layers, h = len(cfg.linear_attention_layers), cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    anc = _random_tree(n)
    per_layer, ssm = gdn_layer_inputs(1, layers, n, h, dk, dv)
    ar_s = ar_weight_bytes() / stream
    rows = []

    def verify_all(fn):
        return jax.jit(lambda xs, ssm: [fn(x["q"], x["k"], x["v"], x["g"], x["beta"], ssm[i], anc)
                                        for i, x in enumerate(xs)])

    leaf = jnp.int32(n - 1)
    tree, chunked = (functools.partial(f, exact=exact) for f in (gdn.gdn_tree, gdn.gdn_chunked))
    one = [{name: a[:1] for name, a in x.items()} for x in per_layer]  # the AR step's token
    one_run = jax.jit(lambda xs, ssm: [tree(x["q"], x["k"], x["v"], x["g"], x["beta"], ssm[i], jnp.ones((1, 1), bool))
                                       for i, x in enumerate(xs)])
    for name, run, xs, tokens in (("gdn verify", verify_all(tree), per_layer, n),
                                  ("XLA reference verify", verify_all(ref.gdn_block), per_layer, n),
                                  ("gdn one token", one_run, one, 1)):
        t = median_seconds(run, xs, ssm)
        rows.append(dict(kernel=name, n=tokens, layers=layers, us=t * 1e6, ar_weights_us=ar_s * 1e6, of_ar=t / ar_s,
                         **_kernel_times(run, xs, ssm)))
        print(f"  {name:22s} N={tokens} x {layers} layers {t*1e6:8.1f} us = {t / ar_s:5.3f} of the AR step's weight "
              f"streaming ({ar_s*1e6:.0f} us)" + _kernel_note(rows[-1], "gdn"), flush=True)
    tokens64 = [{name: jnp.concatenate([a, a, a])[:64] for name, a in x.items()} for x in per_layer]
    def prefill_all(fn):
        return jax.jit(lambda xs, ssm: [fn(x["q"], x["k"], x["v"], x["g"], x["beta"], ssm[i])
                                        for i, x in enumerate(xs)])
    for name, run in (("gdn prefill chunk", prefill_all(chunked)),
                      ("XLA reference prefill", prefill_all(ref.gdn_chunked))):
        t = median_seconds(run, tokens64, ssm)
        rows.append(dict(kernel=name, n=64, layers=layers, us=t * 1e6, ar_weights_us=ar_s * 1e6, of_ar=t / ar_s,
                         **_kernel_times(run, tokens64, ssm)))
        print(f"  {name:22s} T=64 x {layers} layers {t*1e6:8.1f} us" + _kernel_note(rows[-1], "gdn"), flush=True)
    outs = verify_all(tree)(per_layer, ssm)
    carry = (jnp.stack([x["k"] for x in per_layer]), jnp.stack([o[1] for o in outs]), jnp.stack([o[2] for o in outs]))
    commit = jax.jit(lambda s, k, vn, gm: gdn.gdn_commit(s, k, vn, gm, anc[n - 1], leaf, exact=exact))
    commit_ref = jax.jit(lambda s, k, vn, gm: jax.vmap(
        lambda s, k, vn, gm: ref.gdn_path_state(k, vn, gm, s, anc[n - 1], leaf))(s, k, vn, gm))
    state_bytes = 2 * ssm.nbytes  # read S0, write S
    for name, run in (("gdn commit", commit), ("XLA reference commit", commit_ref)):
        t = median_seconds(run, ssm, *carry)
        rows.append(dict(kernel=name, n=n, layers=layers, us=t * 1e6, floor_us=state_bytes / stream * 1e6,
                         floor_ratio=state_bytes / stream / t, ar_weights_us=ar_s * 1e6, of_ar=t / ar_s,
                         **_kernel_times(run, ssm, *carry)))
        print(f"  {name:22s} N={n} x {layers} layers {t*1e6:8.1f} us (state read + write floor "
              f"{state_bytes / stream * 1e6:.0f} us) = {t / ar_s:5.3f} of the AR step's weight streaming"
              + _kernel_note(rows[-1], "gdn"), flush=True)
    return rows


GDN_BLOCK_V = (16, 32, 64, 128)
GDN_WARPS = (1, 2, 4, 8)


def bench_gdn_tiles(n: int = 23, layers: int | None = None, heads: int | None = None, dims: tuple[int, int] | None = None,
                    block_vs: tuple[int, ...] = GDN_BLOCK_V, warps: tuple[int, ...] = GDN_WARPS, interpret: bool = False,
                    exact: bool = True) -> list[dict]:
    """The delta rule's tiles: one token's verify (the AR step), an n-node tree's verify, and the commit of one token
    and of a path through that tree, over the 27B's GDN layers (or `layers`, `heads`, `dims` = (dk, dv): a CPU check
    in interpret mode), each tile against the defaults: wall us, the kernels' GPU us, and the fraction of output
    elements bitwise equal to the defaults' (`equal`) with the largest difference."""
    cfg = load_target_config(CONFIG_27B)
    layers = layers or len(cfg.linear_attention_layers)
    h = heads or cfg.linear_num_value_heads
    dk, dv = dims or (cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    anc = _random_tree(n)
    per_layer, ssm = gdn_layer_inputs(1, layers, n, h, dk, dv)
    one = [{name: a[:1] for name, a in x.items()} for x in per_layer]
    one_anc = jnp.ones((1, 1), bool)

    def verify(xs, mask, tiles):
        return jax.jit(lambda xs, ssm: [gdn.gdn_tree(x["q"], x["k"], x["v"], x["g"], x["beta"], ssm, mask, layer=i,
                                                     interpret=interpret, exact=exact, **tiles)
                                        for i, x in enumerate(xs)])

    tree_out = verify(per_layer, anc, {})(per_layer, ssm)
    path, leaf = anc[n - 1], jnp.int32(n - 1)
    commit_args = {
        1: (jnp.stack([x["k"] for x in one]), jnp.stack([o[1][:1] for o in tree_out]),
            jnp.stack([o[2][:1] for o in tree_out]), jnp.ones(1, bool), jnp.int32(0)),
        n: (jnp.stack([x["k"] for x in per_layer]), jnp.stack([o[1] for o in tree_out]),
            jnp.stack([o[2] for o in tree_out]), path, leaf)}

    def commit(tokens, tiles):
        k, vn, gm, on_path, last = commit_args[tokens]
        return jax.jit(lambda ssm: gdn.gdn_commit(ssm, k, vn, gm, on_path, last, interpret=interpret, exact=exact,
                                                  **tiles))

    cases = (("gdn verify", 1, lambda t: verify(one, one_anc, t), (one, ssm)),
             ("gdn verify", n, lambda t: verify(per_layer, anc, t), (per_layer, ssm)),
             ("gdn commit", 1, lambda t: commit(1, t), (ssm,)),
             ("gdn commit", n, lambda t: commit(n, t), (ssm,)))
    rows = []
    for name, tokens, make, args in cases:
        want = None  # the defaults' outputs, from the first row
        for tiles in [{}] + [dict(block_v=b, num_warps=w) for b in block_vs if b <= dv for w in warps]:
            run = make(tiles)
            got = [np.asarray(a) for a in jax.tree.leaves(run(*args))]
            want = got if want is None else want
            equal = min(float(np.mean(a == b)) for a, b in zip(got, want))
            diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want))
            t = median_seconds(run, *args)
            rows.append(dict(kernel=f"{name} tiles", n=tokens, layers=layers, tiles=tiles or "default", us=t * 1e6,
                             equal=equal, max_diff=diff, **_kernel_times(run, *args)))
            r = rows[-1]
            print(f"  {name:10s} N={tokens:2d} {str(tiles or 'default'):34s} {t * 1e6:9.1f} us{_kernel_note(r, 'gdn')}"
                  f"  equal {equal:.4f} (max diff {diff:.1e})", flush=True)
    return rows


def bench_tree_conv(stream: float, n: int = 23) -> list[dict]:
    cfg = load_target_config(CONFIG_27B)
    layers, c, kernel = len(cfg.linear_attention_layers), cfg.conv_dim, cfg.conv_kernel
    anc = _random_tree(n)
    index = conv_index(Block(anc=anc, depth=anc.sum(axis=1).astype(jnp.int32) - 1), kernel)
    keys = jax.random.split(jax.random.key(5), 2 * layers)
    xs = [jax.random.normal(keys[i], (kernel - 1 + n, c)) for i in range(layers)]
    ws = [jax.random.normal(keys[layers + i], (c, kernel)) for i in range(layers)]
    moved = layers * (xs[0].nbytes + ws[0].nbytes + n * c * 4)
    want = ref.tree_conv(xs[0], index, ws[0])
    rows = []
    variants = [dict(block_c=b, num_warps=w) for b in (32, 64, 128, 256) for w in (1, 4)] + [None]
    for opts in variants:
        fn = ref.tree_conv if opts is None else functools.partial(tree_conv, **opts)
        run = jax.jit(lambda xs, ws, fn=fn: [fn(x, index, w) for x, w in zip(xs, ws)])
        err = float(jnp.max(jnp.abs(run(xs, ws)[0] - want)))
        t = median_seconds(run, xs, ws)
        name = "XLA reference conv" if opts is None else "tree_conv " + " ".join(f"{k}={v}" for k, v in opts.items())
        rows.append(dict(kernel=name, n=n, layers=layers, us=t * 1e6, floor_us=moved / stream * 1e6,
                         floor_ratio=moved / stream / t, max_err=err))
        print(f"  {name:42s} N={n} x {layers} layers {t*1e6:8.1f} us (bytes floor {moved / stream * 1e6:.1f} us) "
              f"err {err:.1e}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="results JSON")
    ap.add_argument("--sweep", action="store_true", help="also time tile variants of qmatmul")
    ap.add_argument("--splits", action="store_true", help="also time qmatmul with K split over 1, 2, 4, 8 programs")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 32], help="token counts for qmatmul")
    ap.add_argument("--only", nargs="+", help="matrices to run, as NAME:FMT (e.g. ffn_down:Q6_K)")
    ap.add_argument("--tiles", nargs="+", default=[], metavar="BN:COLS:WARPS",
                    help="also time qmatmul with these tiles (rows of W, columns per step, warps)")
    ap.add_argument("--variants", nargs="+", default=[], type=parse_options, metavar="KEY=VALUE,...",
                    help="also time qmatmul with these tuning arguments (e.g. block_n=32 m=1,block_n=16,splits=2; "
                         "m=M times that variant at M tokens only); with qmatmul_mgpu, the Mosaic kernels with "
                         "theirs (splits, stages)")
    ap.add_argument("--kernels", nargs="+", default=["qmatmul", "tree_attention", "gdn"],
                    choices=["qmatmul", "qmatmul_mgpu", "qmatmul_groups", "tree_attention", "gdn", "tree_conv"],
                    help="which kernels to time")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768],
                    help="tree_attention's committed contexts in tokens (default: 4096 32768)")
    ap.add_argument("--attn_tokens", type=int, nargs="+", default=[23],
                    help="tree_attention's block sizes in tokens (default: 23, DDTree-22's tree; 1 is the AR step)")
    ap.add_argument("--attn_kernels", nargs="+", choices=ATTN_KERNELS, default=list(ATTN_KERNELS),
                    help="which tree attentions to time: the Triton kernel, the Mosaic GPU one (Hopper), XLA's "
                         "reference (default: all)")
    ap.add_argument("--attn_splits", type=int, nargs="+", default=[],
                    help="tree_attention also at these prefix splits (the default: one per 1024 slots, at most 32)")
    ap.add_argument("--mgpu_stages", nargs="+", type=int, default=[], choices=(1, 2),
                    help="tree_attention's Mosaic GPU kernel also at these pipeline depths (default: its own)")
    ap.add_argument("--kv_types", nargs="+", choices=KV_TYPES, default=["bf16"],
                    help="tree_attention's cache types (K and V alike)")
    ap.add_argument("--numerics", choices=NUMERICS, default=None,
                    help="the kernels' rounding (KernelConfig.numerics); default: this device's, as generate's")
    ap.add_argument("--shard", type=int, default=1, metavar="N",
                    help="qmatmul and qmatmul_mgpu on the matrices as one shard of the target split N ways holds them "
                         "(--devices N): rows or columns divided by N")
    args = ap.parse_args(argv)
    shapes = shard_shapes(SHAPES, args.shard) if args.shard > 1 else SHAPES
    exact = resolve_kernels(numerics=args.numerics).exact
    env = {**environment(), "exact": exact}
    copy, stream = copy_rate(), read_rate()
    print(f"{env}\ncopy rate {copy / 1e12:.2f} TB/s (read + write), read stream {stream / 1e12:.2f} TB/s", flush=True)
    rows = []
    if "qmatmul" in args.kernels:
        rows += bench_qmatmul(args.m, stream, args.sweep, set(args.only or ()), args.splits, args.tiles, args.variants,
                              shapes=shapes, exact=exact)
    if "qmatmul_mgpu" in args.kernels:
        rows += bench_qmatmul_mgpu(args.m, stream, set(args.only or ()), args.variants, shapes)
    if "qmatmul_groups" in args.kernels:
        rows += bench_qmatmul_groups(args.m, stream)
    if "tree_attention" in args.kernels:
        for n in args.attn_tokens:
            rows += bench_tree_attention(stream, args.sweep, n=n, contexts=tuple(args.contexts), exact=exact,
                                         kv_types=tuple(args.kv_types), splits=tuple(args.attn_splits),
                                         mgpu_stages=tuple(args.mgpu_stages), kernels=tuple(args.attn_kernels))
    if "gdn" in args.kernels:
        rows += bench_gdn(stream, exact=exact)
        if args.sweep:
            rows += bench_gdn_tiles(exact=exact)
    if "tree_conv" in args.kernels:
        rows += bench_tree_conv(stream)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(env, copy_rate=copy, read_rate=stream, shard=args.shard, results=rows),
                                   indent=1))
    for r in rows:
        if r["kernel"] not in ("qmatmul", "qmatmul_mgpu", "qmatmul_group", "xla_dequant_dot") and "splits" not in r:  # not a sweep
            extra = f"  {r['floor_ratio']:.2f} of floor" if "floor_ratio" in r else ""
            extra += f"  {r['of_ar']:.3f} of AR weights" if "of_ar" in r else ""
            where = f"ctx {r['context']}" + (f" N={r['n']}" if "n" in r else "") if "context" in r else ""
            print(f"{r['kernel']:22s} {where:15s} {r.get('kv_type', ''):5s} {r['us']:9.1f} us" + extra)
    if "qmatmul" in args.kernels:
        print(qmatmul_table(rows, args.m, [shape for shape in shapes
                                           if not args.only or f"{shape[0]}:{shape[1]}" in args.only]))


def qmatmul_table(rows: list[dict], ms: list[int], shapes: list) -> str:
    """qmatmul's default-tile rows as a table: us per product (wall) and the ratio of GGUF weight bytes/s to the
    read-stream rate (wall / kernel time) at each M, XLA's ratio at the first M."""
    lines = ["", "qmatmul, default tiles (us per product, wall; ratio = GGUF weight bytes/s over the read-stream rate, "
             "wall / kernel time)",
             f"{'matrix':12s} {'fmt':5s} {'N':>6s} {'K':>6s} " + " ".join(f"{'M=' + str(m):>18s}" for m in ms)
             + "   XLA M=" + str(ms[0])]
    for name, fmt, n, k in shapes:
        cells = []
        for m in ms:
            r = next((r for r in rows if r["kernel"] == "qmatmul" and r["matrix"] == name and r["fmt"] == fmt
                      and r["m"] == m and r.get("tile") == "default"), None)
            kernel = f"/{r['kernel_ratio']:4.2f}" if r and "kernel_ratio" in r else " " * 5
            cells.append(f"{r['us']:6.1f}us {r['ratio']:4.2f}{kernel}" if r else f"{'-':>18s}")
        x = next((r for r in rows if r["kernel"] == "xla_dequant_dot" and r["matrix"] == name and r["fmt"] == fmt
                  and r["m"] == ms[0]), None)
        lines.append(f"{name:12s} {fmt:5s} {n:6d} {k:6d} " + " ".join(cells) + (f"   {x['ratio']:4.2f}" if x else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
