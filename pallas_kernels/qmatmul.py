"""Fused dequantize + matmul for GGUF weights: x [M, K] @ W[N, K]^T -> [M, N] float32, M = 1..64.

`pack` repacks a weight once at load: into the Triton kernels' layout (qcommon.PackedWeight), and with mgpu="beside"
or "only" also or only into the Mosaic GPU kernels' layout for the Q4_K and Q6_K weights those take. `qmatmul` then
picks the kernel by the weight (its static pytree structure, so the choice is in every jit cache key) and M:

- a weight in the Mosaic GPU layout alone (`PackedWeight.mgpu_only`): qmatmul_mgpu (Q4_K) or qmatmul_mgpu_q6k (Q6_K)
  for every M, one token padded to 8 (Hopper only, no interpret mode). On an H200 the Q4_K kernel made the DDTree-22
  step 1.31x faster (28.1 -> 21.5 ms, scripts/results/tree_mgpu_ptx_h200.txt), the Q6_K one 21.67 -> 19.00 ms on an
  H100 (scripts/results/bench_27b_h100_mgpu_q6k_b.txt);
- one token (M = 1): the float GEMV (qmatmul_triton.gemv), its operands rounded as the tensor-core kernel rounds
  them, so that one token's product equals many tokens' up to the float32 accumulation; with `exact=False`, one
  token of Q4_K/Q6_K takes the int8-activation GEMV instead (gemv_int8.py: faster, x rounded to int8) and Q5_K/Q8_0
  the float GEMV on the exact weights: neither rounds as the tensor-core kernel does;
- 2-64 tokens of a weight that also carries the Mosaic GPU layout, on a GPU: that kernel;
- else the Triton tensor-core kernel (qmatmul_triton.mma), its Q4_K/Q6_K tiles in packed float16 where float16 holds
  the weight, else in float32 rounded to bf16 (tile_ptx.py).

`qmatmul_reference` computes what `qmatmul` computes for the same weight and M. Pallas Triton and Mosaic GPU
backends; `interpret=True` runs the Triton kernels on a CPU for the tests.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from pallas_kernels import gemv_int8, qmatmul_mgpu, qmatmul_mgpu_q6k, qmatmul_triton
from pallas_kernels.ggml import k_scale_min
from pallas_kernels.qcommon import (M_MAX, QUANTIZED_FORMATS, PackedWeight, dequantize_packed, f16_fits, unit,
                                    x_operand)

MGPU_LAYOUTS = ("off", "beside", "only")  # pack's `mgpu`
MGPU_MODULES = {"Q4_K": qmatmul_mgpu, "Q6_K": qmatmul_mgpu_q6k}  # the Mosaic GPU kernel of each format that has one


def _mgpu_layout(fmt: str, shape: tuple[int, int], data: Mapping[str, jax.Array]):
    """The Mosaic GPU kernel's layout of a weight where one takes it (Q4_K/Q6_K, rows a multiple of 64, float16
    holds it; concrete arrays), else None."""
    if fmt not in MGPU_MODULES or any(isinstance(a, jax.core.Tracer) for a in data.values()):
        return None
    try:
        return MGPU_MODULES[fmt].pack(fmt, shape, data)
    except ValueError:  # rows not a multiple of 64, or a weight float16 cannot hold: the Triton kernels take it
        return None


def pack(fmt: str, shape: tuple[int, int], data: Mapping[str, jax.Array], *, mgpu: str = "off") -> PackedWeight:
    """A GGUF weight [N, K] of format `fmt` (its block fields `data`, each [N, blocks, count], as dflash_jax's
    QTensor holds them) in the kernels' layout, once, at load (it runs wherever its arrays live). `mgpu`: "off";
    "beside", the Mosaic GPU layout too where a kernel takes the weight (its quants then held twice); "only", that
    layout alone where a kernel takes the weight. Weights no Mosaic GPU kernel takes keep the Triton layout."""
    if fmt not in QUANTIZED_FORMATS:
        raise NotImplementedError(f"the qmatmul kernels do not take {fmt} weights (they take "
                                  f"{', '.join(QUANTIZED_FORMATS)}; dense weights stay with XLA's product)")
    if mgpu not in MGPU_LAYOUTS:
        raise ValueError(f"mgpu is one of {MGPU_LAYOUTS}, got {mgpu!r}")
    n, k = shape
    layout = None if mgpu == "off" else _mgpu_layout(fmt, (n, k), data)
    if layout is not None and mgpu == "only":
        return PackedWeight({}, fmt, (n, k), mgpu=layout)
    packed = _triton_layout(fmt, (n, k), dict(data))
    return PackedWeight(packed, fmt, (n, k), f16_ok=f16_fits(fmt, packed), mgpu=layout)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _triton_layout(fmt: str, shape: tuple[int, int], f: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """`pack`'s Triton layout of the block fields, one compiled program per format and shape (op by op, a load
    compiled each op per shape and device)."""
    n, k = shape
    nb = k // unit(fmt)
    if fmt == "Q8_0":
        packed = {"qs": f["qs"].reshape(n, nb, 32), "d": f["d"].reshape(n, nb)}
    elif fmt == "Q6_K":
        # ql byte 64h + 32cc + 16half + l; qh byte 32h + 16half + l; scale 8h + 2c + half -> [c, h, half]
        packed = {"ql": f["ql"].reshape(n, nb, 2, 2, 2, 16), "qh": f["qh"].reshape(n, nb, 2, 2, 16),
                  "sc": f["scales"].reshape(n, nb, 2, 4, 2).transpose(0, 1, 3, 2, 4), "d": f["d"].reshape(n, nb)}
    else:  # Q4_K, Q5_K: scale of sub-block 2p + nib -> [nib, p]
        sc, mn = k_scale_min(f["scales"])
        split = lambda a: a.reshape(n, nb, 4, 2).transpose(0, 1, 3, 2)  # noqa: E731
        packed = {"qs": f["qs"].reshape(n, nb, 4, 32), "sc": split(sc), "mn": split(mn),
                  "d": f["d"].reshape(n, nb), "dmin": f["dmin"].reshape(n, nb)}
        if fmt == "Q5_K":
            packed["qh"] = f["qh"].reshape(n, nb, 32)
    return packed


def dequantize(pw: PackedWeight) -> jax.Array:
    """The float32 [N, K] matrix a PackedWeight stores, exactly the GGUF's values, from whichever layout it holds."""
    return MGPU_MODULES[pw.fmt].dequantize(pw.mgpu) if pw.mgpu_only else dequantize_packed(pw)


def qmatmul_reference(x: jax.Array, pw: PackedWeight, *, exact: bool = True) -> jax.Array:
    """x [M, K] @ W^T -> [M, N] float32 as `qmatmul` computes it for this weight and M: x and the weights rounded as
    that route's kernel takes them (with exact=False, one token of Q4_K/Q6_K: x quantized to int8 per weight group).
    A Mosaic GPU kernel beside the Triton layout multiplies the same float16 weights as the f16x2 tiles of the
    tensor-core kernel, so its products of 2-64 tokens have this one reference on a GPU and in interpret mode."""
    if pw.mgpu_only:
        return MGPU_MODULES[pw.fmt].reference(x, pw.mgpu)
    if x.shape[0] == 1 and not exact:
        if pw.fmt in gemv_int8.FORMATS:
            return gemv_int8.gemv_int8_reference(x, pw)
        return jnp.einsum("mk,nk->mn", x_operand(x, "f32").astype(jnp.float32), dequantize_packed(pw),
                          precision=jax.lax.Precision.HIGHEST)
    return qmatmul_triton.mma_reference(x, pw)


def launch_key(pw: PackedWeight) -> tuple | None:
    """What weights multiplied by one x in one launch (`qmatmul_many`) must share: the Mosaic GPU layout alone, its
    format, K and default K splits; None for a weight that always takes its own launch."""
    if not pw.mgpu_only:
        return None
    return pw.fmt, pw.shape[1], qmatmul_mgpu.default_splits(*pw.shape)


@functools.partial(jax.jit, static_argnames=("interpret", "exact"))
def qmatmul_many(x: jax.Array, pws: tuple[PackedWeight, ...], *, interpret: bool = False, exact: bool = True
                 ) -> list[jax.Array]:
    """[qmatmul(x, pw) for pw in pws], bit for bit: in one launch of the Mosaic GPU kernel where the weights share a
    `launch_key` (an MLP's gate and up), else a launch each."""
    keys = {launch_key(pw) for pw in pws}
    if interpret or None in keys or len(keys) > 1:
        return [qmatmul(x, pw, interpret=interpret, exact=exact) for pw in pws]
    if x.shape[0] > M_MAX:
        raise ValueError(f"qmatmul takes at most {M_MAX} rows, got {x.shape[0]}")
    return MGPU_MODULES[pws[0].fmt].qmatmul_many(x, tuple(pw.mgpu for pw in pws))


@functools.partial(jax.jit, static_argnames=("interpret", "exact", "block_n", "columns", "splits", "num_warps",
                                             "num_stages"))
def qmatmul(x: jax.Array, pw: PackedWeight, *, interpret: bool = False, exact: bool = True,
            block_n: int | None = None, columns: int | None = None, splits: int | None = None,
            num_warps: int | None = None, num_stages: int | None = None) -> jax.Array:
    """x [M, K] @ W^T -> [M, N] float32 for a PackedWeight, M <= 64, by the kernel the weight, M and `exact` pick
    (module docstring). Tuning (None: each kernel's defaults): `splits` programs along K, and for the Triton kernels
    `block_n` rows of W a program, `columns` a K step, `num_warps`, `num_stages` (Triton's software pipeline depth)."""
    m, k = x.shape
    n, kw = pw.shape
    if k != kw:
        raise ValueError(f"x has {k} columns, the weight {kw}")
    if m > M_MAX:
        raise ValueError(f"qmatmul takes at most {M_MAX} rows, got {m}")
    tuning = dict(block_n=block_n, columns=columns, splits=splits, num_warps=num_warps, num_stages=num_stages)
    if pw.mgpu_only or (pw.mgpu is not None and m > 1 and not interpret):
        if interpret:
            raise ValueError("this weight is packed for the Mosaic GPU kernel alone (pack's mgpu='only'), which runs "
                             "on a Hopper GPU, not in interpret mode")
        if any(v is not None for name, v in tuning.items() if name != "splits"):
            raise ValueError("the Mosaic GPU kernels take `splits` only (call qmatmul_mgpu.qmatmul or "
                             "qmatmul_mgpu_q6k.qmatmul for their other options)")
        return MGPU_MODULES[pw.fmt].qmatmul(x, pw.mgpu, splits=splits)
    if m == 1:
        if not exact and pw.fmt in gemv_int8.FORMATS:
            return gemv_int8.gemv_int8(x, pw, interpret=interpret, **tuning)
        return qmatmul_triton.gemv(x, pw, interpret=interpret, exact=exact, **tuning)
    return qmatmul_triton.mma(x, pw, interpret=interpret, **tuning)
