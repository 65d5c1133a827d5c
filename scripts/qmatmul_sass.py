"""qmatmul's kernels compiled to SASS on a CPU, no GPU: registers, shared memory, spills, whether the K loop's loads
are pipelined, and the instructions each thread issues per K step and per weight.

    pip install triton        # the Triton compiler, with ptxas and cuobjdump (Linux x86-64 wheels)
    python scripts/qmatmul_sass.py --out scripts/results/qmatmul_sass.txt
    python scripts/qmatmul_sass.py --out x.txt --cases Q4_K:17408:5120:1 --variants block_n=8 block_n=32

Pallas lowers a kernel to Triton IR without a GPU (`lowering_platforms=("cuda",)`); the HLO carries it as MLIR
bytecode in the Triton custom call's backend config, which the script reads back with jaxlib's Triton dialect and
compiles with the pip `triton` package for sm_90 with the kernel's own num_warps and
num_stages, and reads the cubin with cuobjdump. XLA compiles the same IR with the Triton inside jaxlib, whose
version differs from pip's: the counts describe what a Triton compiler makes of the kernel, leads to check against
timings on the device, not timings.

Columns: registers per thread; programs per SM that the registers allow (65536 per SM, allocated 8 at a time) and
the shared memory allows (228 KiB); `async`: whether the compiled kernel copies global memory to shared memory
asynchronously (how Triton pipelines loads over `num_stages`); the K loop's SASS instructions per thread per step,
the weights each thread covers per step, and their ratio; LDG: global loads per thread per step; the loop's most
frequent opcodes (IMAD.MOV: a register move, which ptxas issues on the integer multiply-add unit).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import parse_options  # noqa: E402

from jax._src.lib import triton as jaxlib_triton  # noqa: E402
from jax._src.lib.mlir import ir  # noqa: E402

from dflash_jax.testing.random_weights import random_qtensor  # noqa: E402
from pallas_kernels import gemv_int8, qcommon, qmatmul_triton  # noqa: E402
from pallas_kernels import qmatmul as qm  # noqa: E402
from pallas_kernels.tiles import dot_tile  # noqa: E402

# (fmt, N, K, M): the 27B's largest Q4_K, Q5_K and Q6_K matrices at one token and at a 23-node tree's 32-row tile
CASES = [f"{fmt}:{n}:{k}:{m}" for fmt, n, k in (("Q4_K", 17408, 5120), ("Q5_K", 10240, 5120), ("Q6_K", 5120, 17408))
         for m in (1, 23)]
# the default tiles of each case, then narrower and wider row tiles (qmatmul's tuning arguments; m=M: at M tokens only)
VARIANTS = ["", "m=1,block_n=8", "m=1,block_n=32", "m=23,block_n=32", "m=23,num_stages=3"]
REGISTERS_PER_SM, SHARED_PER_SM = 65536, 228 * 1024


def _mlir_bytes(text: str) -> bytes:
    """An MLIR string attribute's characters as bytes: `\\XX` hex escapes, `\\\\` and `\\"`."""
    out, i = bytearray(), 0
    while i < len(text):
        if text[i] != "\\":
            out += text[i].encode()
            i += 1
        elif text[i + 1] in '\\"':
            out.append(ord(text[i + 1]))
            i += 2
        else:
            out.append(int(text[i + 1:i + 3], 16))
            i += 3
    return bytes(out)


def lowered_triton(run, *args) -> tuple[str, int, int]:
    """(Triton IR in MLIR's generic form, num_warps, num_stages) of the last Pallas kernel in jitted `run` on args,
    lowered for CUDA without a GPU: the custom call's `ir` (MLIR bytecode) read with jaxlib's Triton dialect."""
    hlo = run.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    # each Triton call's config: ..., ir = "<bytecode>", name = "...", num_stages = S : i32, num_warps = W : i32}
    *_, call = re.finditer(r'ir = "((?:[^"\\]|\\.)*)", name = "[^"]*", num_stages = (\d+) : i32, '
                           r'num_warps = (\d+) : i32\}', hlo)
    context = ir.Context()
    jaxlib_triton.dialect.register_dialect(context)
    with context:
        module = ir.Module.parse(_mlir_bytes(call.group(1)))
    return module.operation.get_asm(print_generic_op_form=True), int(call.group(3)), int(call.group(2))


def triton_ir(fmt: str, n: int, k: int, m: int, opts: dict) -> tuple[str, int, int]:
    """(Triton IR in MLIR's generic form, num_warps, num_stages) of qmatmul's kernel for these shapes and options."""
    qt = random_qtensor(jax.random.key(0), fmt, (n, k))
    pw = qm.pack(qt.fmt, qt.shape, qt.data)
    run = jax.jit(lambda x, w: qm.qmatmul(x, w, **opts))  # the defaults of a GPU (interpret=False)
    return lowered_triton(run, jnp.ones((m, k), jnp.bfloat16), pw)


def kernel_tiles(fmt: str, n: int, m: int, opts: dict) -> tuple[str, int, int]:
    """(kernel, rows of W a program, columns a K step) that qmatmul runs for a Triton-layout weight and M tokens."""
    if m == 1 and fmt in gemv_int8.FORMATS:
        kernel, (bn, cols, _) = "gemv8", gemv_int8.TILES
    elif m == 1:
        kernel, (bn, cols, _) = "gemv", qmatmul_triton.GEMV_TILES
    else:
        kernel, (bn, cols, _) = "mma", qmatmul_triton.default_tiles(dot_tile(m), n, fmt)
    return kernel, opts.get("block_n") or bn, opts.get("columns") or cols


def triton_tools() -> Path:
    """The directory of pip triton's NVIDIA tools (ptxas, cuobjdump, nvdisasm)."""
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_sm90(ir_text: str, warps: int, stages: int) -> tuple[str, str, str, int]:
    """(TTGIR, SASS, cuobjdump's resource usage line, shared memory bytes) of the IR compiled by pip's Triton for
    sm_90; Triton's shared memory is dynamic, so it is the compiler's figure, not cuobjdump's static one."""
    import triton
    from triton.backends.compiler import GPUTarget

    tools = triton_tools()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ttir"
        src.write_text(ir_text)
        kernel = triton.compile(str(src), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=warps, num_stages=stages))
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        dump = lambda flag: subprocess.run([str(tools / "cuobjdump"), flag, str(cubin)], check=True,  # noqa: E731
                                           capture_output=True, text=True).stdout
        usage = next(line.strip() for line in dump("-res-usage").splitlines() if "REG:" in line)
        return kernel.asm["ttgir"], dump("-sass"), usage, kernel.metadata.shared


def loops(sass: str) -> list[list[str]]:
    """Each loop's opcodes (without modifiers, but a register move by IMAD, IMAD.MOV, kept apart from arithmetic),
    the body between a backward branch's target and the branch."""
    code = [(int(m.group(1), 16), m.group(2), line) for line in sass.splitlines()
            if (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line))]
    found = []
    for end, op, line in code:
        target = re.search(r"BRA (0x[0-9a-f]+)", line) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < end:
            found.append(["IMAD.MOV" if o.startswith("IMAD.MOV") else o.split(".")[0]
                          for a, o, _ in code if int(target.group(1), 16) <= a <= end])
    return found


def analyse(fmt: str, n: int, k: int, m: int, opts: dict) -> dict:
    """The compiled kernel's resources and its K loop's instruction mix (see the module docstring)."""
    kernel, bn, columns = kernel_tiles(fmt, n, m, opts)
    ir_text, warps, stages = triton_ir(fmt, n, k, m, opts)
    ttgir, sass, usage, shared = compile_sm90(ir_text, warps, stages)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    spills = int(re.search(r"STACK:(\d+)", usage).group(1)) + int(re.search(r"LOCAL:(\d+)", usage).group(1))
    threads = 32 * warps
    body = max(loops(sass), key=len)
    weights = bn * qcommon.units_per_step(fmt, k, columns) * qcommon.unit(fmt) / threads
    return dict(fmt=fmt, n=n, k=k, m=m, opts=opts, kernel=kernel, warps=warps, stages=stages,
                registers=regs, shared=shared, spills=spills,
                programs_by_registers=REGISTERS_PER_SM // (-(-regs // 8) * 8 * threads),
                programs_by_shared=SHARED_PER_SM // shared if shared else None,
                pipelined="async_copy_global_to_local" in ttgir, loop_instructions=len(body),
                allocs=[m.group(1).split(",")[0] for m in re.finditer(r"local_alloc.*?!ttg\.memdesc<([^>]*)>", ttgir)],
                mma=" ".join(f"{op} {c}" for op, c in collections.Counter(body).items() if op.endswith("MMA")) or "-",
                weights_per_thread=weights, per_weight=len(body) / weights, ldg=body.count("LDG"),
                opcodes=collections.Counter(body).most_common(8))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="text table")
    ap.add_argument("--cases", nargs="+", default=CASES, metavar="FMT:N:K:M")
    ap.add_argument("--variants", nargs="+", default=[parse_options(v) for v in VARIANTS], type=parse_options,
                    metavar="KEY=VALUE,...", help="qmatmul options per row (as bench_kernels.py --variants: m=M keeps "
                                                "one to M tokens)")
    ap.add_argument("--allocs", action="store_true",
                    help="also list each kernel's shared memory buffers (pipeline stages x tile) from its TTGIR")
    args = ap.parse_args(argv)
    import triton

    head = (f"# python scripts/qmatmul_sass.py {' '.join(sys.argv[1:])}\n# jax {jax.__version__}, pip triton "
            f"{triton.__version__} for sm_90 (not the Triton inside jaxlib that compiles these kernels on a GPU)\n"
            f"{'case':22s} {'kernel':5s} {'options':40s} {'regs':>4s} {'smem':>6s} {'spill':>5s} {'prog/SM':>7s} "
            f"{'async':>5s} {'loop':>5s} {'w/thr':>5s} {'instr/w':>7s} {'LDG':>3s} {'MMA':>9s}  opcodes")
    lines = [head]
    print(head, flush=True)
    for case in args.cases:
        fmt, n, k, m = case.split(":")
        for opts in args.variants:
            if opts.get("m", int(m)) != int(m):
                continue
            opts = {key: value for key, value in opts.items() if key != "m"}
            r = analyse(fmt, int(n), int(k), int(m), opts)
            fit = min(r["programs_by_registers"], r["programs_by_shared"] or 99)
            line = (f"{case:22s} {r['kernel']:5s} {','.join(f'{a}={b}' for a, b in opts.items()):40s} "
                    f"{r['registers']:4d} {r['shared']:6d} {r['spills']:5d} {fit:7d} {str(r['pipelined']):>5s} "
                    f"{r['loop_instructions']:5d} {r['weights_per_thread']:5.0f} {r['per_weight']:7.2f} {r['ldg']:3d} "
                    f"{r['mma']:>9s}  "
                    + " ".join(f"{op} {c}" for op, c in r["opcodes"]))
            lines.append(line)
            if args.allocs:
                lines.append(f"{'':22s} shared memory buffers: {', '.join(r['allocs']) or 'none'}")
            print("\n".join(lines[-1 - args.allocs:]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
