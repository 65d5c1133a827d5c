"""The Qwen3.5/3.6 hybrid target: prefill, tree verify and path commit over the decode state (specs/qwen35_gguf.md §2).

The weights live in Flax NNX modules named as HF's `modeling_qwen3_5` names them (`Target.layers[i].self_attn.q_proj`,
`.linear_attn.in_proj_qkv`, `.mlp.gate_proj`, ...), holding QTensor or kernel-layout matrices and float32 vectors in
GGUF conventions (norms with +1 folded in, `A = ssm_a = -exp(A_log)`, value heads tiled: value head h reads key head
h mod nk). The forward functions below are pure functions of (model, inputs, state): the decode state goes in and
out as arguments, never into a module. A block of N tokens is described by `parents` (-1 = attached to the committed
prefix; a chain is parent = i - 1): tokens sit at RoPE position `length + depth`, their KV at slots
`length + index`, and each sees the committed keys plus its own ancestors (DESIGN.md "One step").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax import kernels
from dflash_jax import kv_quant as kvq
from dflash_jax.config import FULL_ATTENTION, KernelConfig, TargetConfig
from dflash_jax.kernels import REFERENCE
from dflash_jax.models.layers import (MLP, AttentionWeights, Embedding, GatheredLinear, Linear, RMSNorm, products,
                                     rope, weight_at, write_rows)
from dflash_jax.quant import QTensor

# GGUF tensor name inside a block -> the path of its variable in a DecoderLayer (HF's names, modeling_qwen3_5).
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_a": "linear_attn.A", "ssm_dt.bias": "linear_attn.dt_bias", "ssm_conv1d.weight": "linear_attn.conv1d",
    "ssm_norm.weight": "linear_attn.norm.weight", "ssm_out.weight": "linear_attn.out_proj.weight",
}
# GGUF tensor name outside the blocks -> the path of its variable in the Target
GLOBAL_TENSORS = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                  "output.weight": "lm_head.weight"}


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

class GatedAttention(AttentionWeights):
    """Gated full attention (HF's Qwen3_5Attention): q_proj gives each head's query and its output gate."""

    def __call__(self, cfg: TargetConfig, u: jax.Array, k_all: jax.Array, v_all: jax.Array, layer: int,
                 length: jax.Array, block: Block, kcfg: KernelConfig, prefill: bool = False
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Attention over the committed cache plus the block's ancestors (`prefill`: the block is a prompt chunk, a
        chain); writes the block's KV into `layer` of the stacked caches k/v_all [attn_layers, slots, kv_heads,
        head_dim]."""
        n, hd = u.shape[0], cfg.head_dim
        qg, k, v = products(u, (self.q_proj, self.k_proj, self.v_proj), kcfg)
        qg = qg.reshape(n, cfg.num_heads, 2 * hd)  # per head: [query | gate]
        q, gate = qg[..., :hd], qg[..., hd:].reshape(n, cfg.num_heads * hd)
        k, v = k.reshape(n, cfg.num_kv_heads, hd), v.reshape(n, cfg.num_kv_heads, hd)
        pos = length + block.depth
        q = rope(self.q_norm(q), pos, cfg.rope_dim, cfg.rope_theta)
        k = rope(self.k_norm(k), pos, cfg.rope_dim, cfg.rope_theta)
        # the block's rows as the cache holds them (cast or quantized): written now, at slots length.., which only a
        # commit moves below `length`
        k, v = kvq.stored(k, k_all), kvq.stored(v, v_all)
        # written before the read (attention sees slots < length only): a read of the old cache still to come would
        # make XLA copy the whole cache to write it
        k_all = write_rows(k_all, k, length, layer)
        v_all = write_rows(v_all, v, length, layer)
        # the block's own keys as the cache holds them once committed: a later token reads them from the cache, and
        # a tree's deeper nodes must see what it would see (the reference dequantizes them, the kernel decodes them
        # as it decodes the cache's tiles)
        if prefill:
            o = kernels.chunk_attention(q, k_all, v_all, length, k, v, kcfg, layer)
        else:
            o = kernels.tree_attention(q, k_all, v_all, length, k, v, block.anc, jnp.zeros(n, jnp.int32), kcfg, layer)
        o = o.reshape(n, cfg.num_heads * hd)
        return self.o_proj(o * jax.nn.sigmoid(gate), kcfg), k_all, v_all


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDNCarry:
    """What a GDN layer's verify leaves for the commit of one path."""

    k: jax.Array  # [N, H, dk]
    v_new: jax.Array  # [N, H, dv]
    gamma: jax.Array  # [N, H]
    conv_in: jax.Array  # [K-1+N, conv_dim]: committed conv state then the block's pre-conv inputs


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet (HF's Qwen3_5GatedDeltaNet): projections, causal conv and the delta rule's inputs, then the
    gated norm and output projection; the rule itself runs in `_forward` (chunked for a prefill, as a tree else)."""

    def __init__(self, in_proj_qkv: Any, in_proj_z: Any, in_proj_b: Any, in_proj_a: Any, A: jax.Array,
                 dt_bias: jax.Array, conv1d: jax.Array, norm: jax.Array, out_proj: Any, eps: float):
        self.in_proj_qkv, self.in_proj_z = Linear(in_proj_qkv), Linear(in_proj_z)
        self.in_proj_b, self.in_proj_a = Linear(in_proj_b), Linear(in_proj_a)
        self.A = nnx.Param(A)  # [value_heads] = -exp(A_log), GGUF's ssm_a
        self.dt_bias = nnx.Param(dt_bias)  # [value_heads]
        self.conv1d = nnx.Param(conv1d)  # [conv_dim, K]: HF's conv1d.weight [conv_dim, 1, K] squeezed
        self.norm = RMSNorm(norm, eps)  # gated, so without Qwen's +1
        self.out_proj = Linear(out_proj)

    def inputs(self, cfg: TargetConfig, u: jax.Array, conv_state: jax.Array, conv_index: jax.Array,
               kcfg: KernelConfig):
        """Projections, causal conv along each token's path (rows `conv_index`), and the delta-rule inputs."""
        n, nk, nv = u.shape[0], cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qkv, z, b, a = products(u, (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a), kcfg)
        conv_in = jnp.concatenate([conv_state, qkv], axis=0)  # [K-1+N, C]
        c = kernels.tree_conv(conv_in, conv_index, self.conv1d.get_value(), kcfg)
        q = c[:, :nk * dk].reshape(n, nk, dk)
        k = c[:, nk * dk:2 * nk * dk].reshape(n, nk, dk)
        v = c[:, 2 * nk * dk:].reshape(n, nv, dv)
        l2 = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)  # noqa: E731
        q = jnp.tile(l2(q) * dk ** -0.5, (1, nv // nk, 1))  # tiled: value head h reads key head h mod nk
        k = jnp.tile(l2(k), (1, nv // nk, 1))
        beta = jax.nn.sigmoid(b)
        g = self.A.get_value() * jax.nn.softplus(a + self.dt_bias.get_value())
        z = z.reshape(n, nv, dv)
        return q, k, v, g, beta, z, conv_in

    def output(self, o: jax.Array, z: jax.Array, kcfg: KernelConfig) -> jax.Array:
        """The rule's output o [N, H, dv] through the norm gated by silu(z), then the output projection."""
        n = o.shape[0]
        y = self.norm(o) * jax.nn.silu(z)
        return self.out_proj(y.reshape(n, -1), kcfg)


class DecoderLayer(nnx.Module):
    """One block (HF's Qwen3_5DecoderLayer): a pre-normed mixer, `self_attn` (GatedAttention) or `linear_attn`
    (GatedDeltaNet) as `layer_type` says, then a pre-normed MLP, each added to the residual."""

    def __init__(self, layer_type: str, input_layernorm: RMSNorm, mixer: GatedAttention | GatedDeltaNet,
                 post_attention_layernorm: RMSNorm, mlp: MLP):
        self.layer_type = layer_type
        self.input_layernorm = input_layernorm
        if layer_type == FULL_ATTENTION:
            self.self_attn = mixer
        else:
            self.linear_attn = mixer
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp


class Target(nnx.Module):
    """The hybrid target (HF's Qwen3_5ForCausalLM): embedding, decoder layers, final norm and head, with its config
    and the KernelConfig its matrices are laid out for (every engine built on it runs that configuration). A shard of
    a tensor-parallel target (dflash_jax/parallel.py) holds its rows of the head, split over mesh axis `head_axis`."""

    def __init__(self, config: TargetConfig, embed_tokens: Any, layers: list[DecoderLayer], norm: jax.Array,
                 lm_head: Any | None, kcfg: KernelConfig = REFERENCE, head_axis: str | None = None):
        self.config, self.kcfg = config, kcfg
        self.embed_tokens = Embedding(embed_tokens)
        self.layers = nnx.List(layers)
        self.norm = RMSNorm(norm, config.rms_norm_eps)
        # None: tied, the embedding's own variable (trained once); a loaded model's tied head is a copy of the
        # embedding in the kernels' layout (load.prepare_target)
        head = self.embed_tokens.weight if lm_head is None else lm_head
        self.lm_head = Linear(head) if head_axis is None else GatheredLinear(head, head_axis)


def _sub_args(tensors: Mapping[str, Any], prefix: str, sub: str) -> dict[str, Any]:
    """A sub-module's constructor arguments: its weights by attribute name, from tensors by GGUF name."""
    return {path.split(".")[1]: tensors[prefix + name] for name, path in LAYER_TENSORS.items()
            if path.startswith(sub + ".")}


def target_from_tensors(cfg: TargetConfig, tensors: Mapping[str, QTensor | np.ndarray],
                        kcfg: KernelConfig = REFERENCE, head_axis: str | None = None) -> Target:
    """The Target holding tensors by GGUF name as they are (QTensor matrices, float32 vectors; nothing is copied);
    MTP blocks are left out, and without output.weight (tied) the head shares the embedding's variable. `head_axis`:
    a shard's tensors, whose output.weight is its rows of the head (`Target`)."""
    eps, layers = cfg.rms_norm_eps, []
    for i, layer_type in enumerate(cfg.layer_types):
        prefix = f"blk.{i}."
        if layer_type == FULL_ATTENTION:
            mixer = GatedAttention(**_sub_args(tensors, prefix, "self_attn"), eps=eps)
        else:
            mixer = GatedDeltaNet(**_sub_args(tensors, prefix, "linear_attn"), eps=eps)
        layers.append(DecoderLayer(layer_type, RMSNorm(tensors[prefix + "attn_norm.weight"], eps), mixer,
                                   RMSNorm(tensors[prefix + "post_attention_norm.weight"], eps),
                                   MLP(**_sub_args(tensors, prefix, "mlp"))))
    embed = tensors["token_embd.weight"]
    return Target(cfg, embed, layers, tensors["output_norm.weight"], tensors.get("output.weight"), kcfg, head_axis)


def target_tensors(model: Target) -> dict[str, Any]:
    """Every tensor of a Target by GGUF name (the inverse of target_from_tensors; output.weight even where tied)."""
    out = {name: weight_at(model, path) for name, path in GLOBAL_TENSORS.items()}
    for i, layer in enumerate(model.layers):
        out.update({f"blk.{i}.{name}": weight_at(layer, path) for name, path in LAYER_TENSORS.items()
                    if hasattr(layer, path.split(".")[0])})
    return out


def _logits(model: Target, x: jax.Array, kcfg: KernelConfig) -> jax.Array:
    return model.lm_head(model.norm(x), kcfg)


def _all_reduce(x: jax.Array, axis: str | None) -> jax.Array:
    """A shard's partial sum of a row-split projection summed over the mesh axis (as it is without one)."""
    return x if axis is None else jax.lax.psum(x, axis)


def _forward(model: Target, cfg: TargetConfig, state: TargetState, tokens: jax.Array, block: Block,
             taps: tuple[int, ...], prefill_valid: jax.Array | None, kcfg: KernelConfig, axis: str | None = None):
    """All layers over a block. Prefill (chain, `prefill_valid` tokens real) updates GDN state in place;
    verify (tree) leaves it and returns what the commit needs. With `axis`, the model is one shard's of a
    tensor-parallel target (dflash_jax/parallel.py) inside a shard_map: each mixer's and MLP's output is summed over
    the axis."""
    x = model.embed_tokens(tokens)
    k_all, v_all, conv, ssm = state.k, state.v, state.conv, state.ssm
    tap_out, carries = {}, []
    conv_index = _conv_index(block, cfg.conv_kernel)
    ia = ig = 0
    for i, layer in enumerate(model.layers):
        u = layer.input_layernorm(x)
        if cfg.layer_types[i] == FULL_ATTENTION:
            out, k_all, v_all = layer.self_attn(cfg, u, k_all, v_all, ia, state.length, block, kcfg,
                                                prefill_valid is not None)
            ia += 1
        else:
            q, k, v, g, beta, z, conv_in = layer.linear_attn.inputs(cfg, u, conv[ig], conv_index, kcfg)
            if prefill_valid is None:
                o, v_new, gamma = kernels.gdn_tree(q, k, v, g, beta, ssm, block.anc, kcfg, ig)
                carries.append(GDNCarry(k, v_new, gamma, conv_in))
            else:
                real = (jnp.arange(tokens.shape[0]) < prefill_valid)[:, None]
                o, ssm = kernels.gdn_chunked(q, jnp.where(real[..., None], k, 0.0), v, jnp.where(real, g, 0.0),
                                             jnp.where(real, beta, 0.0), ssm, kcfg, ig)
                conv = conv.at[ig].set(conv_in[conv_index[prefill_valid - 1, 1:]])
            out = layer.linear_attn.output(o, z, kcfg)
            ig += 1
        x = x + _all_reduce(out, axis)
        x = x + _all_reduce(layer.mlp(layer.post_attention_layernorm(x), kcfg), axis)
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


def prefill_chunk(model: Target, cfg: TargetConfig, state: TargetState, tokens: jax.Array, n_valid: jax.Array,
                  taps: tuple[int, ...] = (), all_logits: bool = False, kcfg: KernelConfig = REFERENCE,
                  axis: str | None = None) -> tuple[jax.Array, jax.Array, TargetState]:
    """Commit the first n_valid of P prompt tokens (the rest is padding); `kcfg` picks the kernels
    (dflash_jax.kernels), `axis` the mesh axis of a shard's model (`_forward`).

    Returns the logits of the last real token [V] (all P rows [P, V] with all_logits) and taps [P, n_taps, H].
    """
    x, tapped, state, _ = _forward(model, cfg, state, tokens, chain_block(tokens.shape[0]), taps, n_valid, kcfg,
                                   axis)
    state = dataclasses.replace(state, length=state.length + n_valid)
    if not all_logits:
        x = jax.lax.dynamic_index_in_dim(x, n_valid - 1, keepdims=False)
    return _logits(model, x, kcfg), tapped, state


def verify(model: Target, cfg: TargetConfig, state: TargetState, tokens: jax.Array, parents: jax.Array,
           taps: tuple[int, ...] = (), kcfg: KernelConfig = REFERENCE, axis: str | None = None
           ) -> tuple[jax.Array, jax.Array, TargetState, Verified]:
    """Run a tree of N tokens on top of the committed state: logits [N, V], taps [N, n_taps, H] (`axis`: the mesh
    axis of a shard's model, `_forward`).

    Only the KV cache changes (the block's keys at slots length..length+N-1, not yet committed); GDN state is read.
    """
    _check_fits(state, tokens)
    block = tree_block(parents)
    x, tapped, state, verified = _forward(model, cfg, state, tokens, block, taps, None, kcfg, axis)
    return _logits(model, x, kcfg), tapped, state, verified


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
