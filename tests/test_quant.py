"""GGUF block formats: repack round trip and reference dequantizers bit-exact with gguf-py."""

import gguf
import jax
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from dflash_jax import quant

FORMAT_NAMES = sorted(quant.FORMATS)


def _finite_bits(rng: np.random.Generator, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Random bit patterns of a float dtype with NaN/inf patterns replaced (subnormals, -0 and huge values stay)."""
    dtype = np.dtype(dtype)
    exp_bits = {2: (0x7C00 if dtype == np.float16 else 0x7F80), 4: 0x7F800000}[dtype.itemsize]
    utype = {2: np.uint16, 4: np.uint32}[dtype.itemsize]
    bits = rng.integers(0, np.iinfo(utype).max, size=shape, dtype=utype, endpoint=True)
    nonfinite = (bits & exp_bits) == exp_bits
    bits[nonfinite] &= ~utype(1 << (exp_bits.bit_length() - 1))  # clear the top exponent bit
    return bits.view(dtype)


def random_blocks(fmt: quant.BlockFormat, rows: int, cols: int, seed: int) -> np.ndarray:
    """GGUF bytes [rows, bytes_per_row]: random bytes, with every float field a random finite value."""
    rng = np.random.default_rng(seed)
    nb = cols // fmt.block_size
    parts = []
    for _, dtype, count in fmt.fields:
        shape = (rows, nb, count)
        if dtype == ml_dtypes.bfloat16:  # the top half of a finite float32 is a finite bfloat16
            field = (_finite_bits(rng, np.float32, shape).view(np.uint32) >> 16).astype(np.uint16)
        elif dtype.kind == "f":
            field = _finite_bits(rng, dtype, shape)
        else:
            field = rng.integers(0, 256, (rows, nb, count * dtype.itemsize), dtype=np.uint8)
        parts.append(field.view(np.uint8).reshape(rows, nb, -1))
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def gguf_reference(raw: np.ndarray, fmt: quant.BlockFormat, shape: tuple[int, int]) -> np.ndarray:
    if fmt.ggml_type == GT.F32:
        return raw.view(np.float32).reshape(shape)
    return gguf.quants.dequantize(raw, fmt.ggml_type).reshape(shape)


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (3, 2), (7, 3)])
def test_dequantize_is_bit_exact_with_gguf_py(name, rows, blocks):
    fmt = quant.FORMATS[name]
    cols = blocks * (fmt.block_size if not fmt.dense else 40)
    raw = random_blocks(fmt, rows, cols, seed=rows * 100 + blocks)
    qt = quant.repack(raw, fmt.ggml_type, (rows, cols))
    ours = np.asarray(quant.dequantize(qt))
    ref = gguf_reference(raw, fmt, (rows, cols))
    assert ours.shape == (rows, cols) and ours.dtype == np.float32
    np.testing.assert_array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32))
    assert np.abs(ref).max() > 0  # the data exercised something


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_dequantize_under_jit_matches(name):
    fmt = quant.FORMATS[name]
    cols = 2 * (fmt.block_size if not fmt.dense else 16)
    raw = random_blocks(fmt, 5, cols, seed=7)
    qt = jax.tree.map(jax.numpy.asarray, quant.repack(raw, fmt.ggml_type, (5, cols)))
    jitted = np.asarray(jax.jit(quant.dequantize)(qt))
    np.testing.assert_array_equal(jitted.view(np.uint32), gguf_reference(raw, fmt, (5, cols)).view(np.uint32))


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_repack_round_trips_bytes(name):
    fmt = quant.FORMATS[name]
    cols = 3 * (fmt.block_size if not fmt.dense else 8)
    raw = random_blocks(fmt, 4, cols, seed=3)
    qt = quant.repack(raw, fmt.ggml_type, (4, cols))
    assert qt.nbytes == raw.nbytes  # the split layout keeps the GGUF size exactly
    np.testing.assert_array_equal(quant.to_gguf_bytes(qt), raw)


def test_qtensor_is_a_pytree_with_static_format():
    raw = random_blocks(quant.FORMATS["Q4_K"], 2, 256, seed=1)
    qt = quant.repack(raw, GT.Q4_K, (2, 256))
    leaves, treedef = jax.tree.flatten(qt)
    assert len(leaves) == 4  # d, dmin, scales, qs
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt.fmt == "Q4_K" and rebuilt.shape == (2, 256)


def test_known_values_q8_0():
    """A hand-built Q8_0 block: d = 0.5, q = -3..28 gives y = q / 2."""
    block = np.concatenate([np.float16(0.5).reshape(1).view(np.uint8),
                            np.arange(-3, 29, dtype=np.int8).view(np.uint8)])
    y = np.asarray(quant.dequantize(quant.repack(block[None], GT.Q8_0, (1, 32))))
    np.testing.assert_array_equal(y[0], np.arange(-3, 29) / 2)


def test_unsupported_type_and_bad_sizes_raise():
    with pytest.raises(NotImplementedError, match="IQ4_XS is not supported"):
        quant.block_format(GT.IQ4_XS)
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size 256"):
        quant.repack(np.zeros((1, 144), np.uint8), GT.Q4_K, (1, 200))
    with pytest.raises(ValueError, match="needs 288 bytes, got 144"):
        quant.repack(np.zeros((1, 144), np.uint8), GT.Q4_K, (1, 512))
