"""`python -m dflash_jax.inspect FILE.gguf`: the config, bytes per tensor type and the tensor table of a GGUF.

Like gguf-py's `gguf_dump`, but every tensor is checked against the `qwen35` architecture first. A file that cannot
be used prints one line saying why and exits with status 2.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from absl import app, flags

from dflash_jax.errors import run_main
from dflash_jax.gguf import GGUFModel

_TENSORS = flags.DEFINE_boolean("tensors", True, "Print the per-tensor table.")
_METADATA = flags.DEFINE_boolean("metadata", False, "Also print every metadata key (long arrays summarised).")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def report(model: GGUFModel) -> str:
    """The text `inspect` prints for an opened model."""
    cfg = model.config
    lines = [f"file: {model.path}", "config (TargetConfig):"]
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if field.name == "layer_types":
            value = f"{len(cfg.linear_attention_layers)} linear_attention, full_attention at " \
                    f"{list(cfg.full_attention_layers)}"
        lines.append(f"  {field.name:24s} {value}")
    if _METADATA.value:
        lines.append("metadata:")
        lines += [f"  {k:44s} {v}" for k, v in model.metadata()]

    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for name, info in model.tensors.items():
        n = 1
        for d in info.shape:
            n *= d
        entry = by_type[info.ggml_type.name]
        entry[0] += 1
        entry[1] += n
        entry[2] += info.nbytes
    total_bytes = sum(e[2] for e in by_type.values())
    total_params = sum(e[1] for e in by_type.values())
    lines.append("bytes by tensor type:")
    lines.append(f"  {'type':6s} {'tensors':>7s} {'params':>14s} {'bytes':>12s} {'share':>6s} {'bits/weight':>11s}")
    for t, (count, n, nbytes) in sorted(by_type.items(), key=lambda kv: -kv[1][2]):
        lines.append(f"  {t:6s} {count:7d} {n:14,d} {_human(nbytes):>12s} {100 * nbytes / total_bytes:5.1f}% "
                     f"{8 * nbytes / n:11.3f}")
    lines.append(f"  {'total':6s} {len(model.tensors):7d} {total_params:14,d} {_human(total_bytes):>12s} "
                 f"100.0% {8 * total_bytes / total_params:11.3f}")
    if _TENSORS.value:
        lines.append("tensors (ne = ggml order, fastest dimension first; all shapes match the config):")
        lines.append(f"  {'name':40s} {'type':6s} {'ne':>16s} {'bytes':>12s}")
        for name, info in model.tensors.items():
            ne = ", ".join(str(d) for d in reversed(info.shape))
            lines.append(f"  {name:40s} {info.ggml_type.name:6s} {ne:>16s} {_human(info.nbytes):>12s}")
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    """The command; returns its exit code."""
    if len(argv) != 2:
        raise app.UsageError("usage: python -m dflash_jax.inspect FILE.gguf [--notensors] [--metadata]", exitcode=2)
    print(report(GGUFModel(argv[1])))
    return 0


def main(argv: list[str]) -> None:
    run_main("inspect", run, argv)


if __name__ == "__main__":
    app.run(main)
