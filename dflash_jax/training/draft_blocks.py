"""The DFlash training objective (specs/dflash_training.md §2-3): many [anchor, MASK x (B-1)] blocks of one sequence
in one pass, each seeing the target's features strictly before its anchor, and the decayed cross-entropy.

`block_logits` computes, for every anchor at once, what `models.draft.propose` computes at inference for a block
rooted at that anchor after the context before it was committed (tests/test_train_draft.py checks this)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.config import SLIDING_ATTENTION, DraftConfig
from dflash_jax.kernels import REFERENCE
from dflash_jax.models.draft import Draft
from dflash_jax.models.layers import Linear, rope
from dflash_jax.models.target import Target

NEG = -1e30  # a finite mask value: a row that sees nothing would be NaN with -inf (not that any row here can)


def _dense(x: jax.Array, linear: Linear, dtype: jnp.dtype) -> jax.Array:
    """x @ weight.T of a Linear (float weights) in the compute dtype, accumulated in float32."""
    w = linear.weight.get_value()
    return jnp.einsum("...i,oi->...o", x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)


def sample_anchors(key: jax.Array, weights: jax.Array, n: int, block: int) -> tuple[jax.Array, jax.Array]:
    """n sorted anchors drawn without replacement from positions 1..S-block whose block would hold supervised
    tokens (weights [S]: 1 for tokens to learn); keep [n] is False for draws beyond the candidates there are."""
    s = weights.shape[0]
    pos = jnp.arange(s)
    ok = (pos >= 1) & (pos <= s - block) & (weights > 0)
    # Gumbel top-n: uniform sampling without replacement among the candidates, a static number of draws
    scores = jnp.where(ok, jax.random.gumbel(key, (s,)), -jnp.inf)
    _, idx = jax.lax.top_k(scores, n)
    keep = jnp.isfinite(scores[idx])
    order = jnp.argsort(jnp.where(keep, idx, s + idx))  # sorted anchors first, padding after
    return jnp.where(keep, idx, 1)[order].astype(jnp.int32), keep[order]


def block_logits(params: Draft, cfg: DraftConfig, target: Target, taps: jax.Array, tokens: jax.Array,
                 anchors: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Logits [N, B, V] of the blocks rooted at anchors [N] of one sequence (tokens [S], taps [S, n_taps, H])."""
    s, (n, b) = tokens.shape[0], (anchors.shape[0], cfg.block_size)
    hd, kvh, groups = cfg.head_dim, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    fused = params.hidden_norm(_dense(taps.reshape(s, -1), params.fc, dtype))
    ctx_pos = jnp.arange(s)
    pos = anchors[:, None] + jnp.arange(b)[None, :]  # [N, B]
    block_ids = jnp.full((n, b), cfg.mask_token_id, jnp.int32).at[:, 0].set(tokens[anchors])
    x = target.embed_tokens(block_ids.reshape(-1)).reshape(n, b, -1)
    slot = jnp.arange(b)
    for layer, p in enumerate(params.layers):
        a = p.self_attn
        sliding = cfg.layer_types[layer] == SLIDING_ATTENTION
        ctx_seen = ctx_pos[None, None, :] < anchors[:, None, None]  # [N, 1, S]: strictly before the anchor
        blk_seen = jnp.ones((b, b), bool)
        if sliding:
            w = cfg.sliding_window
            ctx_seen = ctx_seen & (ctx_pos[None, None, :] > pos[:, :, None] - w)
            blk_seen = (slot[None, :] <= slot[:, None]) & (slot[None, :] > slot[:, None] - w)
        k_ctx = rope(a.k_norm(_dense(fused, a.k_proj, dtype).reshape(s, kvh, hd)), ctx_pos, hd, cfg.rope_theta)
        v_ctx = _dense(fused, a.v_proj, dtype).reshape(s, kvh, hd)
        u = p.input_layernorm(x).reshape(n * b, -1)
        flat_pos = pos.reshape(-1)
        q = rope(a.q_norm(_dense(u, a.q_proj, dtype).reshape(n * b, cfg.num_heads, hd)), flat_pos, hd,
                 cfg.rope_theta).reshape(n, b, kvh, groups, hd)
        k_blk = rope(a.k_norm(_dense(u, a.k_proj, dtype).reshape(n * b, kvh, hd)), flat_pos, hd,
                     cfg.rope_theta).reshape(n, b, kvh, hd)
        v_blk = _dense(u, a.v_proj, dtype).reshape(n, b, kvh, hd)
        scale = 1.0 / jnp.sqrt(jnp.float32(hd))
        s_ctx = jnp.einsum("nbkgd,skd->nbkgs", q.astype(dtype), k_ctx.astype(dtype),
                           preferred_element_type=jnp.float32) * scale
        s_blk = jnp.einsum("nbkgd,nckd->nbkgc", q.astype(dtype), k_blk.astype(dtype),
                           preferred_element_type=jnp.float32) * scale
        s_ctx = jnp.where(jnp.broadcast_to(ctx_seen, (n, b, s))[:, :, None, None, :], s_ctx, NEG)
        s_blk = jnp.where(blk_seen[None, :, None, None, :], s_blk, NEG)
        probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1)
        o = (jnp.einsum("nbkgs,skd->nbkgd", probs[..., :s].astype(dtype), v_ctx.astype(dtype),
                        preferred_element_type=jnp.float32)
             + jnp.einsum("nbkgc,nckd->nbkgd", probs[..., s:].astype(dtype), v_blk.astype(dtype),
                          preferred_element_type=jnp.float32))
        x = x + _dense(o.reshape(n, b, -1), a.o_proj, dtype)
        h, mlp = p.post_attention_layernorm(x), p.mlp
        x = x + _dense(jax.nn.silu(_dense(h, mlp.gate_proj, dtype)) * _dense(h, mlp.up_proj, dtype), mlp.down_proj,
                       dtype)
    return target.lm_head(params.norm(x), REFERENCE)


def slot_weights(block: int, gamma: float) -> jax.Array:
    """w_k = exp(-(k-1)/gamma) for the predicted slots k >= 1; the anchor slot k = 0 is not supervised."""
    k = jnp.arange(block, dtype=jnp.float32)
    return jnp.where(k >= 1, jnp.exp(-(k - 1) / gamma), 0.0)


def block_labels(tokens: jax.Array, greedy: jax.Array, anchors: jax.Array, block: int, source: str) -> jax.Array:
    """The token slot k of the block at anchor a learns: the target's greedy token for position a + k (its argmax
    after a + k - 1), or the data's own token there. Same-position labels: slot k never predicts a + k + 1."""
    at = anchors[:, None] + jnp.arange(block)[None, :]
    if source == "greedy":
        return greedy[jnp.maximum(at - 1, 0)]
    if source == "data":
        return tokens[at]
    raise ValueError(f"labels must be 'greedy' or 'data', got {source!r}")


def block_loss(logits: jax.Array, labels: jax.Array, keep: jax.Array, weights: jax.Array,
               slot_w: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The decayed cross-entropy over supervised slots, normalised by the summed weights, and metrics.

    logits [..., N, B, V]; labels [..., N, B]; keep [..., N]; weights [..., N, B] (1 where the label's position is to
    be learned). Metrics: `acc1`, the first predicted slot's accuracy, and `accept`, the teacher-forced accepted
    length (matching slots from 1 until the first miss, plus the bonus token), a proxy for acceptance length."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ce = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    w = slot_w * weights * keep[..., None]
    loss = jnp.sum(w * ce) / jnp.maximum(jnp.sum(w), 1e-9)
    correct = (jnp.argmax(logits, axis=-1) == labels) & (weights > 0)
    blocks = jnp.maximum(jnp.sum(keep), 1)
    prefix = jnp.sum(jnp.cumprod(correct[..., 1:], axis=-1), axis=-1) + 1.0
    return loss, {"loss": loss, "acc1": jnp.sum(correct[..., 1] * keep) / blocks,
                  "accept": jnp.sum(prefix * keep) / blocks}
