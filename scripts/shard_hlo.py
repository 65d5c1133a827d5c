"""What the tensor-parallel step moves between devices, read off its programs on the CPU (issue 45; no GPU needed).

    python scripts/shard_hlo.py [--layers 4] [--out FILE.json]

The synthetic 27B (its widths, vocabulary and Q4_K_M types) cut to its first `--layers` layers, split over 2 CPU
devices, its AR and DDTree-22 steps (a one-layer DFlash drafter of the 27B drafter's widths): compiled for the CPU with
the reference kernels, beside the same steps on one device (the ops the split adds or removes), and lowered for CUDA
with a Hopper's kernels (Pallas Triton and Mosaic GPU, as `bench.py --devices 2` runs them). Prints per step each
collective with its result shapes, the outputs written in place of the donated state, the copies and transposes of
1 MiB or more, what the CUDA program's main function does outside its shard_map and which arguments enter the shard_map
resharded.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_jax.config import EngineConfig, ParallelConfig, load_draft_config, load_target_config  # noqa: E402
from dflash_jax.defaults import resolve_kernels  # noqa: E402
from dflash_jax.engine.generate import Engine  # noqa: E402
from dflash_jax.engine.state import DecodeState  # noqa: E402
from dflash_jax.engine.step import DFlashDrafter  # noqa: E402
from dflash_jax.kernels import REFERENCE  # noqa: E402
from dflash_jax.parallel import ShardedTarget  # noqa: E402
from dflash_jax.testing import synthetic  # noqa: E402
from dflash_jax.testing.hlo import aliased_outputs, collectives, outside_shard_map, resharded_arguments  # noqa: E402

BIG = 1 << 20  # bytes: copies and transposes listed from this size
BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
         "s8": 1, "u8": 1, "pred": 1}


def models(layers: int):
    """(target config, the whole target in the stored layout, drafter config, drafter) at the 27B's widths."""
    big = load_target_config(synthetic.TARGET_27B)
    cfg = dataclasses.replace(big, num_layers=layers, layer_types=big.layer_types[:layers], num_mtp_layers=0)
    dbig = load_draft_config(synthetic.DRAFT_27B)
    dcfg = dataclasses.replace(dbig, num_layers=1, layer_types=dbig.layer_types[:1],
                               target_layer_ids=(min(1, layers - 1), layers - 1), num_target_layers=layers)
    return cfg, synthetic.synthetic_target(cfg, kcfg=REFERENCE), dcfg


def step_args(engine: Engine) -> tuple:
    """The step's arguments for a fresh state, placed as `Engine.generate` places them."""
    tstate, dstate = engine._empty_states()
    root, remaining, done = engine.tsplit.replicated((jnp.int32(1), jnp.int32(10), jnp.bool_(False)))
    state = DecodeState(target=tstate, draft=dstate, root=root, remaining=remaining, done=done)
    return engine.tweights, engine.dweights, state, engine.stop_array(())


def op_counts(hlo: str) -> collections.Counter:
    return collections.Counter(re.findall(r"^\s*(?:ROOT )?%\S+ = \S+ ([a-z][\w-]*)\(", hlo, re.M))


def large_copies(hlo: str) -> dict[str, int]:
    """Copies and transposes of BIG bytes or more: 'op shape' -> count."""
    out = collections.Counter()
    for shape, op in re.findall(r"^\s*(?:ROOT )?%\S+ = (\w+\[[\d,]*\])\S* (copy|transpose)\(", hlo, re.M):
        dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", shape).groups()
        size = BYTES.get(dtype, 4)
        for d in filter(None, dims.split(",")):
            size *= int(d)
        if size >= BIG:
            out[f"{op} {shape}"] += 1
    return dict(out)


def engine(cfg, target, dcfg, mode: str, kcfg, devices: int) -> Engine:
    drafter = DFlashDrafter(dcfg, kcfg.drafter) if mode == "ddtree" else None
    draft = synthetic.synthetic_draft(dcfg, kcfg=kcfg) if drafter else None
    ecfg = EngineConfig(mode=mode, budget=22, max_ctx=4096, kv_type="bf16")
    return Engine(cfg, target, ecfg, drafter, draft, kcfg=kcfg, parallel=ParallelConfig(devices))


def report(layers: int) -> dict:
    cfg, target, dcfg = models(layers)
    out = dict(layers=layers, hidden=cfg.hidden_size, vocab=cfg.vocab_size)
    for mode in ("ar", "ddtree"):
        row = out[mode] = {}
        compiled = {}
        for devices in (1, 2):  # the reference kernels on the CPU
            split = ShardedTarget.over(target, REFERENCE, ParallelConfig(2)) if devices == 2 else target
            e = engine(cfg, split, dcfg, mode, REFERENCE, devices)
            compiled[devices] = e.step.lower(*step_args(e)).compile().as_text()
            del e, split
        hlo = compiled[2]
        row["collectives"] = {k: dict(collections.Counter(v)) for k, v in collectives(hlo).items()}
        row["aliased"], row["large_copies"] = aliased_outputs(hlo), large_copies(hlo)
        one, two = op_counts(compiled[1]), op_counts(compiled[2])
        row["ops_added_by_the_split"] = {op: two[op] - one[op] for op in sorted(set(one) | set(two))
                                         if two[op] != one[op] and op not in ("parameter", "bitcast")}
        row["large_copies_one_device"] = large_copies(compiled[1])
        kcfg = resolve_kernels(mode, device="hopper")  # lowered for CUDA with the GPU kernels
        e = engine(cfg, ShardedTarget.over(target, kcfg, ParallelConfig(2)), dcfg, mode, kcfg, 2)
        mlir = e.step.trace(*step_args(e)).lower(lowering_platforms=("cuda",)).as_text()
        row["cuda"] = dict(kernels=kcfg.describe(), outside_shard_map=dict(outside_shard_map(mlir)),
                           resharded=resharded_arguments(mlir),
                           all_reduce=mlir.count("stablehlo.all_reduce"), all_gather=mlir.count("stablehlo.all_gather"),
                           other_collectives=sum(mlir.count(f"stablehlo.{op}") for op in (
                               "all_to_all", "collective_permute", "reduce_scatter")))
        del e
    return out


def print_report(out: dict) -> None:
    print(f"synthetic 27B widths, {out['layers']} layers, hidden {out['hidden']}, vocabulary {out['vocab']}, "
          f"2 CPU devices")
    for mode in ("ar", "ddtree"):
        row = out[mode]
        print(f"\n{mode}: compiled for the CPU (reference kernels)")
        for kind, shapes in row["collectives"].items():
            for shape, n in shapes.items():
                print(f"  {kind:18s} {shape:20s} x {n} ({n / out['layers']:g} a layer)")
        print(f"  outputs written in place of the donated state: {row['aliased']}")
        print(f"  ops the split adds (against one device): {row['ops_added_by_the_split']}")
        print(f"  copies/transposes >= 1 MiB, 2 devices: {row['large_copies']}")
        print(f"  copies/transposes >= 1 MiB, 1 device:  {row['large_copies_one_device']}")
        cuda = row["cuda"]
        print(f"{mode}: lowered for CUDA ({cuda['kernels']}): {cuda['all_reduce']} all-reduce, {cuda['all_gather']} "
              f"all-gather, {cuda['other_collectives']} other collectives; outside the shard_map "
              f"{cuda['outside_shard_map']}; arguments resharded {cuda['resharded']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="the 27B's first layers (4: three GDN, one attention)")
    ap.add_argument("--out", type=Path, help="also write the report as JSON")
    args = ap.parse_args()
    out = report(args.layers)
    print_report(out)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
