"""GPU kernel times of the same products in two bench_kernels.py runs, against the two runs' copy rates.

    python scripts/compare_kernel_runs.py A.json B.json [--out FILE.txt]

For every product both runs timed with a GPU kernel time (the same kernel, matrix, format, tokens and options), the
line gives its kernel time in A and in B and B's over A's. The header gives A's copy rate over B's: between two
devices with the same SMs and clocks but different memory (an H100 SXM and an H200), a product bound by memory
bandwidth takes about that ratio of the time on B, one bound by its instructions or their latency about the same
time on both. The median of each kernel's time ratios is printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# a result's measurements (everything else names the product and its options)
MEASURED = {"us", "rate", "ratio", "kernel_us", "kernel_ratio", "kernels_us", "rel_err", "repeatable", "gguf_bytes",
            "packed_bytes", "floor_us", "floor_ratio", "ar_weights_us", "of_ar"}


def product_key(row: dict) -> tuple:
    """What names a result: its fields that are not measurements, sorted."""
    return tuple(sorted((k, v) for k, v in row.items() if k not in MEASURED))


def kernel_times(run: dict) -> dict[tuple, float]:
    """A run's GPU kernel time (us) by product key, for the results that have one."""
    return {product_key(r): r["kernel_us"] for r in run["results"] if "kernel_us" in r}


def compare(a: dict, b: dict) -> list[dict]:
    """One row per product timed in both runs (A's order): its key's fields, each run's kernel time and B / A."""
    times_b = kernel_times(b)
    return [dict(dict(k), a_us=t, b_us=times_b[k], b_over_a=times_b[k] / t)
            for k, t in kernel_times(a).items() if k in times_b]


def _label(row: dict) -> str:
    options = {k: v for k, v in row.items()
               if k not in ("kernel", "matrix", "fmt", "n", "k", "m", "a_us", "b_us", "b_over_a", "tile")}
    return (f"{row['kernel']:16s} {row.get('matrix', ''):12s} {row.get('fmt', ''):5s} M={row.get('m', '-')!s:3s}"
            f" {options if options else ''}")


def report(a: dict, b: dict, names: tuple[str, str]) -> str:
    """The comparison as text: both runs' devices and copy rates, a line a product, the medians by kernel."""
    rows = compare(a, b)
    lines = [f"A: {names[0]} ({a['device']}, jax {a['jax']}, {a['date']}), copy rate {a['copy_rate'] / 1e12:.2f} TB/s",
             f"B: {names[1]} ({b['device']}, jax {b['jax']}, {b['date']}), copy rate {b['copy_rate'] / 1e12:.2f} TB/s",
             f"copy rate A / B = {a['copy_rate'] / b['copy_rate']:.2f} (the time ratio of a bandwidth-bound product)",
             "", f"{'product':62s} {'A us':>9s} {'B us':>9s}  B / A"]
    lines += [f"{_label(r):62s} {r['a_us']:9.1f} {r['b_us']:9.1f}  {r['b_over_a']:.2f}" for r in rows]
    lines.append("\nmedian B / A by kernel:")
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        ratios = [r["b_over_a"] for r in rows if r["kernel"] == kernel]
        lines.append(f"  {kernel:18s} {statistics.median(ratios):.2f} over {len(ratios)} products"
                     f" ({min(ratios):.2f}-{max(ratios):.2f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="bench_kernels.py results JSON")
    ap.add_argument("b", type=Path, help="bench_kernels.py results JSON")
    ap.add_argument("--out", type=Path, help="also write the report here")
    args = ap.parse_args(argv)
    text = report(json.loads(args.a.read_text()), json.loads(args.b.read_text()), (args.a.name, args.b.name))
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
