"""The Qwen3.5/3.6 hybrid target: prefill, tree verify and path commit over the decode state (specs/qwen35_gguf.md §2).

Parameters are a pytree of QTensor matrices and float32 vectors in GGUF conventions (norms with +1 folded in,
`ssm_a = -exp(A_log)`, value heads tiled: value head h reads key head h mod nk). Layers are plain functions of
(params, inputs, state); nothing is stored in modules. A block of N tokens is described by `parents` (-1 = attached
to the committed prefix; a chain is parent = i - 1): tokens sit at RoPE position `length + depth`, their KV at slots
`length + index`, and each sees the committed keys plus its own ancestors (DESIGN.md "One step").
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import kernels
from dflash_jax import kv_quant as kvq
from dflash_jax.config import FULL_ATTENTION, KernelConfig, TargetConfig
from dflash_jax.kernels import REFERENCE, linear
from dflash_jax.models.layers import rms_norm, rope, swiglu, write_rows
from dflash_jax.quant import QTensor, dequantize, take_rows

# GGUF tensor name inside a block -> parameter name.
LAYER_PARAMS = {
    "attn_norm.weight": "attn_norm", "post_attention_norm.weight": "ffn_norm",
    "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
    "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv", "attn_output.weight": "wo",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "attn_qkv.weight": "w_qkv", "attn_gate.weight": "w_z", "ssm_beta.weight": "w_beta",
    "ssm_alpha.weight": "w_alpha", "ssm_a": "ssm_a", "ssm_dt.bias": "dt_bias", "ssm_conv1d.weight": "conv",
    "ssm_norm.weight": "ssm_norm", "ssm_out.weight": "w_out",
}


def params_from_tensors(cfg: TargetConfig, tensors: Mapping[str, QTensor | np.ndarray]) -> dict:
    """The parameter pytree from tensors by GGUF name (QTensor matrices, float32 dense); MTP blocks are dropped."""
    layers = []
    for i in range(cfg.num_layers):
        prefix = f"blk.{i}."
        layers.append({short: tensors[prefix + name] for name, short in LAYER_PARAMS.items()
                       if prefix + name in tensors})
    embed = tensors["token_embd.weight"]
    return {"embed": embed, "norm": tensors["output_norm.weight"],
            "lm_head": tensors.get("output.weight", embed), "layers": tuple(layers)}


# ---------------------------------------------------------------------------------------------------------------
# Decode state (DESIGN.md "State")

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetState:
    """KV cache of the full-attention layers, conv and recurrent state of the GDN layers, committed length."""

    # [attn_layers, slots, kv_heads, head_dim] in the KV type (dflash_jax/kv_quant.py): an array of a float type, or
    # a block type's KVBlocks (fields [attn_layers, slots, kv_heads, head_dim / 32, count])
    k: jax.Array | kvq.KVBlocks
    v: jax.Array | kvq.KVBlocks
    conv: jax.Array  # [gdn_layers, conv_kernel - 1, conv_dim]: the last pre-conv inputs, oldest first
    ssm: jax.Array  # [gdn_layers, value_heads, key_head_dim, value_head_dim], float32
    length: jax.Array  # [] int32: committed tokens (KV slots 0..length-1 are valid)

    @property
    def slots(self) -> int:
        return self.k.shape[1]


def init_state(cfg: TargetConfig, slots: int, kv_type: str = "f32", v_type: str | None = None) -> TargetState:
    """An empty state with room for `slots` tokens (committed context plus tree slack), its KV cache in `kv_type`
    (a name of dflash_jax.kv_quant.TYPES), the values in `v_type` if given."""
    n_attn, n_gdn = len(cfg.full_attention_layers), len(cfg.linear_attention_layers)
    kv_shape = (n_attn, slots, cfg.num_kv_heads, cfg.head_dim)
    return TargetState(
        k=kvq.empty(kv_type, kv_shape),
        v=kvq.empty(v_type or kv_type, kv_shape),
        conv=jnp.zeros((n_gdn, cfg.conv_kernel - 1, cfg.conv_dim), jnp.float32),
        ssm=jnp.zeros((n_gdn, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                      jnp.float32),
        length=jnp.zeros((), jnp.int32),
    )


# ---------------------------------------------------------------------------------------------------------------
# Blocks of tokens

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Block:
    """How N tokens relate: ancestor-or-self mask and depth below the committed prefix."""

    anc: jax.Array  # [N, N] bool, anc[i, j] = j is i or an ancestor of i
    depth: jax.Array  # [N] int32, 0 for tokens attached to the committed prefix


def tree_block(parents: jax.Array) -> Block:
    """Block of a tree given parent indices in insertion order (parent < child, -1 = attached to the prefix)."""
    n = parents.shape[0]

    def row(i, anc):
        p = parents[i]
        return anc.at[i].set(anc[i] | ((p >= 0) & anc[jnp.maximum(p, 0)]))

    anc = jax.lax.fori_loop(0, n, row, jnp.eye(n, dtype=bool))
    return Block(anc=anc, depth=anc.sum(axis=1).astype(jnp.int32) - 1)


def chain_block(n: int) -> Block:
    """Block of n consecutive tokens."""
    return Block(anc=jnp.tril(jnp.ones((n, n), bool)), depth=jnp.arange(n, dtype=jnp.int32))


def _conv_index(block: Block, kernel: int) -> jax.Array:
    """[N, K] rows of concat(conv_state, block inputs) each token's causal conv reads, lag K-1 first, itself last.

    The input `d` steps back along a token's path is its ancestor at depth - d, or, past the block's start, row
    K-1-(d-depth) of the committed conv state.
    """
    depth = block.depth
    lags = jnp.arange(kernel - 1, -1, -1)  # d = K-1 .. 0
    target = depth[:, None] - lags[None, :]  # [N, K] depth of the input read
    at_depth = block.anc[:, None, :] & (depth[None, None, :] == target[:, :, None])  # [N, K, N]
    node = jnp.argmax(at_depth, axis=-1)
    return jnp.where(target >= 0, kernel - 1 + node, kernel - 1 + target).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------------------------
# Layers

def _attention(p: dict, cfg: TargetConfig, u: jax.Array, k_all: jax.Array, v_all: jax.Array, layer: int,
               length: jax.Array, block: Block, kcfg: KernelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gated full attention over the committed cache plus the block's ancestors; writes the block's KV into
    `layer` of the stacked caches k/v_all [attn_layers, slots, kv_heads, head_dim]."""
    n, hd = u.shape[0], cfg.head_dim
    qg = linear(u, p["wq"], kcfg).reshape(n, cfg.num_heads, 2 * hd)  # per head: [query | gate]
    q, gate = qg[..., :hd], qg[..., hd:].reshape(n, cfg.num_heads * hd)
    k = linear(u, p["wk"], kcfg).reshape(n, cfg.num_kv_heads, hd)
    v = linear(u, p["wv"], kcfg).reshape(n, cfg.num_kv_heads, hd)
    pos = length + block.depth
    q = rope(rms_norm(q, p["q_norm"], cfg.rms_norm_eps), pos, cfg.rope_dim, cfg.rope_theta)
    k = rope(rms_norm(k, p["k_norm"], cfg.rms_norm_eps), pos, cfg.rope_dim, cfg.rope_theta)
    # the block's rows as the cache holds them (cast or quantized): written now, at slots length.., which only a
    # commit moves below `length`
    k, v = kvq.stored(k, k_all), kvq.stored(v, v_all)
    # written before the read (attention sees slots < length only): a read of the old cache still to come would
    # make XLA copy the whole cache to write it
    k_all = write_rows(k_all, k, length, layer)
    v_all = write_rows(v_all, v, length, layer)
    # the block's own keys as the cache holds them once committed: a later token reads them from the cache, and a
    # tree's deeper nodes must see what it would see (the reference dequantizes them, the kernel decodes them as it
    # decodes the cache's tiles)
    o = kernels.tree_attention(q, k_all, v_all, length, k, v, block.anc, jnp.zeros(n, jnp.int32), kcfg, layer)
    o = o.reshape(n, cfg.num_heads * hd)
    return linear(o * jax.nn.sigmoid(gate), p["wo"], kcfg), k_all, v_all


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDNCarry:
    """What a GDN layer's verify leaves for the commit of one path."""

    k: jax.Array  # [N, H, dk]
    v_new: jax.Array  # [N, H, dv]
    gamma: jax.Array  # [N, H]
    conv_in: jax.Array  # [K-1+N, conv_dim]: committed conv state then the block's pre-conv inputs


def _gdn_inputs(p: dict, cfg: TargetConfig, u: jax.Array, conv_state: jax.Array, conv_index: jax.Array,
                kcfg: KernelConfig):
    """Projections, causal conv along each token's path (rows `conv_index`), and the delta-rule inputs."""
    n, nk, nv = u.shape[0], cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv_in = jnp.concatenate([conv_state, linear(u, p["w_qkv"], kcfg)], axis=0)  # [K-1+N, C]
    c = kernels.tree_conv(conv_in, conv_index, p["conv"], kcfg)
    q = c[:, :nk * dk].reshape(n, nk, dk)
    k = c[:, nk * dk:2 * nk * dk].reshape(n, nk, dk)
    v = c[:, 2 * nk * dk:].reshape(n, nv, dv)
    l2 = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)  # noqa: E731
    q = jnp.tile(l2(q) * dk ** -0.5, (1, nv // nk, 1))  # tiled: value head h reads key head h mod nk
    k = jnp.tile(l2(k), (1, nv // nk, 1))
    beta = jax.nn.sigmoid(linear(u, p["w_beta"], kcfg))
    g = p["ssm_a"] * jax.nn.softplus(linear(u, p["w_alpha"], kcfg) + p["dt_bias"])
    z = linear(u, p["w_z"], kcfg).reshape(n, nv, dv)
    return q, k, v, g, beta, z, conv_in


def _gdn_output(p: dict, cfg: TargetConfig, o: jax.Array, z: jax.Array, kcfg: KernelConfig) -> jax.Array:
    n = o.shape[0]
    y = rms_norm(o, p["ssm_norm"], cfg.rms_norm_eps) * jax.nn.silu(z)
    return linear(y.reshape(n, -1), p["w_out"], kcfg)


def embed_tokens(params: dict, tokens: jax.Array) -> jax.Array:
    """Embedding rows [N, H] float32 of token ids (the drafter embeds its block with these too)."""
    embed = params["embed"]
    return dequantize(take_rows(embed, tokens)) if isinstance(embed, QTensor) else embed[tokens]


def output_logits(params: dict, hidden: jax.Array, kcfg: KernelConfig = REFERENCE) -> jax.Array:
    """The lm_head (or tied embedding) applied to already-normed hidden states (shared with the drafter)."""
    return linear(hidden, params["lm_head"], kcfg)


def _logits(params: dict, cfg: TargetConfig, x: jax.Array, kcfg: KernelConfig) -> jax.Array:
    return output_logits(params, rms_norm(x, params["norm"], cfg.rms_norm_eps), kcfg)


def _forward(params: dict, cfg: TargetConfig, state: TargetState, tokens: jax.Array, block: Block,
             taps: tuple[int, ...], prefill_valid: jax.Array | None, kcfg: KernelConfig):
    """All layers over a block. Prefill (chain, `prefill_valid` tokens real) updates GDN state in place;
    verify (tree) leaves it and returns what the commit needs."""
    x = embed_tokens(params, tokens)
    k_all, v_all, conv, ssm = state.k, state.v, state.conv, state.ssm
    tap_out, carries = {}, []
    conv_index = _conv_index(block, cfg.conv_kernel)
    ia = ig = 0
    for i, p in enumerate(params["layers"]):
        u = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
        if cfg.layer_types[i] == FULL_ATTENTION:
            out, k_all, v_all = _attention(p, cfg, u, k_all, v_all, ia, state.length, block, kcfg)
            ia += 1
        else:
            q, k, v, g, beta, z, conv_in = _gdn_inputs(p, cfg, u, conv[ig], conv_index, kcfg)
            if prefill_valid is None:
                o, v_new, gamma = kernels.gdn_tree(q, k, v, g, beta, ssm, block.anc, kcfg, ig)
                carries.append(GDNCarry(k, v_new, gamma, conv_in))
            else:
                real = (jnp.arange(tokens.shape[0]) < prefill_valid)[:, None]
                o, s = kernels.gdn_chunked(q, jnp.where(real[..., None], k, 0.0), v, jnp.where(real, g, 0.0),
                                           jnp.where(real, beta, 0.0), ssm, kcfg, ig)
                ssm = ssm.at[ig].set(s)
                conv = conv.at[ig].set(conv_in[conv_index[prefill_valid - 1, 1:]])
            out = _gdn_output(p, cfg, o, z, kcfg)
            ig += 1
        x = x + out
        x = x + swiglu(rms_norm(x, p["ffn_norm"], cfg.rms_norm_eps), p["w_gate"], p["w_up"], p["w_down"], kcfg)
        if i in taps:
            tap_out[i] = x
    state = dataclasses.replace(state, k=k_all, v=v_all, conv=conv, ssm=ssm)
    # taps come out in the order asked for (the drafter concatenates them in its target_layer_ids order)
    tapped = jnp.stack([tap_out[i] for i in taps], axis=1) if taps else jnp.zeros((tokens.shape[0], 0, cfg.hidden_size))
    return x, tapped, state, Verified(block, conv_index, tuple(carries))


# ---------------------------------------------------------------------------------------------------------------
# Forward modes

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verified:
    """What verify leaves for commit: the block's shape, its conv rows and each GDN layer's carry."""

    block: Block
    conv_index: jax.Array  # [N, K] from _conv_index
    carries: tuple[GDNCarry, ...]


def _check_fits(state: TargetState, tokens: jax.Array) -> None:
    if state.slots < tokens.shape[0]:
        raise ValueError(f"a block of {tokens.shape[0]} tokens does not fit a cache of {state.slots} slots")


def prefill_chunk(params: dict, cfg: TargetConfig, state: TargetState, tokens: jax.Array, n_valid: jax.Array,
                  taps: tuple[int, ...] = (), all_logits: bool = False, kcfg: KernelConfig = REFERENCE
                  ) -> tuple[jax.Array, jax.Array, TargetState]:
    """Commit the first n_valid of P prompt tokens (the rest is padding); `kcfg` picks the kernels
    (dflash_jax.kernels).

    Returns the logits of the last real token [V] (all P rows [P, V] with all_logits) and taps [P, n_taps, H].
    """
    x, tapped, state, _ = _forward(params, cfg, state, tokens, chain_block(tokens.shape[0]), taps, n_valid, kcfg)
    state = dataclasses.replace(state, length=state.length + n_valid)
    if not all_logits:
        x = jax.lax.dynamic_index_in_dim(x, n_valid - 1, keepdims=False)
    return _logits(params, cfg, x, kcfg), tapped, state


def verify(params: dict, cfg: TargetConfig, state: TargetState, tokens: jax.Array, parents: jax.Array,
           taps: tuple[int, ...] = (), kcfg: KernelConfig = REFERENCE
           ) -> tuple[jax.Array, jax.Array, TargetState, Verified]:
    """Run a tree of N tokens on top of the committed state: logits [N, V], taps [N, n_taps, H].

    Only the KV cache changes (the block's keys at slots length..length+N-1, not yet committed); GDN state is read.
    """
    _check_fits(state, tokens)
    block = tree_block(parents)
    x, tapped, state, verified = _forward(params, cfg, state, tokens, block, taps, None, kcfg)
    return _logits(params, cfg, x, kcfg), tapped, state, verified


def path_nodes(block: Block, leaf: jax.Array, width: int) -> jax.Array:
    """[width] index of the node at depth d on the root-to-leaf path (d <= depth of leaf; 0 past it)."""
    at_depth = block.anc[leaf][None, :] & (block.depth[None, :] == jnp.arange(width)[:, None])  # [depth, node]
    return jnp.argmax(at_depth, axis=1)


def commit(state: TargetState, verified: Verified, leaf: jax.Array, kcfg: KernelConfig = REFERENCE,
           skip: jax.Array | bool = False) -> TargetState:
    """Accept the root-to-leaf path ending at node `leaf`: compact its KV, take its GDN state, advance length.

    With `skip` (traced) nothing is accepted: the GDN state, conv state and length stay as they were (the path's
    keys still move within the uncommitted slots, which nothing reads)."""
    block = verified.block
    n = block.depth.shape[0]
    path = block.anc[leaf]  # [N]
    src = state.length + path_nodes(block, leaf, n)  # slot of the path node at each depth

    def compact(cache):  # [layers, slots, ...]: path node at depth d moves to slot length + d (blocks as they are)
        if n == 1:  # already in place; and with a constant leaf the write would not wait for verify's reads of the
            return cache  # cache, so XLA would copy the whole cache to make it
        return write_rows(cache, jax.tree.map(lambda x: jnp.take(x, src, axis=1), cache), state.length)

    kept = verified.conv_index.shape[1] - 1  # conv_in's first rows are the committed conv state
    conv_rows = jnp.where(skip, jnp.arange(kept), verified.conv_index[leaf, 1:])
    carries = verified.carries
    # zero keys and log-decays make the path commit exp(0) S0 + 0 = S0, in every kernel, with no select of the state
    ssm = kernels.gdn_commit(state.ssm, [jnp.where(skip, 0.0, c.k) for c in carries], [c.v_new for c in carries],
                             [jnp.where(skip, 0.0, c.gamma) for c in carries], path, leaf, kcfg)
    conv = [c.conv_in[conv_rows] for c in carries]
    return dataclasses.replace(state, k=compact(state.k), v=compact(state.v), ssm=ssm, conv=jnp.stack(conv),
                               length=state.length + jnp.where(skip, 0, block.depth[leaf] + 1))
