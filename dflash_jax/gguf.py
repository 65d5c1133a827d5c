"""Read `qwen35` GGUF files: metadata -> TargetConfig, tensor table checked against it, tensors -> QTensor / arrays.

Keys and tensor names follow specs/qwen35_gguf.md §3.1-3.2. The file is memory-mapped by gguf-py's reader; nothing
is copied until a tensor is loaded. Every problem with a file raises one `GGUFError` that names the file, the key
or tensor, and what was expected vs found.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf import GGUFValueType as VT

from dflash_jax import quant
from dflash_jax.config import FULL_ATTENTION, LINEAR_ATTENTION, ConfigError, TargetConfig, rope_sections
from dflash_jax.errors import InputError

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

class _CheckedReader(gguf.GGUFReader):
    """gguf-py's reader, with the tensor table checked against the file size and known types before mapping."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                ggml_type = GT(int(raw_dtype[0]))
            except ValueError:
                raise GGUFError(f"tensor {name!r} has unknown ggml type id {int(raw_dtype[0])}") from None
            block, type_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
            end = start_offs + int(offset[0]) + int(np.prod(dims, dtype=np.int64)) * type_bytes // block
            if end > size:
                raise GGUFError(f"file is truncated: tensor {name!r} ends at byte {end} but the file has "
                                f"{size} bytes")
        super()._build_tensors(start_offs, fields)


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
    try:
        return _CheckedReader(path)
    except GGUFError as e:
        raise GGUFError(f"{path}: {e}") from None
    except Exception as e:  # gguf-py raises assorted errors on a cut or corrupt header
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
        return field.contents()

    def number(self, key: str, kind: type, default: Any = ...) -> Any:
        v = self.value(key, default)
        if isinstance(v, (list, str)) or (kind is int and isinstance(v, float)):
            raise GGUFError(f"{self.path}: metadata key {key!r} should be a single {kind.__name__}, found {v!r}")
        if kind is float and self.has(key) and self.reader.fields[key].types == [VT.FLOAT32]:
            return float(str(np.float32(v)))  # the shortest decimal that is this float32: 1e-06, not 9.99999997e-07
        return kind(v)

    def per_layer(self, key: str, n: int, default: Any = ...) -> list[int]:
        """A key that is one integer or one integer per layer (llama.cpp's get_key_or_arr)."""
        v = self.value(key, default)
        if not isinstance(v, list):
            return [int(v)] * n
        if len(v) < n:
            raise GGUFError(f"{self.path}: metadata key {key!r} has {len(v)} entries, expected one per layer ({n})")
        return [int(x) for x in v[:n]]


def open_metadata(path: str) -> _Metadata:
    """The metadata of a GGUF file of any architecture, with typed access (tensors are checked for truncation)."""
    return _Metadata(_open_reader(path), path)


def _layer_types(meta: _Metadata, n_layer: int) -> tuple[str, ...]:
    key = f"{ARCH}.attention.recurrent_layers"
    if meta.has(key):
        recurrent = meta.value(key)
        if not isinstance(recurrent, list) or len(recurrent) < n_layer:
            raise GGUFError(f"{meta.path}: metadata key {key!r} should list one bool per layer ({n_layer}), "
                            f"found {recurrent!r}")
        return tuple(LINEAR_ATTENTION if r else FULL_ATTENTION for r in recurrent[:n_layer])
    interval = meta.number(f"{ARCH}.full_attention_interval", int, 4)
    if interval <= 0:
        raise GGUFError(f"{meta.path}: {ARCH}.full_attention_interval must be positive, found {interval}")
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


def target_config_from_gguf(reader: gguf.GGUFReader, path: str = "<gguf>") -> TargetConfig:
    """TargetConfig from a `qwen35` GGUF's metadata (and its tensor table, for vocab size and tied embeddings)."""
    meta = _Metadata(reader, path)
    arch = meta.value("general.architecture")
    if arch != ARCH:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported (expected {ARCH!r}, Qwen3.5/3.6)")
    key = lambda k: f"{ARCH}.{k}"  # noqa: E731
    block_count = meta.number(key("block_count"), int)
    n_mtp = meta.number(key("nextn_predict_layers"), int, 0)
    n_layer = block_count - n_mtp
    if n_layer <= 0:
        raise GGUFError(f"{path}: block_count {block_count} leaves no main layers after "
                        f"{n_mtp} nextn_predict_layers")
    layer_types = _layer_types(meta, n_layer)
    num_heads = _attention_count(meta, key("attention.head_count"), layer_types)
    head_dim = meta.number(key("attention.key_length"), int, meta.number(key("embedding_length"), int) // num_heads)
    value_length = meta.number(key("attention.value_length"), int, head_dim)
    if value_length != head_dim:
        raise GGUFError(f"{path}: attention.value_length {value_length} differs from key_length {head_dim}; "
                        f"qwen35 uses one head_dim")
    n_value_heads = meta.number(key("ssm.time_step_rank"), int)
    inner = meta.number(key("ssm.inner_size"), int)
    if n_value_heads <= 0 or inner % n_value_heads:
        raise GGUFError(f"{path}: ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {n_value_heads}")
    ffn = set(meta.per_layer(key("feed_forward_length"), n_layer))
    if len(ffn) != 1:
        raise GGUFError(f"{path}: feed_forward_length differs between layers ({sorted(ffn)}); "
                        f"only one value is supported")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: missing tensor 'token_embd.weight'")
    try:
        return TargetConfig(
            vocab_size=int(tensors["token_embd.weight"].shape[1]),
            hidden_size=meta.number(key("embedding_length"), int),
            intermediate_size=ffn.pop(),
            num_layers=n_layer,
            layer_types=layer_types,
            num_heads=num_heads,
            num_kv_heads=_attention_count(meta, key("attention.head_count_kv"), layer_types),
            head_dim=head_dim,
            rope_theta=meta.number(key("rope.freq_base"), float, 10000.0),
            rope_dim=meta.number(key("rope.dimension_count"), int),
            rope_sections=rope_sections(meta.value(key("rope.dimension_sections"), [11, 11, 10, 0])),
            linear_num_key_heads=meta.number(key("ssm.group_count"), int),
            linear_num_value_heads=n_value_heads,
            linear_key_head_dim=meta.number(key("ssm.state_size"), int),
            linear_value_head_dim=inner // n_value_heads,
            conv_kernel=meta.number(key("ssm.conv_kernel"), int),
            rms_norm_eps=meta.number(key("attention.layer_norm_rms_epsilon"), float),
            max_position_embeddings=meta.number(key("context_length"), int),
            tie_word_embeddings="output.weight" not in tensors,
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

    def metadata(self) -> Iterator[tuple[str, Any]]:
        """(key, value) for every metadata field, long arrays summarised."""
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF."):
                continue
            if field.types and field.types[0] == VT.ARRAY and len(field.data) > 16:
                yield key, f"[{len(field.data)} x {field.types[-1].name.lower()}]"
            else:
                yield key, field.contents()

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
        if spec.kind == "matrix" and len(info.shape) == 2:
            return qt
        return np.asarray(quant.dequantize(qt)).reshape(info.shape)
