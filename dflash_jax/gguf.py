"""Read `qwen35` GGUF files: metadata -> TargetConfig, tensor table checked against it, tensors -> QTensor / arrays.

Keys and tensor names follow specs/qwen35_gguf.md §3.1-3.2. The file is memory-mapped by gguf-py's reader; nothing
is copied until a tensor is loaded. Every problem with a file raises one `GGUFError` that names the file, the key
or tensor, and what was expected vs found.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct
from typing import Any, Iterator

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf import GGUFValueType as VT

from dflash_jax import quant
from dflash_jax.config import (FULL_ATTENTION, LINEAR_ATTENTION, MAX_LAYERS, MAX_SIZE, ConfigError, TargetConfig,
                               rope_sections)
from dflash_jax.errors import InputError, brief

ARCH = "qwen35"


class GGUFError(InputError):
    """A GGUF file that cannot be used: unreadable, truncated, another architecture, or not matching its config."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What the architecture expects of one tensor: numpy shape ([out, in] for matrices) and its role."""

    shape: tuple[int, ...]
    kind: str  # "matrix" (any stored type, kept quantized) or "dense" (norms, conv, ssm_a/dt: loaded as float32)
    optional: bool = False


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor as stored in the file."""

    name: str
    ggml_type: GT
    shape: tuple[int, ...]  # numpy order: [out, in] for matrices (the reverse of ggml's ne)
    nbytes: int
    offset: int  # absolute byte offset of the data in the file


def _matrix(*shape: int, optional: bool = False) -> TensorSpec:
    return TensorSpec(tuple(shape), "matrix", optional)


def _dense(*shape: int, optional: bool = False) -> TensorSpec:
    return TensorSpec(tuple(shape), "dense", optional)


def _attention_block(cfg: TargetConfig) -> dict[str, TensorSpec]:
    h, hd = cfg.hidden_size, cfg.head_dim
    return {
        "attn_q.weight": _matrix(2 * cfg.num_heads * hd, h),  # per head: [query | gate]
        "attn_k.weight": _matrix(cfg.num_kv_heads * hd, h),
        "attn_v.weight": _matrix(cfg.num_kv_heads * hd, h),
        "attn_output.weight": _matrix(h, cfg.num_heads * hd),
        "attn_q_norm.weight": _dense(hd),
        "attn_k_norm.weight": _dense(hd),
    }


def _gdn_block(cfg: TargetConfig) -> dict[str, TensorSpec]:
    h, nv = cfg.hidden_size, cfg.linear_num_value_heads
    return {
        "attn_qkv.weight": _matrix(cfg.conv_dim, h),
        "attn_gate.weight": _matrix(cfg.value_dim, h),
        "ssm_beta.weight": _matrix(nv, h),
        "ssm_alpha.weight": _matrix(nv, h),
        "ssm_a": _dense(nv),
        "ssm_dt.bias": _dense(nv),
        "ssm_conv1d.weight": _dense(cfg.conv_dim, cfg.conv_kernel),
        "ssm_norm.weight": _dense(cfg.linear_value_head_dim),
        "ssm_out.weight": _matrix(h, cfg.value_dim),
    }


def _common_block(cfg: TargetConfig) -> dict[str, TensorSpec]:
    h, ff = cfg.hidden_size, cfg.intermediate_size
    return {
        "attn_norm.weight": _dense(h),
        "post_attention_norm.weight": _dense(h),
        "ffn_gate.weight": _matrix(ff, h),
        "ffn_up.weight": _matrix(ff, h),
        "ffn_down.weight": _matrix(h, ff),
    }


def _mtp_block(cfg: TargetConfig) -> dict[str, TensorSpec]:
    h, v = cfg.hidden_size, cfg.vocab_size
    return {
        **_common_block(cfg), **_attention_block(cfg),
        "nextn.eh_proj.weight": _matrix(h, 2 * h),
        "nextn.enorm.weight": _dense(h),
        "nextn.hnorm.weight": _dense(h),
        "nextn.shared_head_norm.weight": _dense(h, optional=True),
        "nextn.embed_tokens.weight": _matrix(v, h, optional=True),
        "nextn.shared_head_head.weight": _matrix(v, h, optional=True),
    }


def tensor_specs(cfg: TargetConfig) -> dict[str, TensorSpec]:
    """Every tensor a `qwen35` GGUF of this config holds, by GGUF name, in file order."""
    specs = {"token_embd.weight": _matrix(cfg.vocab_size, cfg.hidden_size),
             "output_norm.weight": _dense(cfg.hidden_size)}
    if not cfg.tie_word_embeddings:
        specs["output.weight"] = _matrix(cfg.vocab_size, cfg.hidden_size)
    for i, kind in enumerate(cfg.layer_types):
        block = {**_common_block(cfg), **(_attention_block(cfg) if kind == FULL_ATTENTION else _gdn_block(cfg))}
        specs.update({f"blk.{i}.{name}": spec for name, spec in block.items()})
    for i in range(cfg.num_layers, cfg.num_layers + cfg.num_mtp_layers):
        specs.update({f"blk.{i}.{name}": spec for name, spec in _mtp_block(cfg).items()})
    return specs


# ---------------------------------------------------------------------------------------------------------------
# Opening a file

MAX_NAME = 1 << 16  # bytes in a metadata key or tensor name (ggml's own tensor names stop at 64)
MAX_DIMS = 4  # GGML_MAX_DIMS
_HEADER = 24  # magic, version, tensor_count, kv_count
_MIN_KV = 8 + 4 + 1  # a key's length, its type, the smallest value
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # a name's length, n_dims, one dimension, type, offset
_SCALAR_BYTES = {VT.UINT8: 1, VT.INT8: 1, VT.BOOL: 1, VT.UINT16: 2, VT.INT16: 2, VT.UINT32: 4, VT.INT32: 4,
                 VT.FLOAT32: 4, VT.UINT64: 8, VT.INT64: 8, VT.FLOAT64: 8}


class _Cursor:
    """Reads a little-endian GGUF header from a buffer, every read checked against the file's length."""

    def __init__(self, buf: Any, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int, what: str) -> None:
        """Raise unless n bytes of `what` fit between here and the end of the file."""
        if n > self.size - self.pos:
            raise GGUFError(f"{what} at byte {self.pos} needs {n} bytes, past the end of the file ({self.size} bytes):"
                            f" the file is truncated or corrupt")

    def skip(self, n: int, what: str) -> int:
        """Move past n bytes of `what`; returns where they start."""
        self.need(n, what)
        start, self.pos = self.pos, self.pos + n
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.skip(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.skip(8, what))[0]

    def text(self, what: str) -> str:
        """A length-prefixed UTF-8 name (a key or a tensor name)."""
        n = self.u64(f"the length of {what}")
        if n > MAX_NAME:
            raise GGUFError(f"{what} at byte {self.pos - 8} is {n} bytes long; names are at most {MAX_NAME}")
        raw = bytes(self.buf[self.skip(n, what):self.pos])
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{what} at byte {self.pos - n} is not valid UTF-8 ({raw[:40]!r})") from None


def _value_type(raw: int, key: str) -> VT:
    try:
        return VT(raw)
    except ValueError:
        raise GGUFError(f"metadata key {key!r} has unknown value type {raw}") from None


def _skip_value(c: _Cursor, key: str, vtype: VT) -> None:
    """Move past one metadata value, checking each length it declares against the bytes left."""
    if vtype == VT.STRING:
        c.skip(c.u64(f"the length of metadata key {key!r}"), f"the text of metadata key {key!r}")
    elif vtype != VT.ARRAY:
        c.skip(_SCALAR_BYTES[vtype], f"the value of metadata key {key!r}")
    else:
        sub = _value_type(c.u32(f"the element type of metadata key {key!r}"), key)
        count = c.u64(f"the length of metadata key {key!r}")
        what = f"metadata key {key!r} (an array of {count} {sub.name.lower()})"
        if sub == VT.ARRAY:
            raise GGUFError(f"metadata key {key!r} is an array of arrays, which GGUF readers do not support")
        if sub != VT.STRING:
            c.skip(count * _SCALAR_BYTES[sub], what)
            return
        c.need(count * 8, what)  # each entry is at least its 8-byte length: no walk over 2^60 of them
        for i in range(count):
            c.skip(c.u64(f"the length of entry {i} of {what}"), f"entry {i} of {what}")


def _read_metadata(c: _Cursor, count: int) -> dict[str, tuple[VT, int]]:
    """key -> (type, where its value starts) of every metadata entry, each one checked."""
    keys: dict[str, tuple[VT, int]] = {}
    for i in range(count):
        key = c.text(f"metadata key #{i}")
        if key in keys:
            raise GGUFError(f"metadata key {key!r} appears twice")
        vtype = _value_type(c.u32(f"the type of metadata key {key!r}"), key)
        keys[key] = (vtype, c.pos)
        _skip_value(c, key, vtype)
    return keys


def _alignment(c: _Cursor, keys: dict[str, tuple[VT, int]]) -> int:
    """general.alignment (default 32): a uint32 power of two."""
    if "general.alignment" not in keys:
        return gguf.GGUF_DEFAULT_ALIGNMENT
    vtype, pos = keys["general.alignment"]
    if vtype != VT.UINT32:
        raise GGUFError(f"metadata key 'general.alignment' should be a uint32, found {vtype.name.lower()}")
    value = struct.unpack_from("<I", c.buf, pos)[0]
    if value == 0 or value & (value - 1):
        raise GGUFError(f"metadata key 'general.alignment' is {value}, expected a power of two")
    return value


def _read_tensor_info(c: _Cursor, i: int) -> tuple[str, list[int], int, int]:
    """(name, ggml dims, type id, offset) of tensor #i, its dimension count checked."""
    name = c.text(f"the name of tensor #{i}")
    n_dims = c.u32(f"the n_dims of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(f"tensor {name!r} has n_dims {n_dims}, expected 1 to {MAX_DIMS}")
    dims = [c.u64(f"dimension {j} of tensor {name!r}") for j in range(n_dims)]
    type_id = c.u32(f"the type of tensor {name!r}")
    return name, dims, type_id, c.u64(f"the offset of tensor {name!r}")


def _check_tensor(name: str, dims: list[int], type_id: int, offset: int, start: int, alignment: int,
                  size: int) -> int:
    """One tensor's type, shape and bytes checked against the file (Python integers: no overflow); returns where
    its data ends."""
    try:
        ggml_type = GT(type_id)
        block, type_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise GGUFError(f"tensor {name!r} has unknown ggml type id {type_id}") from None
    if 0 in dims:
        raise GGUFError(f"tensor {name!r} has a zero dimension (ne {dims})")
    if dims[0] % block:
        raise GGUFError(f"tensor {name!r} has rows of {dims[0]} values, not a multiple of the {ggml_type.name} "
                        f"block of {block}")
    if offset % alignment:
        raise GGUFError(f"tensor {name!r} has offset {offset}, not a multiple of the alignment {alignment}")
    end = start + offset + math.prod(dims) // block * type_bytes
    if end > size:
        raise GGUFError(f"file is truncated: tensor {name!r} ends at byte {end} but the file has {size} bytes")
    return end


def _check_layout(buf: Any, size: int) -> None:
    """Walk a GGUF header, checking every count, length, type and offset against the file and sane limits, before
    gguf-py reads it (gguf-py trusts them: a count of 2^60 would have it walk, and allocate, for minutes)."""
    c = _Cursor(buf, size)
    c.skip(4, "the magic")
    version = c.u32("header field 'version'")
    if version & 0xFFFF == 0:
        raise GGUFError("a big-endian GGUF file (header field 'version' byte-swapped) is not supported")
    if version not in (2, 3):
        raise GGUFError(f"header field 'version' is {version}; GGUF versions 2 and 3 are supported")
    n_tensors, n_kv = c.u64("header field 'tensor_count'"), c.u64("header field 'kv_count'")
    room = size - c.pos
    for field, count, least in (("kv_count", n_kv, _MIN_KV), ("tensor_count", n_tensors, _MIN_TENSOR_INFO)):
        if count > room // least:
            raise GGUFError(f"header field {field!r} is {count}, but the {room} bytes after the header hold at most "
                            f"{room // least} entries: the file is truncated or corrupt")
    alignment = _alignment(c, _read_metadata(c, n_kv))
    infos, names = [], set()
    for i in range(n_tensors):
        info = _read_tensor_info(c, i)
        if info[0] in names:
            raise GGUFError(f"tensor {info[0]!r} appears twice in the tensor table")
        names.add(info[0])
        infos.append(info)
    start = -(-c.pos // alignment) * alignment
    spans = sorted((start + info[3], _check_tensor(*info, start, alignment, size), info[0]) for info in infos)
    for (_, end, name), (begin, _, after) in zip(spans, spans[1:]):
        if end > begin:
            raise GGUFError(f"tensor {name!r} ends at byte {end}, inside tensor {after!r} (which starts at byte "
                            f"{begin}): the tensor table is corrupt")


def _open_reader(path: str) -> gguf.GGUFReader:
    if not os.path.exists(path):
        raise GGUFError(f"{path}: no such file")
    if os.path.isdir(path):
        raise GGUFError(f"{path}: is a directory, expected a .gguf file")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                _check_layout(buf, size)
            except GGUFError as e:
                raise GGUFError(f"{path}: {e}") from None
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf-py raises assorted errors on a corrupt header; _check_layout should leave none
        raise GGUFError(f"{path}: cannot parse the GGUF header ({type(e).__name__}: {e}); "
                        f"the file ({size} bytes) is truncated or corrupt") from None


class _Metadata:
    """Typed access to a reader's key/value fields, with errors that name the file and key."""

    def __init__(self, reader: gguf.GGUFReader, path: str):
        self.reader, self.path = reader, path

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def value(self, key: str, default: Any = ...) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is ...:
                raise GGUFError(f"{self.path}: missing metadata key {key!r}")
            return default
        try:
            return field.contents()
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: metadata key {key!r} holds text that is not valid UTF-8 "
                            f"({e.reason} at byte {e.start})") from None

    def _integer(self, key: str, v: Any, lo: int, hi: int) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise GGUFError(f"{self.path}: metadata key {key!r} should be a single int, found {brief(v)}")
        if not lo <= v <= hi:
            raise GGUFError(f"{self.path}: metadata key {key!r} is {v}, expected {lo} to {hi}")
        return v

    def integer(self, key: str, default: Any = ..., lo: int = 0, hi: int = MAX_SIZE) -> int:
        """An integer key, in [lo, hi]."""
        return self._integer(key, self.value(key, default), lo, hi)

    def positive(self, key: str, default: Any = ...) -> float:
        """A finite, positive float key (a float32 as its shortest decimal: 1e-06, not 9.99999997e-07)."""
        v = self.value(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise GGUFError(f"{self.path}: metadata key {key!r} should be a finite positive number, found {brief(v)}")
        if self.has(key) and self.reader.fields[key].types == [VT.FLOAT32]:
            return float(str(np.float32(v)))
        return float(v)

    def integers(self, key: str, default: Any = ..., lo: int = 0, hi: int = MAX_SIZE) -> list[int]:
        """A key that is an array of integers, each in [lo, hi]."""
        v = self.value(key, default)
        if not isinstance(v, list):
            raise GGUFError(f"{self.path}: metadata key {key!r} should be an array of ints, found {brief(v)}")
        return [self._integer(key, x, lo, hi) for x in v]

    def per_layer(self, key: str, n: int, default: Any = ..., lo: int = 0) -> list[int]:
        """A key that is one integer or one integer per layer (llama.cpp's get_key_or_arr)."""
        if not isinstance(self.value(key, default), list):
            return [self.integer(key, default, lo)] * n
        v = self.integers(key, default, lo)
        if len(v) < n:
            raise GGUFError(f"{self.path}: metadata key {key!r} has {len(v)} entries, expected one per layer ({n})")
        return v[:n]


def open_metadata(path: str) -> _Metadata:
    """The metadata of a GGUF file of any architecture, with typed access (tensors are checked for truncation)."""
    return _Metadata(_open_reader(path), path)


def _key(name: str) -> str:
    return f"{ARCH}.{name}"


def _layer_counts(meta: _Metadata, n_tensors: int) -> tuple[int, int]:
    """(main layers, MTP layers): block_count bounded by the tensor table, every block holding several tensors."""
    block_count = meta.integer(_key("block_count"), lo=1, hi=MAX_LAYERS)
    if block_count > n_tensors:
        raise GGUFError(f"{meta.path}: metadata key {_key('block_count')!r} is {block_count}, but the file holds "
                        f"{n_tensors} tensors (each block has several)")
    n_mtp = meta.integer(_key("nextn_predict_layers"), 0)
    if block_count - n_mtp <= 0:
        raise GGUFError(f"{meta.path}: block_count {block_count} leaves no main layers after "
                        f"{n_mtp} nextn_predict_layers")
    return block_count - n_mtp, n_mtp


def _layer_types(meta: _Metadata, n_layer: int) -> tuple[str, ...]:
    key = _key("attention.recurrent_layers")
    if meta.has(key):
        recurrent = meta.value(key)
        if not isinstance(recurrent, list) or len(recurrent) < n_layer or any(r not in (0, 1) for r in recurrent):
            raise GGUFError(f"{meta.path}: metadata key {key!r} should list one bool per layer ({n_layer}), "
                            f"found {brief(recurrent)}")
        return tuple(LINEAR_ATTENTION if r else FULL_ATTENTION for r in recurrent[:n_layer])
    interval = meta.integer(_key("full_attention_interval"), 4, lo=1, hi=n_layer)
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layer))


def _attention_count(meta: _Metadata, key: str, layer_types: tuple[str, ...]) -> int:
    """A head count given per layer: one value shared by all full-attention layers (0 on GDN layers is allowed)."""
    counts = {c for c, t in zip(meta.per_layer(key, len(layer_types)), layer_types) if t == FULL_ATTENTION}
    if len(counts) > 1:
        raise GGUFError(f"{meta.path}: metadata key {key!r} differs between full-attention layers "
                        f"({sorted(counts)}); only one value is supported")
    if not counts or 0 in counts:
        raise GGUFError(f"{meta.path}: metadata key {key!r} must be positive on full-attention layers")
    return counts.pop()


def _one_per_layer(meta: _Metadata, key: str, n_layer: int) -> int:
    values = set(meta.per_layer(key, n_layer, lo=1))
    if len(values) != 1:
        raise GGUFError(f"{meta.path}: metadata key {key!r} differs between layers ({sorted(values)}); "
                        f"only one value is supported")
    return values.pop()


def _vocab_size(reader: gguf.GGUFReader, path: str) -> int:
    """Rows of token_embd.weight: the vocabulary."""
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise GGUFError(f"{path}: missing tensor 'token_embd.weight'")
    if len(embd.shape) != 2:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' has {len(embd.shape)} dimensions, expected 2")
    return int(embd.shape[1])


def _rope_sections(meta: _Metadata) -> tuple[int, ...]:
    sections = meta.integers(_key("rope.dimension_sections"), [11, 11, 10, 0])
    if len(sections) > 4:
        raise GGUFError(f"{meta.path}: metadata key {_key('rope.dimension_sections')!r} has {len(sections)} "
                        f"entries, expected at most 4")
    return rope_sections(sections)


def _head_dim(meta: _Metadata, num_heads: int) -> int:
    head_dim = meta.integer(_key("attention.key_length"), meta.integer(_key("embedding_length"), lo=1) // num_heads,
                            lo=1)
    if meta.integer(_key("attention.value_length"), head_dim, lo=1) != head_dim:
        raise GGUFError(f"{meta.path}: attention.value_length {meta.value(_key('attention.value_length'))} differs "
                        f"from key_length {head_dim}; qwen35 uses one head_dim")
    return head_dim


def target_config_from_gguf(reader: gguf.GGUFReader, path: str = "<gguf>") -> TargetConfig:
    """TargetConfig from a `qwen35` GGUF's metadata (and its tensor table, for vocab size and tied embeddings)."""
    meta = _Metadata(reader, path)
    arch = meta.value("general.architecture")
    if arch != ARCH:
        raise GGUFError(f"{path}: general.architecture {brief(arch)} is not supported (expected {ARCH!r}, "
                        f"Qwen3.5/3.6)")
    n_layer, n_mtp = _layer_counts(meta, len(reader.tensors))
    layer_types = _layer_types(meta, n_layer)
    num_heads = _attention_count(meta, _key("attention.head_count"), layer_types)
    n_value_heads = meta.integer(_key("ssm.time_step_rank"), lo=1)
    inner = meta.integer(_key("ssm.inner_size"), lo=1)
    if inner % n_value_heads:
        raise GGUFError(f"{path}: ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {n_value_heads}")
    try:
        return TargetConfig(
            vocab_size=_vocab_size(reader, path),
            hidden_size=meta.integer(_key("embedding_length"), lo=1),
            intermediate_size=_one_per_layer(meta, _key("feed_forward_length"), n_layer),
            num_layers=n_layer,
            layer_types=layer_types,
            num_heads=num_heads,
            num_kv_heads=_attention_count(meta, _key("attention.head_count_kv"), layer_types),
            head_dim=_head_dim(meta, num_heads),
            rope_theta=meta.positive(_key("rope.freq_base"), 10000.0),
            rope_dim=meta.integer(_key("rope.dimension_count"), lo=1),
            rope_sections=_rope_sections(meta),
            linear_num_key_heads=meta.integer(_key("ssm.group_count"), lo=1),
            linear_num_value_heads=n_value_heads,
            linear_key_head_dim=meta.integer(_key("ssm.state_size"), lo=1),
            linear_value_head_dim=inner // n_value_heads,
            conv_kernel=meta.integer(_key("ssm.conv_kernel"), lo=1),
            rms_norm_eps=meta.positive(_key("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=meta.integer(_key("context_length"), lo=1),
            tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
            num_mtp_layers=n_mtp,
        )
    except ConfigError as e:
        raise GGUFError(f"{path}: inconsistent metadata: {e}") from None


def _check_tensors(path: str, tensors: dict[str, TensorInfo], specs: dict[str, TensorSpec]) -> None:
    """Every expected tensor present with its shape and a supported type; no unexpected tensors."""
    missing = [n for n, s in specs.items() if n not in tensors and not s.optional]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise GGUFError(f"{path}: missing tensor {missing[0]!r}{more}")
    unexpected = [n for n in tensors if n not in specs]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise GGUFError(f"{path}: unexpected tensor {unexpected[0]!r}{more} for this qwen35 config")
    for name, info in tensors.items():
        spec = specs[name]
        if info.shape != spec.shape:
            raise GGUFError(f"{path}: tensor {name!r} has shape {list(info.shape)}, expected "
                            f"{list(spec.shape)} for this config (numpy order, [out, in])")
        if info.ggml_type not in quant.SUPPORTED_TYPES:
            supported = ", ".join(sorted(t.name for t in quant.SUPPORTED_TYPES))
            raise GGUFError(f"{path}: tensor {name!r} has type {info.ggml_type.name}, which is not supported "
                            f"(supported: {supported})")


class GGUFModel:
    """An opened, validated `qwen35` GGUF file: its config, tensor table and lazy tensor access."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.reader = _open_reader(self.path)
        self.config = target_config_from_gguf(self.reader, self.path)
        self.specs = tensor_specs(self.config)
        self.tensors = {
            t.name: TensorInfo(t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape.tolist())),
                               int(t.n_bytes), int(t.data_offset))
            for t in self.reader.tensors
        }
        _check_tensors(self.path, self.tensors, self.specs)
        self._data = {t.name: t.data for t in self.reader.tensors}

    def metadata_value(self, key: str, default: Any = ...) -> Any:
        """One metadata value (a missing key without a default, or text that is not UTF-8, raises GGUFError)."""
        return _Metadata(self.reader, self.path).value(key, default)

    def metadata(self) -> Iterator[tuple[str, Any]]:
        """(key, value) for every metadata field, long arrays summarised, text that is not UTF-8 said so."""
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF."):
                continue
            if field.types and field.types[0] == VT.ARRAY and len(field.data) > 16:
                yield key, f"[{len(field.data)} x {field.types[-1].name.lower()}]"
                continue
            try:
                yield key, field.contents()
            except UnicodeDecodeError:
                yield key, "<text that is not valid UTF-8>"

    def raw(self, name: str) -> np.ndarray:
        """The stored data of a tensor as gguf-py maps it (no copy)."""
        if name not in self._data:
            raise GGUFError(f"{self.path}: no tensor {name!r}")
        return self._data[name]

    def load(self, name: str) -> quant.QTensor | np.ndarray:
        """A matrix as a QTensor in its stored format; a dense tensor as float32 numpy."""
        info, spec = self.tensors[name], self.specs[name]
        rows = int(np.prod(info.shape[:-1], dtype=np.int64))
        qt = quant.repack(self.raw(name), info.ggml_type, (rows, info.shape[-1]))
        field = quant.nonfinite_field(qt.data)
        if field is not None:
            raise GGUFError(f"{self.path}: tensor {name!r} holds NaN or infinite values in its {field!r} field "
                            f"(the file is corrupt)")
        if spec.kind == "matrix" and len(info.shape) == 2:
            return qt
        return np.asarray(quant.dequantize(qt)).reshape(info.shape)
