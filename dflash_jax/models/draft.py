"""The DFlash drafter (z-lab checkpoints, specs/dflash_ddtree.md §1): a block of [root, MASK x (B-1)] in one pass.

Qwen3-style layers (pre-norm, q/k RMSNorm, NeoX RoPE over the whole head, SwiGLU). The target's tap features of
committed tokens are fused (`hidden_norm(fc(concat(taps)))`) and injected only as extra keys and values: each
layer projects them with its own k/v projection, k_norm and RoPE at the tokens' positions. Those context keys and
values are computed once per committed token and kept in `DraftState` (the C++ engine recomputes them every step):
the sliding-window layers keep a ring of their window, the full-attention layers all the context or a ring of the last
`context` positions (EngineConfig.draft_ctx). The block is embedded with the target's embedding and read out through
the target's lm_head. The weights live in Flax NNX modules whose paths are the z-lab tensor names
(`Draft.layers[0].self_attn.q_proj.weight`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from dflash_jax import kernels
from dflash_jax import kv_quant as kvq
from dflash_jax.config import (SLIDING_ATTENTION, ConfigError, DraftConfig, KernelConfig, TargetConfig,
                               draft_config_to_hf)
from dflash_jax.kernels import REFERENCE
from dflash_jax.models.layers import MLP, AttentionWeights, Linear, RMSNorm, rope, weight_at, write_slots
from dflash_jax.models.target import Target
from dflash_jax.quant import QTensor


def tensor_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a z-lab checkpoint with its [out, in] shape."""
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (cfg.num_heads * hd, h), "self_attn.k_proj.weight": (cfg.num_kv_heads * hd, h),
        "self_attn.v_proj.weight": (cfg.num_kv_heads * hd, h), "self_attn.o_proj.weight": (h, cfg.num_heads * hd),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
    }
    shapes = {"fc.weight": (h, len(cfg.target_layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for n in range(cfg.num_layers):
        shapes.update({f"layers.{n}.{k}": v for k, v in layer.items()})
    return shapes


class DraftAttention(AttentionWeights):
    """A drafter layer's attention (Qwen3's): per-head q/k RMSNorm, RoPE over the whole head, no output gate."""

    def kv(self, cfg: DraftConfig, x: jax.Array, pos: jax.Array, kcfg: KernelConfig) -> tuple[jax.Array, jax.Array]:
        """Keys (k-normed, roped at `pos`) and values [n, kv_heads, head_dim] of hidden states x [n, H]."""
        n = x.shape[0]
        k = self.k_proj(x, kcfg).reshape(n, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x, kcfg).reshape(n, cfg.num_kv_heads, cfg.head_dim)
        return rope(self.k_norm(k), pos, cfg.head_dim, cfg.rope_theta), v


class DraftLayer(nnx.Module):
    """One drafter layer: pre-normed attention over the context and the block, then a pre-normed MLP."""

    def __init__(self, input_layernorm: RMSNorm, self_attn: DraftAttention, post_attention_layernorm: RMSNorm,
                 mlp: MLP):
        self.input_layernorm, self.self_attn = input_layernorm, self_attn
        self.post_attention_layernorm, self.mlp = post_attention_layernorm, mlp


class Draft(nnx.Module):
    """The DFlash drafter (z-lab's DFlashDraftModel): `fc` and `hidden_norm` over the concatenated tap features, its
    layers (full or sliding-window attention as config.layer_types says) and the final norm, with its config and
    the KernelConfig its matrices are laid out for. It has no embedding or head: it borrows the target's."""

    def __init__(self, config: DraftConfig, fc: Any, hidden_norm: jax.Array, layers: list[DraftLayer],
                 norm: jax.Array, kcfg: KernelConfig = REFERENCE):
        self.config, self.kcfg = config, kcfg
        self.fc = Linear(fc)
        self.hidden_norm = RMSNorm(hidden_norm, config.rms_norm_eps)
        self.layers = nnx.List(layers)
        self.norm = RMSNorm(norm, config.rms_norm_eps)


def _sub_args(tensors: Mapping[str, Any], prefix: str, sub: str) -> dict[str, Any]:
    """A sub-module's constructor arguments (`q_proj`, ...) from the z-lab tensors `{prefix}{sub}.NAME.weight`."""
    head = prefix + sub + "."
    return {name[len(head):].split(".")[0]: x for name, x in tensors.items() if name.startswith(head)}


def draft_from_tensors(cfg: DraftConfig, tensors: Mapping[str, QTensor | np.ndarray],
                       kcfg: KernelConfig = REFERENCE) -> Draft:
    """The Draft holding tensors by z-lab name as they are (nothing is copied)."""
    eps, layers = cfg.rms_norm_eps, []
    for n in range(cfg.num_layers):
        prefix = f"layers.{n}."
        layers.append(DraftLayer(RMSNorm(tensors[prefix + "input_layernorm.weight"], eps),
                                 DraftAttention(**_sub_args(tensors, prefix, "self_attn"), eps=eps),
                                 RMSNorm(tensors[prefix + "post_attention_layernorm.weight"], eps),
                                 MLP(**_sub_args(tensors, prefix, "mlp"))))
    return Draft(cfg, tensors["fc.weight"], tensors["hidden_norm.weight"], layers, tensors["norm.weight"], kcfg)


def draft_tensors(model: Draft) -> dict[str, np.ndarray]:
    """Tensors by z-lab name from a Draft (the inverse of draft_from_tensors), as numpy arrays."""
    return {name: np.asarray(weight_at(model, name)) for name in tensor_shapes(model.config)}


def write_draft_dir(path: str | os.PathLike, model: Draft) -> None:
    """Save a drafter in the z-lab layout: config.json and bf16 model.safetensors (tensor names sorted)."""
    tensors = draft_tensors(model)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(draft_config_to_hf(model.config), f, indent=2)
    save_file({k: np.asarray(tensors[k]).astype(ml_dtypes.bfloat16) for k in sorted(tensors)},
              os.path.join(path, "model.safetensors"))


def check_pair(draft: DraftConfig, target: TargetConfig, where: str = "drafter") -> None:
    """Raise ConfigError unless the drafter can run on this target (shared embedding, head and tap layers)."""
    problems = []
    if draft.hidden_size != target.hidden_size:
        problems.append(f"hidden size {draft.hidden_size} != the target's {target.hidden_size}")
    if draft.vocab_size != target.vocab_size:
        problems.append(f"vocab {draft.vocab_size} != the target's {target.vocab_size}")
    if draft.num_target_layers != target.num_layers:
        problems.append(f"it was made for a target of {draft.num_target_layers} layers, this one has "
                        f"{target.num_layers}")
    if draft.mask_token_id >= target.vocab_size:
        problems.append(f"mask token {draft.mask_token_id} is outside the target's vocab of {target.vocab_size}")
    if problems:
        raise ConfigError(f"{where} does not fit the target: " + "; ".join(problems))


def cache_groups(cfg: DraftConfig) -> tuple[tuple[int, ...], ...]:
    """The layers of each context cache group: the full-attention layers, then the sliding-window layers (a group
    only where the drafter has such layers). A group's layers share one stacked cache."""
    full = tuple(i for i, t in enumerate(cfg.layer_types) if t != SLIDING_ATTENTION)
    sliding = tuple(i for i, t in enumerate(cfg.layer_types) if t == SLIDING_ATTENTION)
    return tuple(g for g in (full, sliding) if g)


def _place(cfg: DraftConfig, layer: int) -> tuple[int, int]:
    """(group, index within the group's stacked cache) of a layer."""
    return next((g, layers.index(layer)) for g, layers in enumerate(cache_groups(cfg)) if layer in layers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftState:
    """Each layer's context keys and values (roped, k-normed) for the committed tokens it may still see, by cache
    group (`cache_groups`), and how many tokens are committed.

    A group's layers see the last `windows[g]` committed positions (None: all of them). A linear cache holds
    position p at slot p. A ring (`rings[g]`, for a window well below the context) holds it at slots p mod W and
    p mod W + W (W = the window), so the last n <= W positions are always the contiguous slots [(L - n) mod W,
    (L - n) mod W + n): the attention kernel reads them as it reads any prefix, with no wrap. A ring cannot give
    back a position it has overwritten: `start[g]` is the first position the group still holds (0 until a rewind,
    `rewound`), and no layer sees further back."""

    k: tuple[jax.Array | kvq.KVBlocks, ...]  # per group: [group layers, slots, kv_heads, head_dim], in a KV type
    v: tuple[jax.Array | kvq.KVBlocks, ...]  # per group: [group layers, slots, kv_heads, head_dim], in a KV type
    length: jax.Array  # [] int32: committed tokens
    start: jax.Array  # [groups] int32: the first position each group still holds
    windows: tuple[int | None, ...] = dataclasses.field(metadata=dict(static=True))  # per group; None: all
    rings: tuple[bool, ...] = dataclasses.field(metadata=dict(static=True))  # per group: stored as a ring

    def rewound(self, length: jax.Array) -> "DraftState":
        """The state set back to `length` committed tokens (at most its own). A ring still holds the positions of
        its window before the rewind that lie below `length`: its start moves up to the first of them (or to
        `length`, where it holds none; positions from there on are written again before anything reads them)."""
        start = jnp.stack([jnp.minimum(length, jnp.maximum(self.start[g], self.length - w)) if ring else self.start[g]
                           for g, (w, ring) in enumerate(zip(self.windows, self.rings))])
        return dataclasses.replace(self, length=jnp.copy(length), start=start)


def group_windows(cfg: DraftConfig, context: int | None) -> tuple[int | None, ...]:
    """The window of each cache group: the full-attention layers see the last `context` positions (None: all), the
    sliding layers their sliding window (a query at the block's row i sees one fewer per row, `_visibility`)."""
    return tuple(cfg.sliding_window if cfg.layer_types[layers[0]] == SLIDING_ATTENTION else context
                 for layers in cache_groups(cfg))


def init_draft_state(cfg: DraftConfig, slots: int, kv_types: tuple[str, str] = ("f32", "f32"),
                     context: int | None = None) -> DraftState:
    """An empty context cache for up to `slots` committed tokens, keys and values in the KV types kv_types (names of
    kv_quant.TYPES), the full-attention layers seeing the last `context` positions (None: all). A group whose window
    is under half the slots is a ring of twice its window; the others are linear."""
    k_type, v_type = kv_types
    k, v, rings = [], [], []
    windows = group_windows(cfg, context)
    for layers, window in zip(cache_groups(cfg), windows):
        ring = window is not None and 2 * window < slots
        shape = (len(layers), 2 * window if ring else slots, cfg.num_kv_heads, cfg.head_dim)
        k.append(kvq.empty(k_type, shape))
        v.append(kvq.empty(v_type, shape))
        rings.append(ring)
    return DraftState(k=tuple(k), v=tuple(v), length=jnp.zeros((), jnp.int32),
                      start=jnp.zeros(len(windows), jnp.int32), windows=windows, rings=tuple(rings))


def _write_slots(state: DraftState, g: int, pos: jax.Array, keep: jax.Array) -> jax.Array:
    """The slots of group g that the rows of positions pos [n] go to, where `keep`: [n] linear, [2n] in a ring (both
    copies); the others past the cache's end (dropped)."""
    if not state.rings[g]:
        return jnp.where(keep, pos, state.k[g].shape[1])
    w = state.windows[g]
    keep = keep & (pos >= state.length + jnp.sum(keep) - w)  # a chunk longer than the ring: its last w rows
    slot = jnp.where(keep, pos % w, 2 * w)
    return jnp.concatenate([slot, jnp.where(keep, slot + w, 2 * w)])


def extend_context(params: Draft, cfg: DraftConfig, state: DraftState, taps: jax.Array, n_valid: jax.Array,
                   kcfg: KernelConfig = REFERENCE) -> DraftState:
    """Append the first n_valid of n newly committed tokens' tap features [n, n_taps, H] to the context cache (the
    rest are not written: in a ring they would overwrite positions still in its window)."""
    n = taps.shape[0]
    fused = params.hidden_norm(params.fc(taps.reshape(n, -1), kcfg))
    pos = state.length + jnp.arange(n)
    slots = [_write_slots(state, g, pos, jnp.arange(n) < n_valid) for g in range(len(state.k))]
    k_all, v_all = list(state.k), list(state.v)
    for layer, p in enumerate(params.layers):
        k, v = p.self_attn.kv(cfg, fused, pos, kcfg)
        g, j = _place(cfg, layer)
        copies = slots[g].shape[0] // n  # a ring writes each row twice
        k_all[g] = write_slots(k_all[g], jnp.tile(k, (copies, 1, 1)), slots[g], j)
        v_all[g] = write_slots(v_all[g], jnp.tile(v, (copies, 1, 1)), slots[g], j)
    return dataclasses.replace(state, k=tuple(k_all), v=tuple(v_all), length=state.length + n_valid)


def _visibility(cfg: DraftConfig, layer: int, length: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Which keys the block's queries see: (block mask [B, B], first visible context position per query [B]).

    Full layers see every committed position and the whole block; sliding layers are causal within the block and see
    keys up to sliding_window - 1 positions back, the query itself included. The cache group's window and start
    (`_cache_slots`) may hide more."""
    b = cfg.block_size
    i = jnp.arange(b)
    if cfg.layer_types[layer] != SLIDING_ATTENTION:
        return jnp.ones((b, b), bool), jnp.zeros(b, jnp.int32)
    window = cfg.sliding_window
    block = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    return block, (length + i - window + 1).astype(jnp.int32)


def _cache_slots(state: DraftState, g: int, first: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Where group g holds the context its queries see, as the attention kernel reads a prefix: (the end slot [],
    each query's first slot [B]) for the queries' first visible positions `first` [B]. The oldest position seen is
    the group's start, or the window's first; a ring holds the positions from there to the length contiguously."""
    window = state.windows[g]
    oldest = state.start[g] if window is None else jnp.maximum(state.start[g], state.length - window)
    base = oldest % window if state.rings[g] else oldest
    return base + state.length - oldest, base + jnp.maximum(first - oldest, 0)


def propose(params: Draft, cfg: DraftConfig, state: DraftState, target: Target,
            root: jax.Array, kcfg: KernelConfig = REFERENCE) -> tuple[jax.Array, jax.Array]:
    """Draft the block [root, MASK x (B-1)] at positions length..: hidden [B, H] (after the final norm) and
    logits [B, V] through the target's lm_head; row d predicts the token d places after the root. `kcfg` picks
    the attention kernel (dflash_jax.kernels)."""
    hidden = draft_hidden(params, cfg, state, target, root, kcfg)
    return hidden, target.lm_head(hidden, kcfg)


def draft_hidden(params: Draft, cfg: DraftConfig, state: DraftState, target: Target, root: jax.Array,
                 kcfg: KernelConfig = REFERENCE) -> jax.Array:
    """The hidden states [B, H] of `propose` (after the final norm), before the head."""
    b, hd = cfg.block_size, cfg.head_dim
    tokens = jnp.full((b,), cfg.mask_token_id, jnp.int32).at[0].set(root)
    x = target.embed_tokens(tokens)
    pos = state.length + jnp.arange(b)
    for layer, p in enumerate(params.layers):
        u = p.input_layernorm(x)
        q = p.self_attn.q_proj(u, kcfg).reshape(b, cfg.num_heads, hd)
        q = rope(p.self_attn.q_norm(q), pos, hd, cfg.rope_theta)
        k, v = p.self_attn.kv(cfg, u, pos, kcfg)
        blk_mask, first = _visibility(cfg, layer, state.length)
        g, j = _place(cfg, layer)
        end, prefix_lo = _cache_slots(state, g, first)
        # the block's own keys and values in the cache's types, as the kernel reads a block (models/target.py)
        k, v = kvq.stored(k, state.k[g]), kvq.stored(v, state.v[g])
        o = kernels.tree_attention(q, state.k[g], state.v[g], end, k, v, blk_mask, prefix_lo, kcfg, j)
        x = x + p.self_attn.o_proj(o.reshape(b, -1), kcfg)
        x = x + p.mlp(p.post_attention_layernorm(x), kcfg)
    return params.norm(x)
