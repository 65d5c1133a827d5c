"""The Mosaic GPU kernels' PTX and ptxas report (Q4_K, or Q6_K with --fmt; the tree attention with --attention), on
a Hopper GPU: registers, spills, and the instructions of its pipeline loop (how many of each opcode, the barriers,
the wgmma waits).

    python scripts/mgpu_ptx.py --out DIR [--n 1024 --k 5120 --m 23 --fmt Q4_K]
    python scripts/mgpu_ptx.py --out DIR --attention q8_0 [--m 23 --context 131072 --stages 2]
    python scripts/mgpu_ptx.py --read scripts/results/ptx/qmatmul_mgpu_wgmma_m23_h200.ptx   # a saved dump, no GPU
    python scripts/mgpu_ptx.py --read ... --sass   # also assembled for sm_90a by pip's triton (no GPU either)

Mosaic GPU writes what it compiles where MOSAIC_GPU_DUMP_TO says, when MOSAIC_GPU_DUMP_PTX and MOSAIC_GPU_DUMP_PTXAS
are set; the script sets them, runs the kernel once on a random weight (which compiles it) and checks it against its
reference, then reads the dump (the tree attention: the 27B's heads, one layer, a random tree of --m tokens over
--context committed ones, at its default splits). The opcode counts are of the whole kernel, the loop's body
unrolled over the super-block's 8 sub-blocks; inline PTX counts by the instructions inside it. `--sass` assembles
the PTX with the ptxas of pip's `triton` package (its PTX ISA may be older than Mosaic GPU's: the `.version` line is
lowered to what that ptxas takes, which it says when it refuses) and reports the SASS: the kernel's instruction
count and its pipeline loop's (the longest loop, `qmatmul_sass.loops`) by opcode.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# a statement's opcode: after an optional label and predicate, letters, digits, dots, underscores and colons
_OPCODE = re.compile(r"^(?:\$?\w+:\s*)?(?:@!?%?\w+\s+)?([a-z][a-z0-9_]*(?:\.[a-z0-9_:]+)*)(?:\s|$)")


def opcode_counts(ptx: str) -> collections.Counter:
    """How many times each PTX opcode (with its type suffixes) appears in `ptx`, inline assembly included: each
    statement (text between `;`, `{`, `}` and line ends, comments dropped) that is not a directive counts once."""
    counts = collections.Counter()
    code = re.sub(r"//[^\n]*", "", ptx)
    for statement in re.split(r"[;{}\n]", code):
        statement = statement.strip()
        if statement and not statement.startswith(".") and (match := _OPCODE.match(statement)):
            counts[match.group(1)] += 1
    return counts


def summary(ptx: str) -> dict:
    """The counts that say how the kernel spends a step: wgmma issues and waits, warpgroup barriers, TMA copies,
    shared-memory loads and the conversion's lop3/sub/fma."""
    counts = opcode_counts(ptx)
    pick = lambda prefix: sum(c for op, c in counts.items() if op.startswith(prefix))  # noqa: E731
    return {"wgmma.mma_async": pick("wgmma.mma_async"), "wgmma.wait_group": pick("wgmma.wait_group"),
            "bar.sync": pick("bar.sync"), "cp.async.bulk.tensor (TMA)": pick("cp.async.bulk.tensor"),
            "ld.shared": pick("ld.shared"), "ldmatrix": pick("ldmatrix"), "lop3": pick("lop3"),
            "sub.f16x2": pick("sub.f16x2"), "fma.rn.f16x2": pick("fma.rn.f16x2"), "shfl": pick("shfl"),
            "prmt": pick("prmt")}


def report(ptx: str, ptxas: str = "") -> str:
    """The ptxas lines that matter and the opcode summary, as text."""
    lines = [line.strip() for line in ptxas.splitlines()
             if any(word in line for word in ("registers", "spill", "serializ", "Warning"))]
    lines += [f"{name:28s} {count}" for name, count in summary(ptx).items()]
    lines.append("most frequent: " + ", ".join(f"{op} {c}" for op, c in opcode_counts(ptx).most_common(12)))
    return "\n".join(lines)


def _dump_to(out: Path) -> None:
    """Mosaic GPU's PTX and ptxas dumps to `out`, on a Hopper GPU, with the repository importable. Mosaic GPU reads
    the variables when it compiles, so this runs before jax is imported here."""
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=str(out))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dflash_jax.defaults import device_class

    if device_class() != "hopper":
        raise SystemExit("the Mosaic GPU kernels need a Hopper GPU (compute capability 9.x)")


def _dumped(out: Path, pattern: str) -> tuple[str, str]:
    """The PTX and ptxas texts of the last kernel dumped to `out` whose PTX file matches `pattern`."""
    ptx = sorted(out.glob(pattern))
    if not ptx:
        raise SystemExit(f"no PTX was dumped to {out}")
    ptxas = ptx[-1].with_suffix(".ptxas")
    return ptx[-1].read_text(), ptxas.read_text() if ptxas.exists() else ""


def dump(out: Path, n: int, k: int, m: int, fmt: str = "Q4_K") -> tuple[str, str]:
    """Compile and run the kernel for `fmt` (Q4_K: qmatmul_mgpu; Q6_K: qmatmul_mgpu_q6k) once with Mosaic GPU's
    dumps going to `out`; the PTX and ptxas texts."""
    _dump_to(out)
    import jax
    import jax.numpy as jnp

    from dflash_jax.testing.synthetic import random_matrix
    from pallas_kernels import qmatmul as qm

    qt, kernel = random_matrix(jax.random.key(0), fmt, (n, k)), qm.MGPU_MODULES[fmt]
    w = kernel.pack(qt.fmt, qt.shape, qt.data)
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.float32)
    got, want = kernel.qmatmul(x, w), kernel.reference(x, w)
    print(f"max |kernel - reference| = {float(jnp.abs(got - want).max()):.2e}")
    return _dumped(out, f"qmatmul_mgpu_{fmt.lower()}*.ptx")


def dump_attention(out: Path, m: int, context: int, kind: str, stages: int | None = None) -> tuple[str, str]:
    """Compile and run the Mosaic tree attention (tree_attention_mgpu.py) once over a `kind` cache (bf16 or q8_0) with
    Mosaic GPU's dumps going to `out`; the PTX and ptxas texts. `stages`: the pipeline's depth (default: the kernel's
    own choice)."""
    _dump_to(out)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dflash_jax import kv_quant as kvq
    from dflash_jax.testing.trees import random_ancestors
    from pallas_kernels import reference as ref
    from pallas_kernels import tree_attention_mgpu as tam

    keys = jax.random.split(jax.random.key(0), 5)
    slots = -(-(context + 64) // 8) * 8  # TMA tiles the slots by 8
    store = lambda x: kvq.stored(x, kvq.empty(kind, x.shape))  # noqa: E731
    q = jax.random.normal(keys[0], (m, 24, 256))
    kc, vc = (store(jax.random.normal(k, (slots, 4, 256), jnp.bfloat16)) for k in keys[1:3])
    kb, vb = (store(jax.random.normal(k, (m, 4, 256), jnp.bfloat16)) for k in keys[3:5])
    blk, lo = jnp.asarray(random_ancestors(np.random.default_rng(0), m)), jnp.zeros((m,), jnp.int32)
    got = tam.tree_attention(q, kc, vc, jnp.int32(context), kb, vb, blk, lo, stages=stages)
    want = ref.tree_attention(q, *(kvq.readable(x).astype(jnp.float32) for x in (kc, vc)), jnp.int32(context),
                              *(kvq.readable(x).astype(jnp.float32) for x in (kb, vb)), blk, lo)
    print(f"relative error against the reference {float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)):.2e}")
    return _dumped(out, "tree_attention_mgpu*.ptx")


def sass(ptx: str) -> tuple[str, str]:
    """(SASS, note) of `ptx` assembled for sm_90a by pip triton's ptxas and read back by its cuobjdump; the note
    says if the PTX's `.version` had to be lowered for that ptxas."""
    from qmatmul_sass import triton_tools

    tools = triton_tools()
    note = ""
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        for _ in range(2):
            src.write_text(ptx)
            done = subprocess.run([str(tools / "ptxas"), "-arch=sm_90a", "-O3", str(src), "-o", str(cubin)],
                                  capture_output=True, text=True)
            newest = re.search(r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", done.stderr)
            if done.returncode == 0 or not newest:
                break
            note = f".version lowered to {newest.group(1)} for pip triton's ptxas"
            ptx = re.sub(r"^\.version [\d.]+", f".version {newest.group(1)}", ptx, count=1, flags=re.M)
        if done.returncode:
            raise SystemExit(f"ptxas failed:\n{done.stderr}")
        return subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], check=True, capture_output=True,
                              text=True).stdout, note


def sass_report(sass_text: str, note: str = "") -> str:
    """The SASS's instruction count and its longest loop's, with the loop's most frequent opcodes."""
    from qmatmul_sass import loops

    total = len(re.findall(r"^\s*/\*[0-9a-f]{4,}\*/\s", sass_text, flags=re.M))
    body = max(loops(sass_text), key=len)
    lines = [f"SASS: {total} instructions; the pipeline loop {len(body)}" + (f" ({note})" if note else "")]
    lines.append("loop: " + ", ".join(f"{op} {c}" for op, c in collections.Counter(body).most_common(16)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="directory for Mosaic GPU's dumps (needs a Hopper GPU)")
    ap.add_argument("--read", type=Path, help="a saved .ptx (its .ptxas beside it, if any) to report on instead")
    ap.add_argument("--n", type=int, default=1024, help="weight rows")
    ap.add_argument("--k", type=int, default=5120, help="weight columns")
    ap.add_argument("--m", type=int, default=23, help="tokens")
    ap.add_argument("--fmt", default="Q4_K", choices=("Q4_K", "Q6_K"), help="the weight format (its kernel)")
    ap.add_argument("--attention", choices=("bf16", "q8_0"),
                    help="dump the Mosaic tree attention over a cache of this type instead of a product")
    ap.add_argument("--context", type=int, default=131072, help="--attention's committed tokens")
    ap.add_argument("--stages", type=int, choices=(1, 2), help="--attention's pipeline depth (default: its own)")
    ap.add_argument("--sass", action="store_true", help="also assemble the PTX (pip's triton) and count the SASS")
    args = ap.parse_args(argv)
    if (args.out is None) == (args.read is None):
        ap.error("give one of --out (compile and dump) and --read (a saved dump)")
    if args.read:
        ptxas = args.read.with_suffix(".ptxas")
        ptx_text, ptxas_text = args.read.read_text(), ptxas.read_text() if ptxas.exists() else ""
    elif args.attention:
        ptx_text, ptxas_text = dump_attention(args.out, args.m, args.context, args.attention, args.stages)
    else:
        ptx_text, ptxas_text = dump(args.out, args.n, args.k, args.m, args.fmt)
    print(report(ptx_text, ptxas_text))
    if args.sass:
        print(sass_report(*sass(ptx_text)))


if __name__ == "__main__":
    main()
