"""Write `qwen35` GGUF files from HF Qwen3.5 weights the way llama.cpp's converter and llama-quantize do.

`write_gguf` takes GGUF-convention float32 tensors (see `dflash_jax.weights.hf_to_gguf`), picks a type per tensor
(by default llama.cpp's stock Q4_K_M rules, specs/qwen35_gguf.md §4.1), quantizes with our own numpy K-quant
quantizers and writes metadata from the TargetConfig. Used for test fixtures and for shipping the tiny models.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf import GGUFValueType as VT

from dflash_jax.config import FULL_ATTENTION, TargetConfig
from dflash_jax.gguf import ARCH, TensorSpec, tensor_specs
from dflash_jax.testing.quantize import quantize
from dflash_jax.weights import hf_to_gguf

MOSTLY_Q4_K_M = 15  # llama_ftype of a Q4_K_M file
TypeRule = Callable[[str, TensorSpec], GT]
MetadataField = tuple[str, Any, VT, "VT | None"]  # key, value, type, array element type


def _use_more_bits(layer: int, n_layers: int) -> bool:
    """llama-quantize's use_more_bits: the first and last eighth of the layers, and every third in between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def _fallback(qtype: GT, cols: int) -> GT:
    """llama-quantize's substitute when a row is not a whole number of 256-value super-blocks."""
    if cols % 256 == 0 or qtype not in (GT.Q4_K, GT.Q5_K, GT.Q6_K):
        return qtype
    if cols % 32:
        return GT.F16
    return {GT.Q4_K: GT.Q5_0, GT.Q5_K: GT.Q5_1, GT.Q6_K: GT.Q8_0}[qtype]


def q4_k_m_rule(cfg: TargetConfig) -> TypeRule:
    """Stock llama.cpp Q4_K_M types (since 2026-03): Q6_K for output and the "more bits" attn_v/attn_qkv/ffn_down."""
    n_blocks = cfg.num_layers + cfg.num_mtp_layers

    def rule(name: str, spec: TensorSpec) -> GT:
        if spec.kind == "dense":
            return GT.F32
        if name == "output.weight":
            qtype = GT.Q6_K
        elif name == "token_embd.weight":
            qtype = GT.Q6_K if cfg.tie_word_embeddings else GT.Q4_K
        else:
            layer, local = int(name.split(".")[1]), name.split(".", 2)[2]
            more_bits = local in ("attn_v.weight", "attn_qkv.weight", "ffn_down.weight")
            qtype = GT.Q6_K if more_bits and _use_more_bits(layer, n_blocks) else GT.Q4_K
        return _fallback(qtype, spec.shape[-1])

    return rule


def uniform_rule(qtype: GT) -> TypeRule:
    """Every matrix in one type (with llama-quantize's fallback for short rows); dense tensors F32."""
    return lambda name, spec: GT.F32 if spec.kind == "dense" else _fallback(qtype, spec.shape[-1])


def copy_metadata(reader: gguf.GGUFReader, prefix: str) -> list[MetadataField]:
    """Metadata fields of an existing GGUF whose keys start with prefix (e.g. "tokenizer."), ready to write."""
    fields = []
    for key, field in reader.fields.items():
        if key.startswith(prefix):
            sub = field.types[-1] if field.types[0] == VT.ARRAY else None
            fields.append((key, field.contents(), field.types[0], sub))
    return fields


def _add_config(w: gguf.GGUFWriter, cfg: TargetConfig) -> None:
    w.add_block_count(cfg.num_layers + cfg.num_mtp_layers)
    if cfg.num_mtp_layers:
        w.add_nextn_predict_layers(cfg.num_mtp_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.rope_dim)
    w.add_rope_dimension_sections(list(cfg.rope_sections))
    w.add_ssm_conv_kernel(cfg.conv_kernel)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.value_dim)
    interval = cfg.full_attention_layers[0] + 1 if cfg.full_attention_layers else 0
    if interval and cfg.layer_types == tuple(FULL_ATTENTION if (i + 1) % interval == 0 else "linear_attention"
                                             for i in range(cfg.num_layers)):
        w.add_full_attention_interval(interval)
    else:  # a pattern that is not every interval-th layer: llama.cpp's per-layer override
        w.add_key_value(f"{ARCH}.attention.recurrent_layers", [t != FULL_ATTENTION for t in cfg.layer_types],
                        VT.ARRAY, sub_type=VT.BOOL)


def write_gguf(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], cfg: TargetConfig, *,
               types: TypeRule | None = None, metadata: Sequence[MetadataField] = (),
               name: str = "dflash-jax tiny qwen35") -> dict[str, GT]:
    """Write a `qwen35` GGUF of GGUF-convention float32 tensors; returns the type chosen for each tensor."""
    specs = tensor_specs(cfg)
    missing = [n for n, s in specs.items() if n not in tensors and not s.optional]
    unexpected = [n for n in tensors if n not in specs]
    if missing or unexpected:
        raise ValueError(f"tensors do not match the config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    rule = types or q4_k_m_rule(cfg)
    w = gguf.GGUFWriter(os.fspath(path), ARCH)
    w.add_name(name)
    if types is None:
        w.add_file_type(MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_config(w, cfg)
    for key, value, vtype, sub in metadata:
        w.add_key_value(key, value, vtype, sub_type=sub)
    chosen = {}
    for tname, spec in specs.items():
        if tname not in tensors:
            continue
        x = np.asarray(tensors[tname], dtype=np.float32)
        if x.shape != spec.shape:
            raise ValueError(f"tensor {tname!r} has shape {list(x.shape)}, expected {list(spec.shape)}")
        qtype = chosen[tname] = rule(tname, spec)
        data = quantize(x, qtype)
        w.add_tensor(tname, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return chosen


def write_hf_as_gguf(path: str | os.PathLike, hf_tensors: Mapping[str, np.ndarray], cfg: TargetConfig,
                     **kwargs: Any) -> dict[str, GT]:
    """Convert an HF Qwen3.5 state dict with llama.cpp's conventions and write it as a `qwen35` GGUF."""
    return write_gguf(path, hf_to_gguf(hf_tensors, cfg), cfg, **kwargs)


def rewrite_gguf(src: str | os.PathLike, dst: str | os.PathLike, *, arch: str | None = None,
                 drop_keys: Sequence[str] = (), set_keys: Sequence[MetadataField] = (),
                 drop_tensors: Sequence[str] = (), tensors: Mapping[str, tuple[np.ndarray, GT]] | None = None) -> None:
    """Copy a GGUF with edits (architecture, keys dropped or set, tensors dropped, replaced or added) for tests."""
    reader = gguf.GGUFReader(os.fspath(src))
    w = gguf.GGUFWriter(os.fspath(dst), arch or reader.fields["general.architecture"].contents())
    skip = {"general.architecture", *drop_keys, *(f[0] for f in set_keys)}
    kept = [f for f in copy_metadata(reader, "") if not f[0].startswith("GGUF.") and f[0] not in skip]
    for key, value, vtype, sub in [*kept, *set_keys]:
        w.add_key_value(key, value, vtype, sub_type=sub)
    replace = dict(tensors or {})
    stored = {t.name: (t.data, t.tensor_type) for t in reader.tensors if t.name not in drop_tensors}
    for name, (data, qtype) in {**stored, **replace}.items():
        w.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
