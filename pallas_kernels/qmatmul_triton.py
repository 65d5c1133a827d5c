"""qmatmul's Pallas Triton kernels on the Triton layout (qcommon.PackedWeight): the tensor-core kernel for 2-64 tokens
(`mma`) and the float GEMV for one token of a Q5_K/Q8_0 weight (`gemv`).

Tensor-core kernel: each program owns `block_n` rows of W and walks K a few super-blocks per step: per plane it
dequantizes the tile in registers (tile_ptx.plane_tile_mma; Q5_K/Q8_0 by `plane_tile`, rounded to bf16) and
multiplies it on the tensor cores (mma.sync, tokens x rows) with the activations, which XLA gathers into each
plane's column order and pads to a power of two before the kernel. A matrix with few row tiles (the 5120-row ones)
splits K over several programs (`splits`), so that every multiprocessor streams, and XLA adds their partial products.

GEMV: no tensor cores and no shuffle into the product's operand layout; each program owns 8 rows, multiplies each
plane's tile by the activations in the tile's own shape in float32, accumulates it, sums the rows once at the end,
and loads one K step ahead of the one it computes (`GEMV_PREFETCH`). With `exact` its operands are rounded as the
tensor-core kernel rounds them (float16 scaled by 2**F16_SHIFT where float16 holds the weight, else bf16): a product
of two such values is exact in float32, so one token's products equal the tensor-core kernel's up to the float32
accumulation (3-5e-6 of a 27B product on an H200), and a position's logits do not depend on how many tokens are
verified with it (docs/architecture.md, "Numerics"); without, x is rounded to bf16 and the weights kept in float32.
On an H100 the GEMV was 1.0-1.7x faster per matrix than the tensor-core kernel at M = 1
(scripts/results/qmatmul_h100_gemv.json) and took the 27B's AR step from 23.5 to 16.0 ms
(scripts/results/ar_one_token_h100.txt).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.qcommon import (N_PLANES, PTX_FORMATS, UNIT_SHAPE, PackedWeight, dequantize_packed, k_steps,
                                    plane_columns, plane_tile, prefetch_loop, sum_splits, tile_reader, unit,
                                    x_operand)
from pallas_kernels.tile_ptx import mma_dtype, plane_tile_mma, tile_math, weight_gain
from pallas_kernels.tiles import as_float32, dot_tile

# (rows of W per program, columns per K step, warps) of the GEMV: the best single choice of a sweep on an H100 over the
# 27B's Q4_K, Q5_K and Q6_K shapes at M = 1 (scripts/qmatmul_gemv_probe.py generic, 4 warps), and its pipeline stages
GEMV_TILES = (8, 512, 4)
GEMV_STAGES = 3
# K steps the GEMV loads ahead of the one it computes: 1 was faster than 0 and 2 on an H100
# (scripts/results/ar_gemv_h100.txt); the tensor-core kernel loads as it computes, leaving Triton's own load
# pipelining on (a prefetch turns it off: scripts/results/qmatmul_sass_cpu.txt)
GEMV_PREFETCH = 1
# Triton pipeline stages of the tensor-core kernel by weight format, for 16-32 rows of x (others: 3)
MMA_STAGES = {"Q4_K": 2}


def default_tiles(m_pad: int, n: int, fmt: str) -> tuple[int, int, int]:
    """(rows of W per program, columns per K step, warps) of the tensor-core kernel: the best of a sweep on an H100
    (scripts/bench_kernels.py --sweep, 17408 x 5120 Q4_K and 5120 x 17408 Q6_K): narrow tiles for 16 activation
    rows, wider ones for 32; 64 rows get half the columns (512 would need 384 KiB of shared memory for 3 pipeline
    stages). 32 rows on a Q6_K matrix of at most 8192 rows (the 27B's ffn_down) take 256 columns and 8 warps, which
    also lets K split 4 ways: 1.3-1.4x faster there, while the same tiles made Q4_K's ffn_down 1.25x slower
    (scripts/results/qmatmul_h100_sweep_m32.json, qmatmul_h100_m32_narrow.json). Q5_K at 32 rows takes them too:
    the wide tiles ran 3x slower than at 16 or 64 rows (scripts/results/qmatmul_rows_probe_h100.txt, tiles).
    Q4_K at 16 rows takes 64 x 512 too, with 2 pipeline stages (`default_stages`): 1.06-1.28x faster than 32 x 256
    on four of the 27B's six Q4_K shapes, 1.03-1.08x slower on ffn_down and attn_gate
    (scripts/results/qmatmul_stages_h100.txt)."""
    if m_pad == 32 and ((n <= 8192 and fmt == "Q6_K") or fmt == "Q5_K"):
        return 64, 256, 8
    if m_pad == 16 and fmt == "Q4_K":
        return 64, 512, 4
    return {16: (32, 256, 4), 32: (64, 512, 4)}.get(m_pad, (64, 256, 4))


def default_stages(m_pad: int, fmt: str) -> int:
    """Pipeline stages (`num_stages`) of the tensor-core kernel: `MMA_STAGES` at 16-32 rows, else 3. Two stages keep
    one buffer of each K step's loads instead of two: the Q4_K kernel's 64 x 512 tiles at 32 rows then take 51 KB of
    shared memory instead of 103 KB and 3 programs an SM instead of 2 (SASS read on a CPU), and ran 1.05-1.35x
    faster on five of the 27B's six Q4_K shapes at 23 tokens, 1.03x slower on ffn_down; Q5_K and Q6_K gained
    nothing (scripts/results/qmatmul_stages_h100.txt)."""
    return MMA_STAGES.get(fmt, 3) if m_pad in (16, 32) else 3


def _mma_kernel(fmt: str, n: int, step: int, steps: int, block_n: int, names: tuple[str, ...], asm: bool,
                math: str, *refs):
    # x_ref [planes, m_pad, K / planes]; w_refs [N, units, ...] (one per field, `names`); o_ref [splits, m_pad, N']
    x_ref, *w_refs, o_ref = refs
    w = dict(zip(names, w_refs))
    r0, split = pl.program_id(0) * block_n, pl.program_id(1)
    row_ok = (r0 + jnp.arange(block_n)) < n  # the last program's rows past N read zeros
    n_planes = N_PLANES[fmt]
    width = unit(fmt) // n_planes  # columns of x per unit and plane

    def reader(i, valid):
        i = split * steps + i
        get = tile_reader(w, r0, row_ok, block_n, i * step, step, valid)
        start = i * step * width
        return get, lambda plane: x_ref[plane, :, pl.ds(start, step * width)]

    def compute(get, x_tile, acc):
        for plane in range(n_planes):
            if fmt in PTX_FORMATS:
                tile = plane_tile_mma(fmt, plane, get, asm, math).reshape(block_n, -1)
            else:
                tile = plane_tile(fmt, plane, get).reshape(block_n, -1).astype(jnp.bfloat16)
            acc = acc + jax.lax.dot_general(x_tile(plane), tile, (((1,), (1,)), ((), ())),
                                            preferred_element_type=jnp.float32)
        return acc

    acc = prefetch_loop(reader, lambda r, acc: compute(*r, acc), steps, jnp.zeros((x_ref.shape[1], block_n),
                                                                                   jnp.float32), 0)
    o_ref[split, :, pl.ds(r0, block_n)] = acc


def mma(x: jax.Array, pw: PackedWeight, *, interpret: bool = False, block_n: int | None = None,
        columns: int | None = None, splits: int | None = None, num_warps: int | None = None,
        num_stages: int | None = None) -> jax.Array:
    """x [M, K] @ W^T -> [M, N] float32 on the tensor cores for 2 <= M <= 64 (padded to a power of two >= 16):
    `block_n` rows of W a program (default `default_tiles`), `columns` a K step, K split over `splits` programs
    (default qcommon.default_splits), `num_stages` Triton pipeline stages (default `default_stages`). Q4_K/Q6_K tiles
    by inline PTX on a GPU (`tile_ptx.tile_math`), by jnp in interpret mode; qmatmul calls it inside its jit."""
    m, k = x.shape
    n = pw.shape[0]
    m_pad, math = dot_tile(m), tile_math(pw)
    bn, cols, warps = default_tiles(m_pad, n, pw.fmt)
    block_n, columns, num_warps = block_n or bn, columns or cols, num_warps or warps
    num_stages = num_stages or default_stages(m_pad, pw.fmt)
    step, steps, splits = k_steps(pw.fmt, n, k, block_n, columns, splits, target=1024)
    xb = jnp.zeros((m_pad, k), mma_dtype(math)).at[:m].set(x_operand(x, math))
    xp = xb[:, plane_columns(pw.fmt, k)].transpose(1, 0, 2)  # [planes, M, K / planes] in each plane's order
    names = tuple(sorted(pw.data))
    tiles = pl.cdiv(n, block_n)
    out = pl.pallas_call(
        functools.partial(_mma_kernel, pw.fmt, n, step, steps, block_n, names, not interpret, math),
        out_shape=jax.ShapeDtypeStruct((splits, m_pad, tiles * block_n), jnp.float32),
        grid=(tiles, splits),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"qmatmul_{pw.fmt.lower()}",
    )(xp, *(pw.data[name] for name in names))
    return sum_splits(out, m, n)


def mma_weights(pw: PackedWeight) -> jax.Array:
    """The weights [N, K] the tensor-core kernel multiplies, float32, its gain taken back off (exact): f16x2's float16
    weights or f32's bf16 ones, from the jnp forms of its tiles (`plane_tile_mma` with asm=False)."""
    math = tile_math(pw)
    return dequantize_packed(pw, lambda fmt, plane, get: plane_tile_mma(fmt, plane, get, False, math).astype(
        jnp.float32) / weight_gain(math))


def mma_reference(x: jax.Array, pw: PackedWeight) -> jax.Array:
    """x [M, K] @ W^T -> [M, N] float32 with x and the weights rounded as `mma` takes them."""
    math = tile_math(pw)
    xb = x_operand(x, math).astype(jnp.float32) * weight_gain(math)
    return jnp.einsum("mk,nk->mn", xb, mma_weights(pw), precision=jax.lax.Precision.HIGHEST)


def _step_tiles(fmt: str, get, x_tile) -> dict[str, jax.Array]:
    """One K step's loads: every field tile `plane_tile` reads, each loaded once, and each plane's activations
    (`x_tile(plane)`), keyed as `_from_tiles` reads them, so that the loop can carry them (a prefetch). plane_tile
    runs here only for its reads (its arithmetic has no use and the compiler drops it)."""
    tiles = {}

    def load(name, *idx):
        key = f"{name}{idx}"
        if key not in tiles:
            tiles[key] = get(name, *idx)
        return tiles[key]

    for plane in range(N_PLANES[fmt]):
        plane_tile(fmt, plane, load)
        tiles[f"x{plane}"] = x_tile(plane)
    return tiles


def _from_tiles(tiles: dict[str, jax.Array]):
    """(`get`, `x_tile`) over tiles `_step_tiles` loaded."""
    return (lambda name, *idx: tiles[f"{name}{idx}"]), (lambda plane: tiles[f"x{plane}"])


def _gemv_kernel(fmt: str, n: int, step: int, steps: int, block_n: int, names: tuple[str, ...], math: str | None,
                 interpret: bool, *refs):
    # x_ref [planes, units, *UNIT_SHAPE]: bf16 or float16 as `mma` rounds it (math given), else bf16 values in
    # float32; w_refs [N, units, ...]; o_ref [splits, 1, N']
    x_ref, *w_refs, o_ref = refs
    w = dict(zip(names, w_refs))
    r0, split = pl.program_id(0) * block_n, pl.program_id(1)
    row_ok = (r0 + jnp.arange(block_n)) < n
    n_planes = x_ref.shape[0]  # x_ref has the tile's shape: no reshape

    def reader(i, valid):
        i = split * steps + i
        return (tile_reader(w, r0, row_ok, block_n, i * step, step, valid),
                lambda plane: x_ref[plane, pl.ds(i * step, step)].astype(jnp.float32))

    def compute(get, x_tile, acc):
        for plane in range(n_planes):
            acc = acc + gemv_tile(fmt, plane, get, math, interpret) * x_tile(plane)[None]
        return acc

    # the products accumulate elementwise; rows are summed once, after the K loop
    acc = prefetch_loop(lambda i, valid: _step_tiles(fmt, *reader(i, valid)),
                        lambda tiles, acc: compute(*_from_tiles(tiles), acc), steps,
                        jnp.zeros((block_n, step) + UNIT_SHAPE[fmt], jnp.float32), GEMV_PREFETCH)
    while acc.ndim > 1:
        acc = jnp.sum(acc, axis=-1)
    o_ref[split, 0, pl.ds(r0, block_n)] = acc


def gemv_tile(fmt: str, plane: int, get, math: str | None, interpret: bool) -> jax.Array:
    """A plane tile in float32 holding the weights as the tensor-core kernel rounds them under `math` (times its
    gain): `plane_tile_mma`, by the same inline PTX on a GPU, for Q4_K/Q6_K; `plane_tile` rounded to bf16 for the
    others; math None: the weights exact."""
    if math is None:
        return plane_tile(fmt, plane, get)
    if fmt in PTX_FORMATS:
        return as_float32(plane_tile_mma(fmt, plane, get, not interpret, math), interpret)
    return as_float32(plane_tile(fmt, plane, get).astype(jnp.bfloat16), interpret)


def gemv(x: jax.Array, pw: PackedWeight, *, interpret: bool = False, exact: bool = True, block_n: int | None = None,
         columns: int | None = None, splits: int | None = None, num_warps: int | None = None,
         num_stages: int | None = None) -> jax.Array:
    """x [1, K] @ W^T -> [1, N] float32: with `exact` x and the weights rounded as `mma` rounds them (`gemv_tile`),
    else x rounded to bf16 and the weights exact; tiles default to `GEMV_TILES` and `GEMV_STAGES`, K splits to
    qcommon.default_splits at a target of 2048 programs. qmatmul calls it inside its jit."""
    n, k = pw.shape
    if x.shape != (1, k):
        raise ValueError(f"the float GEMV takes one row of x with {k} columns, got x {x.shape}")
    bn, cols, warps = GEMV_TILES
    block_n, columns, num_warps = block_n or bn, columns or cols, num_warps or warps
    step, steps, splits = k_steps(pw.fmt, n, k, block_n, columns, splits, target=2048)
    math = tile_math(pw) if exact else None
    # exact: x goes in rounded, as its own dtype (a float32 copy of it made outside the kernel is a round trip XLA may
    # drop); otherwise as float32, as the GEMV took it before `exact` (that kernel, unchanged, is the "fast" one)
    xp = x_operand(x, math or "f32")[:, plane_columns(pw.fmt, k)].transpose(1, 0, 2)
    xp = xp.reshape((xp.shape[0], -1) + UNIT_SHAPE[pw.fmt])
    xp = xp if exact else xp.astype(jnp.float32)
    names = tuple(sorted(pw.data))
    tiles = pl.cdiv(n, block_n)
    out = pl.pallas_call(
        functools.partial(_gemv_kernel, pw.fmt, n, step, steps, block_n, names, math, interpret),
        out_shape=jax.ShapeDtypeStruct((splits, 1, tiles * block_n), jnp.float32),
        grid=(tiles, splits),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages or GEMV_STAGES),
        interpret=interpret,
        name=f"gemv_{pw.fmt.lower()}",
    )(xp, *(pw.data[name] for name in names))
    return sum_splits(out, 1, n)
