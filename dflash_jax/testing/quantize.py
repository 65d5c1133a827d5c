"""Vectorized numpy ports of llama.cpp's reference (no-imatrix) Q4_K, Q5_K and Q6_K quantizers, plus a dispatcher.

The K-quant functions follow `quantize_row_q{4,5,6}_K_ref` in ggml/src/ggml-quants.c step by step in float32, with
round-half-to-even for `nearest_int` and sequential float32 accumulation wherever the C code sums in a loop, so the
bytes match ggml's output except where the C build contracts multiply-adds into FMAs. Internally, sub-block data is
laid out position-major ([positions, sub-blocks]) so each accumulation step is one contiguous vector add.
"""

from __future__ import annotations

from typing import Callable

import gguf
import numpy as np

QK_K = 256
_GROUP_MAX_EPS = np.float32(1e-15)
_F32 = np.float32

_Q4_K_BYTES = 144
_Q5_K_BYTES = 176
_Q6_K_BYTES = 210


def _seqsum(a: np.ndarray) -> np.ndarray:
    """Sum over axis 0 in index order in float32, as the C loops do."""
    acc = a[0].copy()
    for i in range(1, a.shape[0]):
        acc += a[i]
    return acc


def _nearest(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """`MAX(lo, MIN(hi, nearest_int(v)))` as float32 (ggml's nearest_int rounds half to even)."""
    return np.clip(np.rint(v), lo, hi)


def _as_blocks(x: np.ndarray, name: str) -> tuple[np.ndarray, tuple[int, ...], int]:
    """Float32 [n_blocks, 256] view of x, its leading shape and the number of blocks per row."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0:
        raise ValueError(f"{name} needs an array with at least one dimension, got a scalar")
    k = x.shape[-1]
    if k % QK_K != 0:
        raise ValueError(f"{name}: row length {k} is not a multiple of the block size {QK_K}")
    return np.ascontiguousarray(x).reshape(-1, QK_K), x.shape[:-1], k // QK_K


def _to_position_major(blocks: np.ndarray, sub: int) -> np.ndarray:
    """[n_blocks, 256] -> [sub, n_blocks * (256 // sub)]: element i of every sub-block of length `sub` in row i."""
    n = blocks.shape[0]
    return np.ascontiguousarray(blocks.reshape(n, QK_K // sub, sub).transpose(2, 0, 1)).reshape(sub, -1)


def _from_position_major(a: np.ndarray, sub: int) -> np.ndarray:
    """Inverse of `_to_position_major`."""
    n = a.shape[1] // (QK_K // sub)
    return a.reshape(sub, n, QK_K // sub).transpose(1, 2, 0).reshape(n, QK_K)


def _make_qkx2_quants(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`make_qkx2_quants` (use_mad=false) on x, w [n, M]: levels [n, M] (float32), scale [M] and the_min [M]."""
    xmin = np.minimum(x.min(axis=0), _F32(0))
    xmax = x.max(axis=0)
    sum_w = _seqsum(w)
    sum_x = _seqsum(w * x)
    flat = xmax == xmin
    rng = np.where(flat, _F32(1), xmax - xmin)

    iscale = _F32(nmax) / rng
    scale = _F32(1) / iscale
    levels = _nearest(iscale * (x - xmin), 0, nmax)
    best_error = _seqsum(w * np.square(scale * levels + xmin - x))
    cur_min = xmin
    for step in range(nstep + 1):
        # The C loop reads the running `min`, which an accepted step has already replaced with its fitted offset.
        rng = xmax - cur_min
        valid = rng > 0
        iscale = ((_F32(rmin) + _F32(rdelta) * _F32(step)) + _F32(nmax)) / np.where(valid, rng, _F32(1))
        laux = _nearest(iscale * (x - cur_min), 0, nmax)
        wl = w * laux
        sum_l = _seqsum(wl)
        sum_l2 = _seqsum(wl * laux)
        sum_xl = _seqsum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = valid & (det > 0)
        det = np.where(ok, det, _F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        clamp = this_min > 0
        this_min = np.where(clamp, _F32(0), this_min)
        this_scale = np.where(clamp, sum_xl / np.where(sum_l2 != 0, sum_l2, _F32(1)), this_scale)
        cur_error = _seqsum(w * np.square(this_scale * laux + this_min - x))
        better = ok & (cur_error < best_error)
        levels = np.where(better, laux, levels)
        best_error = np.where(better, cur_error, best_error)
        scale = np.where(better, this_scale, scale)
        cur_min = np.where(better, this_min, cur_min)

    levels = np.where(flat, _F32(0), levels)
    scale = np.where(flat, _F32(0), scale)
    cur_min = np.where(flat, xmin, cur_min)
    return levels, scale, -cur_min


def _make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """`make_qx_quants` (rmse_type=1, no quant weights) on x [n, M]: levels + nmax [n, M] (float32) and scale [M]."""
    m = x.shape[1]
    idx = np.argmax(np.abs(x), axis=0)
    vmax = x[idx, np.arange(m)]
    zero = np.abs(vmax) < _GROUP_MAX_EPS
    vmax = np.where(zero, _F32(1), vmax)
    w = x * x
    wx = w * x

    def sums(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lv = _nearest(iscale * x, -nmax, nmax - 1)
        return lv, _seqsum(wx * lv), _seqsum(w * lv * lv)

    lv, sumlx, suml2 = sums(_F32(-nmax) / vmax)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, _F32(1)), _F32(0))
    best = scale * sumlx
    levels = lv + _F32(nmax)
    for step in range(-9, 10):
        if step == 0:
            continue
        lv, sumlx, suml2 = sums(-(_F32(nmax) + _F32(0.1) * _F32(step)) / vmax)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        new_scale = sumlx / np.where(suml2 > 0, suml2, _F32(1))
        levels = np.where(better, lv + _F32(nmax), levels)
        scale = np.where(better, new_scale, scale)
        best = np.where(better, new_scale * sumlx, best)

    return np.where(zero, _F32(0), levels), np.where(zero, _F32(0), scale)


def _quantize_k45(
    blocks: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shared Q4_K/Q5_K body: fp16 d [N], fp16 dmin [N], packed scales [N, 12] and levels [N, 256] (uint8)."""
    n = blocks.shape[0]
    xs = _to_position_major(blocks, 32)
    av_x = np.sqrt(_seqsum(xs * xs) / _F32(32))
    weights = av_x + np.abs(xs)
    levels, scales, mins = _make_qkx2_quants(xs, weights, nmax, rmin, rdelta, nstep)
    scales = scales.reshape(n, 8)
    mins = mins.reshape(n, 8)

    max_scale = np.maximum(scales.max(axis=1), _F32(0))
    max_min = np.maximum(mins.max(axis=1), _F32(0))
    inv_scale = np.where(max_scale > 0, _F32(63) / np.where(max_scale > 0, max_scale, _F32(1)), _F32(0))
    inv_min = np.where(max_min > 0, _F32(63) / np.where(max_min > 0, max_min, _F32(1)), _F32(0))
    # C stores nearest_int into a uint8 before MIN(63, .), so a negative value wraps around first.
    ls = np.minimum(np.rint(inv_scale[:, None] * scales).astype(np.int64).astype(np.uint8), np.uint8(63))
    lm = np.minimum(np.rint(inv_min[:, None] * mins).astype(np.int64).astype(np.uint8), np.uint8(63))
    packed = np.concatenate(
        [
            ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
            lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
            (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4),
        ],
        axis=1,
    ).astype(np.uint8)

    d16 = (max_scale / _F32(63)).astype(np.float16)
    dmin16 = (max_min / _F32(63)).astype(np.float16)
    d = (d16.astype(np.float32)[:, None] * ls.astype(np.float32)).reshape(-1)
    dm = (dmin16.astype(np.float32)[:, None] * lm.astype(np.float32)).reshape(-1)
    nonzero = d != 0
    requant = _nearest((xs + dm) / np.where(nonzero, d, _F32(1)), 0, nmax)
    levels = np.where(nonzero, requant, levels)
    return d16, dmin16, packed, _from_position_major(levels, 32).astype(np.uint8)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """Little-endian bytes [N, 2] of fp16 values [N]."""
    return v.astype("<f2").reshape(-1, 1).view(np.uint8)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K GGUF bytes of x [..., K] (K % 256 == 0) as uint8 [..., K // 256 * 144], like `quantize_row_q4_K_ref`."""
    blocks, lead, nb = _as_blocks(x, "Q4_K")
    d16, dmin16, scales, levels = _quantize_k45(blocks, 15, -1.0, 0.1, 20)
    lv = levels.reshape(-1, 4, 2, 32)
    qs = (lv[:, :, 0] | (lv[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([_f16_bytes(d16), _f16_bytes(dmin16), scales, qs], axis=1)
    return out.reshape(*lead, nb * _Q4_K_BYTES)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """Q5_K GGUF bytes of x [..., K] (K % 256 == 0) as uint8 [..., K // 256 * 176], like `quantize_row_q5_K_ref`."""
    blocks, lead, nb = _as_blocks(x, "Q5_K")
    d16, dmin16, scales, levels = _quantize_k45(blocks, 31, -0.5, 0.1, 15)
    lv = levels.reshape(-1, 8, 32)
    qh = np.zeros((lv.shape[0], 32), dtype=np.uint8)
    for sub in range(8):
        qh |= (lv[:, sub] >> 4) << sub
    low = (lv & 0xF).reshape(-1, 4, 2, 32)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([_f16_bytes(d16), _f16_bytes(dmin16), scales, qh, ql], axis=1)
    return out.reshape(*lead, nb * _Q5_K_BYTES)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K GGUF bytes of x [..., K] (K % 256 == 0) as uint8 [..., K // 256 * 210], like `quantize_row_q6_K_ref`."""
    blocks, lead, nb = _as_blocks(x, "Q6_K")
    n = blocks.shape[0]
    xs = _to_position_major(blocks, 16)
    levels, scales = _make_qx_quants(xs, 32)
    scales = scales.reshape(n, 16)

    idx = np.argmax(np.abs(scales), axis=1)
    max_scale = scales[np.arange(n), idx]
    zero_block = np.abs(max_scale) < _GROUP_MAX_EPS
    iscale = _F32(-128) / np.where(zero_block, _F32(1), max_scale)
    d16 = np.where(zero_block, _F32(0), _F32(1) / iscale).astype(np.float16)
    sc = np.minimum(np.rint(iscale[:, None] * scales), _F32(127)).astype(np.int64).astype(np.int8)
    sc = np.where(zero_block[:, None], np.int8(0), sc)

    d = (d16.astype(np.float32)[:, None] * sc.astype(np.float32)).reshape(-1)
    nonzero = d != 0
    requant = _nearest(xs / np.where(nonzero, d, _F32(1)), -32, 31) + _F32(32)
    levels = np.where(nonzero, requant, levels)
    lv = _from_position_major(levels, 16).astype(np.uint8)
    lv = np.where(zero_block[:, None], np.uint8(0), lv).reshape(n, 2, 4, 32)

    low = lv & 0xF
    ql = np.stack([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2).reshape(n, 128)
    high = lv >> 4
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d16)], axis=1)
    return out.reshape(*lead, nb * _Q6_K_BYTES)


_OURS: dict[gguf.GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    gguf.GGMLQuantizationType.Q4_K: quantize_q4_k,
    gguf.GGMLQuantizationType.Q5_K: quantize_q5_k,
    gguf.GGMLQuantizationType.Q6_K: quantize_q6_k,
}
_FROM_GGUF = frozenset(
    {
        gguf.GGMLQuantizationType.F32,
        gguf.GGMLQuantizationType.F16,
        gguf.GGMLQuantizationType.BF16,
        gguf.GGMLQuantizationType.Q8_0,
        gguf.GGMLQuantizationType.Q4_0,
        gguf.GGMLQuantizationType.Q4_1,
        gguf.GGMLQuantizationType.Q5_0,
        gguf.GGMLQuantizationType.Q5_1,
    }
)


def quantize(x: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """GGUF bytes (or F32/F16 arrays) of x [rows, K] in qtype: ours for Q4_K/Q5_K/Q6_K, gguf-py's for F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1."""
    qtype = gguf.GGMLQuantizationType(qtype)
    if qtype in _OURS:
        return _OURS[qtype](x)
    if qtype not in _FROM_GGUF:
        raise NotImplementedError(f"quantize: {qtype.name} is not supported")
    x = np.asarray(x)
    if x.ndim == 0:
        raise ValueError(f"{qtype.name} needs an array with at least one dimension, got a scalar")
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    if x.shape[-1] % block_size != 0:
        raise ValueError(f"{qtype.name}: row length {x.shape[-1]} is not a multiple of the block size {block_size}")
    return gguf.quants.quantize(x, qtype)
