"""Quantized weights: the QTensor pytree, GGUF block formats and reference dequantizers.

Block layouts follow ggml-common.h (specs/qwen35_gguf.md §4.2). `repack` splits a tensor's GGUF block bytes into
one array per block field (d, dmin, scales, qs, ...), each [out, blocks_per_row, count]; `to_gguf_bytes` is its
inverse. Dense formats (F32, F16, BF16) hold one field `w` [out, in]. The dequantizers are plain jnp and match
`gguf.quants.dequantize` bit for bit: every product they form (fp16 scale x 6-bit scale x quant) is exact in
float32, so only the final add rounds, whatever the compiler fuses.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType as GT

from dflash_jax.errors import InputError
from pallas_kernels.ggml import QK_K, k_scale_min, nibbles, q6_k_quants


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """One GGUF tensor type: values per block, bytes per block and the block's fields in storage order."""

    name: str
    ggml_type: GT
    block_size: int
    type_size: int
    fields: tuple[tuple[str, np.dtype, int], ...]  # (name, dtype, element count) in byte order

    @property
    def dense(self) -> bool:
        return self.block_size == 1


def _fmt(ggml_type: GT, block_size: int, *fields: tuple[str, type, int]) -> BlockFormat:
    fields = tuple((n, np.dtype(t), c) for n, t, c in fields)
    type_size = sum(t.itemsize * c for _, t, c in fields)
    return BlockFormat(ggml_type.name, ggml_type, block_size, type_size, fields)


_F16, _U8, _I8 = np.float16, np.uint8, np.int8
FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    _fmt(GT.F32, 1, ("w", np.float32, 1)),
    _fmt(GT.F16, 1, ("w", _F16, 1)),
    _fmt(GT.BF16, 1, ("w", ml_dtypes.bfloat16, 1)),
    _fmt(GT.Q8_0, 32, ("d", _F16, 1), ("qs", _I8, 32)),
    _fmt(GT.Q4_0, 32, ("d", _F16, 1), ("qs", _U8, 16)),
    _fmt(GT.Q4_1, 32, ("d", _F16, 1), ("m", _F16, 1), ("qs", _U8, 16)),
    _fmt(GT.Q5_0, 32, ("d", _F16, 1), ("qh", _U8, 4), ("qs", _U8, 16)),
    _fmt(GT.Q5_1, 32, ("d", _F16, 1), ("m", _F16, 1), ("qh", _U8, 4), ("qs", _U8, 16)),
    _fmt(GT.Q4_K, QK_K, ("d", _F16, 1), ("dmin", _F16, 1), ("scales", _U8, 12), ("qs", _U8, 128)),
    _fmt(GT.Q5_K, QK_K, ("d", _F16, 1), ("dmin", _F16, 1), ("scales", _U8, 12), ("qh", _U8, 32),
         ("qs", _U8, 128)),
    _fmt(GT.Q6_K, QK_K, ("ql", _U8, 128), ("qh", _U8, 64), ("scales", _I8, 16), ("d", _F16, 1)),
)}
SUPPORTED_TYPES = frozenset(f.ggml_type for f in FORMATS.values())


class Unsupported(NotImplementedError, InputError):
    """Input that is valid but beyond what the package implements (a tensor type, a conversion): a
    NotImplementedError by nature, and an InputError so that the commands report it as bad input, like the rest."""


def block_format(ggml_type: GT | int) -> BlockFormat:
    """The BlockFormat of a GGUF tensor type, or Unsupported naming the type."""
    ggml_type = GT(ggml_type)
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise Unsupported(f"tensor type {ggml_type.name} is not supported (supported: {supported})")
    return FORMATS[ggml_type.name]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
    """A weight matrix [out, in] in a GGUF format: one array per block field, format and shape static."""

    data: dict[str, jax.Array]  # field name -> [out, blocks_per_row, count] (dense: "w" -> [out, in])
    fmt: str = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in self.data.values())


def repack(raw: np.ndarray, ggml_type: GT | int, shape: tuple[int, int]) -> QTensor:
    """Split a tensor's GGUF bytes (any dtype view, [out, bytes_per_row] or flat) into a QTensor of numpy arrays."""
    fmt = block_format(ggml_type)
    rows, cols = shape
    if cols % fmt.block_size:
        raise ValueError(f"row length {cols} is not a multiple of the {fmt.name} block size {fmt.block_size}")
    nblocks = cols // fmt.block_size
    blocks = np.ascontiguousarray(raw).view(np.uint8)
    if blocks.size != rows * nblocks * fmt.type_size:
        raise ValueError(f"{fmt.name} tensor of shape {shape} needs {rows * nblocks * fmt.type_size} bytes, "
                         f"got {blocks.size}")
    blocks = blocks.reshape(rows, nblocks, fmt.type_size)
    data, offset = {}, 0
    for name, dtype, count in fmt.fields:
        size = dtype.itemsize * count
        field = np.ascontiguousarray(blocks[:, :, offset:offset + size]).view(dtype)  # [rows, nblocks, count]
        data[name] = field.reshape(rows, cols) if fmt.dense else field
        offset += size
    return QTensor(data=data, fmt=fmt.name, shape=(rows, cols))


# Exponent bits of each float format: all set is an infinity or a NaN.
_EXPONENT = {np.dtype(np.float32): (np.uint32, 0x7F800000), np.dtype(np.float16): (np.uint16, 0x7C00),
             np.dtype(ml_dtypes.bfloat16): (np.uint16, 0x7F80)}


def nonfinite_field(fields: dict[str, np.ndarray]) -> str | None:
    """The first float array of `fields` (a QTensor's data: a quant's scales, a dense tensor's values) that holds a NaN
    or an infinity, else None: one integer pass over the exponent bits, cheap beside a quant's packed values."""
    for name, x in fields.items():
        x = np.asarray(x)
        if x.dtype in _EXPONENT:
            bits, mask = _EXPONENT[x.dtype]
            if np.any((x.view(bits) & mask) == mask):
                return name
    return None


def to_gguf_bytes(qt: QTensor) -> np.ndarray:
    """The GGUF block bytes [out, bytes_per_row] of a QTensor (inverse of `repack`)."""
    fmt = FORMATS[qt.fmt]
    rows, cols = qt.shape
    parts = []
    for name, dtype, count in fmt.fields:
        field = np.asarray(qt.data[name]).astype(dtype, copy=False)
        parts.append(field.reshape(rows, cols // fmt.block_size, count).view(np.uint8))
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


# ---------------------------------------------------------------------------------------------------------------
# Reference dequantizers: fields in, float32 [out, in] out.

def _f32(x: jax.Array) -> jax.Array:
    return jnp.asarray(x).astype(jnp.float32)


def _bits(bytes_: jax.Array, nbits: int) -> jax.Array:
    """[..., n] bytes -> [..., nbits, n]: bit j of every byte in row j."""
    shifts = jnp.arange(nbits, dtype=jnp.uint8)[:, None]
    return (bytes_[..., None, :] >> shifts) & 1


def _q4_0(d, qs):
    q = nibbles(qs).reshape(*qs.shape[:-1], 32)
    return _f32(d) * (_f32(q) - 8.0)


def _q4_1(d, m, qs):
    q = nibbles(qs).reshape(*qs.shape[:-1], 32)
    return _f32(d) * _f32(q) + _f32(m)


def _q5_low_high(qh, qs):
    """Q5_0/Q5_1: 5-bit quants from 16 nibble bytes and 32 high bits (bit j of the little-endian uint32)."""
    low = nibbles(qs).reshape(*qs.shape[:-1], 32)
    high = jnp.swapaxes(_bits(qh, 8), -1, -2).reshape(*qh.shape[:-1], 32)  # element j = byte j//8, bit j%8
    return low | (high << 4)


def _q5_0(d, qh, qs):
    return _f32(d) * (_f32(_q5_low_high(qh, qs)) - 16.0)


def _q5_1(d, m, qh, qs):
    return _f32(d) * _f32(_q5_low_high(qh, qs)) + _f32(m)


def _q8_0(d, qs):
    return _f32(d) * _f32(qs)


def _k_affine(d, dmin, scales, q):
    """y = d * sc_j * q - dmin * m_j over the 8 sub-blocks of 32; q is [..., 8, 32]."""
    sc, mn = k_scale_min(scales)
    scale = (_f32(d) * _f32(sc))[..., None]
    offset = (_f32(dmin) * _f32(mn))[..., None]
    return (scale * _f32(q) - offset).reshape(*q.shape[:-2], QK_K)


def _q4_k(d, dmin, scales, qs):
    q = nibbles(qs.reshape(*qs.shape[:-1], 4, 32))  # [..., 4, 2, 32]: group p holds sub-blocks 2p, 2p+1
    return _k_affine(d, dmin, scales, q.reshape(*qs.shape[:-1], 8, 32))


def _q5_k(d, dmin, scales, qh, qs):
    low = nibbles(qs.reshape(*qs.shape[:-1], 4, 32)).reshape(*qs.shape[:-1], 8, 32)
    return _k_affine(d, dmin, scales, low | (_bits(qh, 8) << 4))  # sub-block j's 5th bit is bit j of qh[l]


def _q6_k(ql, qh, scales, d):
    lead = ql.shape[:-1]
    q = _f32(q6_k_quants(ql, qh).astype(jnp.int8) - 32).reshape(*lead, 16, 16)
    return ((_f32(d) * _f32(scales))[..., None] * q).reshape(*lead, QK_K)


_DEQUANT: dict[str, Callable[..., jax.Array]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


def dequantize_blocks(fmt: str, data: dict[str, jax.Array]) -> jax.Array:
    """The float32 values [..., blocks, block_size] of a quantized format's fields, each [..., blocks, count] (a
    QTensor's, or a quantized KV cache's: dflash_jax/kv_quant.py)."""
    return _DEQUANT[fmt](*(jnp.asarray(data[name]) for name, _, _ in FORMATS[fmt].fields))


@jax.jit
def dequantize(qt: QTensor) -> jax.Array:
    """The float32 [out, in] matrix a QTensor stores (bit-exact with gguf.quants.dequantize)."""
    if FORMATS[qt.fmt].dense:
        return _f32(qt.data["w"])
    return dequantize_blocks(qt.fmt, qt.data).reshape(qt.shape)


def take_rows(qt: QTensor, rows: jax.Array) -> QTensor:
    """The QTensor of the given rows (e.g. the embedding rows of some token ids): [len(rows), in]."""
    data = {name: jnp.take(jnp.asarray(x), rows, axis=0) for name, x in qt.data.items()}
    return QTensor(data=data, fmt=qt.fmt, shape=(rows.shape[0], qt.shape[1]))


def linear(x: jax.Array, w: QTensor | jax.Array,
           precision: jax.lax.Precision | None = jax.lax.Precision.HIGHEST) -> jax.Array:
    """x [..., in] @ w.T for a weight [out, in] stored dense or quantized (reference: dequantize, then a float32 dot,
    by default exact: HIGHEST keeps a GPU from TF32, which it would use for some shapes and not others)."""
    dense = dequantize(w) if isinstance(w, QTensor) else jnp.asarray(w, jnp.float32)
    return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), dense, precision=precision)
