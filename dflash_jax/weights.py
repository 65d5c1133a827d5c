"""HF Qwen3.5 weights <-> the GGUF conventions the engine runs on (llama.cpp's converter, specs/qwen35_gguf.md §3.3).

The engine keeps one layout inside: GGUF names, norms with +1 folded in (except the gated `ssm_norm`),
`ssm_a = -exp(A_log)`, the conv kernel squeezed to [channels, K], and value heads in llama.cpp's tiled order
(GGUF value head j = r * nk + g holds HF head g * R + r, R = nv / nk, §3.4). `hf_to_gguf` applies exactly these
transforms to an HF state dict, `gguf_to_hf` undoes them; both check that every tensor is accounted for.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np

from dflash_jax.config import TargetConfig
from dflash_jax.errors import InputError
from dflash_jax.gguf import tensor_specs
from dflash_jax.quant import Unsupported


class WeightsError(InputError):
    """HF weights that do not match their config: a missing, unexpected or misshapen tensor."""


def tiled_value_order(nk: int, nv: int) -> np.ndarray:
    """perm with gguf_heads = hf_heads[perm]: GGUF value head j = r*nk + g holds HF head g*(nv//nk) + r."""
    j = np.arange(nv)
    return (j % nk) * (nv // nk) + j // nk


def _permute_blocks(x: np.ndarray, perm: np.ndarray, block: int, axis: int) -> np.ndarray:
    """Reorder `axis` of x, seen as len(perm) blocks of `block` entries, by perm."""
    idx = (perm[:, None] * block + np.arange(block)[None, :]).reshape(-1)
    return np.take(x, idx, axis=axis)


@dataclasses.dataclass(frozen=True)
class _Rule:
    hf: str  # HF tensor name
    to_gguf: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def _rules(cfg: TargetConfig) -> dict[str, _Rule]:
    """GGUF name -> (HF name, transform, inverse) for every tensor of the config."""
    if cfg.num_mtp_layers > 1:
        raise Unsupported(f"HF conversion of {cfg.num_mtp_layers} MTP layers (HF checkpoints carry one)")
    nk, nv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    perm = tiled_value_order(nk, nv)
    inv = np.argsort(perm)
    kd2 = 2 * cfg.key_dim  # q and k channels come before v in the qkv projection and the conv

    def heads(axis: int, block: int, offset: int = 0) -> tuple[Callable, Callable]:
        def reorder(order):
            def f(x):
                head, tail = np.split(x, [offset], axis=axis)
                return np.concatenate([head, _permute_blocks(tail, order, block, axis)], axis=axis)
            return f
        return reorder(perm), reorder(inv)

    plus_one = (lambda x: x + 1.0, lambda x: x - 1.0)
    same = (_identity, _identity)
    rows, cols, vec = heads(0, dv), heads(1, dv), heads(0, 1)
    qkv_rows = heads(0, dv, kd2)
    a_fwd, a_inv = vec
    conv_fwd, conv_inv = qkv_rows
    layer_maps = {
        "attn_norm.weight": ("input_layernorm.weight", plus_one),
        "post_attention_norm.weight": ("post_attention_layernorm.weight", plus_one),
        "ffn_gate.weight": ("mlp.gate_proj.weight", same),
        "ffn_up.weight": ("mlp.up_proj.weight", same),
        "ffn_down.weight": ("mlp.down_proj.weight", same),
        "attn_q.weight": ("self_attn.q_proj.weight", same),
        "attn_k.weight": ("self_attn.k_proj.weight", same),
        "attn_v.weight": ("self_attn.v_proj.weight", same),
        "attn_output.weight": ("self_attn.o_proj.weight", same),
        "attn_q_norm.weight": ("self_attn.q_norm.weight", plus_one),
        "attn_k_norm.weight": ("self_attn.k_norm.weight", plus_one),
        "attn_qkv.weight": ("linear_attn.in_proj_qkv.weight", qkv_rows),
        "attn_gate.weight": ("linear_attn.in_proj_z.weight", rows),
        "ssm_beta.weight": ("linear_attn.in_proj_b.weight", vec),
        "ssm_alpha.weight": ("linear_attn.in_proj_a.weight", vec),
        "ssm_a": ("linear_attn.A_log", (lambda x: -np.exp(a_fwd(x)), lambda x: a_inv(np.log(-x)))),
        "ssm_dt.bias": ("linear_attn.dt_bias", vec),
        "ssm_conv1d.weight": ("linear_attn.conv1d.weight",
                              (lambda x: conv_fwd(x[:, 0, :]), lambda x: conv_inv(x)[:, None, :])),
        "ssm_norm.weight": ("linear_attn.norm.weight", same),
        "ssm_out.weight": ("linear_attn.out_proj.weight", cols),
    }
    mtp_maps = {
        "nextn.eh_proj.weight": ("fc.weight", same),
        "nextn.enorm.weight": ("pre_fc_norm_embedding.weight", plus_one),
        "nextn.hnorm.weight": ("pre_fc_norm_hidden.weight", plus_one),
        "nextn.shared_head_norm.weight": ("norm.weight", plus_one),
    }
    global_maps = {
        "token_embd.weight": ("model.embed_tokens.weight", same),
        "output_norm.weight": ("model.norm.weight", plus_one),
        "output.weight": ("lm_head.weight", same),
    }
    rules = {}
    for name in tensor_specs(cfg):
        if name in global_maps:
            hf, (fwd, back) = global_maps[name]
        else:
            _, idx, local = name.split(".", 2)
            layer = int(idx)
            hf_prefix = f"model.layers.{layer}." if layer < cfg.num_layers else "mtp.layers.0."
            if local in mtp_maps:
                hf_local, (fwd, back) = mtp_maps[local]
                hf = f"mtp.{hf_local}"
            elif local in layer_maps:
                hf_local, (fwd, back) = layer_maps[local]
                hf = hf_prefix + hf_local
            else:
                continue  # optional nextn tensors that HF checkpoints do not carry
        rules[name] = _Rule(hf, fwd, back)
    return rules


def _canonical_hf_name(name: str) -> str | None:
    """HF names of Qwen3_5ForCausalLM; the VLM's language model is renamed to them, its vision tower dropped."""
    if name.startswith("model.visual.") or name.startswith("visual."):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the HF tensor that becomes GGUF tensor `name` of `shape`: the same (the conversions permute within
    it), but for the conv kernel, stored [channels, 1, K]."""
    return (shape[0], 1, shape[1]) if name.endswith("ssm_conv1d.weight") else shape


def iter_hf_to_gguf(names: Iterable[str], get: Callable[[str], np.ndarray],
                    cfg: TargetConfig) -> Iterator[tuple[str, str, np.ndarray]]:
    """(GGUF name, HF name, float32 tensor) converted one at a time from HF tensors `get(name)` (checked up front).

    Reading lazily keeps only one converted tensor in memory, which matters for a 27B checkpoint.
    """
    src = {}
    for name in names:
        canonical = _canonical_hf_name(name)
        if canonical is not None:
            src[canonical] = name
    if cfg.num_mtp_layers == 0:
        src = {k: v for k, v in src.items() if not k.startswith("mtp.")}  # MTP weights of a config without MTP
    specs, rules = tensor_specs(cfg), _rules(cfg)
    for name, rule in rules.items():
        if rule.hf not in src and not specs[name].optional:
            raise WeightsError(f"missing HF tensor {rule.hf!r} (for {name!r})")
    unused = sorted(set(src) - {rule.hf for rule in rules.values()})
    if cfg.tie_word_embeddings and unused == ["lm_head.weight"]:
        unused = []  # a tied checkpoint may still store the (shared) head
    if unused:
        raise WeightsError(f"unexpected HF tensor {unused[0]!r}" + (f" (and {len(unused) - 1} more)"
                                                                     if len(unused) > 1 else ""))
    for name, rule in rules.items():
        if rule.hf not in src:
            continue
        x = np.asarray(get(src[rule.hf]), dtype=np.float32)
        want = hf_shape(name, specs[name].shape)
        if x.shape != want:  # checked before converting: a conversion of another shape would fail inside numpy
            raise WeightsError(f"HF tensor {rule.hf!r} has shape {list(x.shape)}, expected {list(want)} for "
                               f"{name!r}")
        yield name, src[rule.hf], rule.to_gguf(x)


def hf_to_gguf(hf: Mapping[str, np.ndarray], cfg: TargetConfig) -> dict[str, np.ndarray]:
    """GGUF-convention float32 tensors (by GGUF name) from an HF Qwen3.5 state dict."""
    return {name: x for name, _, x in iter_hf_to_gguf(hf.keys(), hf.__getitem__, cfg)}


def gguf_to_hf(tensors: Mapping[str, np.ndarray], cfg: TargetConfig) -> dict[str, np.ndarray]:
    """An HF `Qwen3_5ForCausalLM` state dict (float32) from GGUF-convention tensors; inverse of `hf_to_gguf`."""
    specs, out = tensor_specs(cfg), {}
    for name, rule in _rules(cfg).items():
        if name in tensors:
            out[rule.hf] = rule.to_hf(np.asarray(tensors[name], dtype=np.float32))
        elif not specs[name].optional:
            raise WeightsError(f"missing GGUF tensor {name!r}")
    return out
