"""Training a DFlash drafter against a frozen target (specs/dflash_training.md §7): its shape, initialisation and
batch loss (the target's features computed online, anchors re-drawn every step, matmuls in the compute dtype) for
the shared loop in `training.loop`.

The drafter and the target sit in one module, `DraftTraining`, split once by the filter TRAINABLE: the drafter's
`nnx.Param` state is what the loop differentiates and optax updates (and what a checkpoint holds); the rest, the
target with the embedding and head the drafter borrows, is passed to every step as frozen state."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.config import DraftConfig, TargetConfig, default_target_layer_ids
from dflash_jax.models import draft as draft_model
from dflash_jax.models.draft import Draft
from dflash_jax.models.target import Target
from dflash_jax.training.draft_blocks import block_labels, block_logits, block_loss, sample_anchors, slot_weights
from dflash_jax.training.features import target_features
from dflash_jax.training.loop import Trainer, TrainConfig


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """The drafter's objective: blocks per sequence, slot weights, labels, matmul precision."""

    anchors: int = 32  # blocks per sequence, re-drawn every step
    gamma: float = 7.0  # slot-weight decay exp(-(k-1)/gamma); the paper's 7 is for blocks of 16
    labels: str = "greedy"  # the target's greedy tokens, or "data"
    dtype: str = "bfloat16"  # matmul inputs; weights, optimizer state and softmax stay float32


def draft_config_for(target: TargetConfig, mask_token_id: int, layers: int = 5, block_size: int = 16,
                     taps: int = 5) -> DraftConfig:
    """A drafter shaped like z-lab's for this target: its hidden size, attention heads and FFN width, `taps` tap
    layers spread from layer 1 to L-3, full attention."""
    return DraftConfig(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_layers=layers, layer_types=("full_attention",) * layers, num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads, head_dim=target.head_dim, rope_theta=target.rope_theta,
        rms_norm_eps=target.rms_norm_eps, sliding_window=None, block_size=block_size, mask_token_id=mask_token_id,
        target_layer_ids=default_target_layer_ids(target.num_layers, min(taps, target.num_layers)),
        num_target_layers=target.num_layers, max_position_embeddings=target.max_position_embeddings)


def init_draft(cfg: DraftConfig, key: jax.Array) -> Draft:
    """A drafter of random float32 weights as the public trainers start: normal(0, 0.02) matrices, norms at one."""
    tensors = {}
    for i, (name, shape) in enumerate(sorted(draft_model.tensor_shapes(cfg).items())):
        tensors[name] = (jnp.ones(shape, jnp.float32) if len(shape) == 1 else
                         0.02 * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32))
    return draft_model.draft_from_tensors(cfg, tensors)


class DraftTraining(nnx.Module):
    """A drafter in training beside the target it drafts for (whose features, embedding and head it uses)."""

    def __init__(self, draft: Draft, target: Target):
        self.draft, self.target = draft, target


TRAINABLE = nnx.All(nnx.Param, nnx.PathContains("draft"))  # the target, its embedding and head stay frozen


def trained_draft(cfg: DraftConfig, params: nnx.State) -> Draft:
    """The Draft holding trained params (the TRAINABLE state of a DraftTraining)."""
    return nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: init_draft(cfg, jax.random.key(0)))), params["draft"])


def batch_loss(params: nnx.State, frozen: nnx.State, tokens: jax.Array, key: jax.Array, *, graph: nnx.GraphDef,
               cfg: DraftConfig, tcfg: TargetConfig, bc: BlockConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss of a batch of sequences [batch, S]: features from the frozen target, anchors from key."""
    pair = nnx.merge(graph, params, frozen)
    draft, tparams = pair.draft, pair.target
    taps, greedy = jax.vmap(lambda t: target_features(tparams, tcfg, t, cfg.target_layer_ids))(tokens)
    taps, greedy = jax.lax.stop_gradient(taps), jax.lax.stop_gradient(greedy)
    weights = jnp.ones(tokens.shape[1:], jnp.float32)  # every position is learned (plain text: no prompt to skip)
    keys = jax.random.split(key, tokens.shape[0])
    anchors, keep = jax.vmap(lambda k: sample_anchors(k, weights, bc.anchors, cfg.block_size))(keys)
    dtype = jnp.dtype(bc.dtype)
    logits = jax.vmap(lambda tp, t, a: block_logits(draft, cfg, tparams, tp, t, a, dtype))(taps, tokens, anchors)
    labels = jax.vmap(lambda t, g, a: block_labels(t, g, a, cfg.block_size, bc.labels))(tokens, greedy, anchors)
    return block_loss(logits, labels, keep, jnp.ones(labels.shape), slot_weights(cfg.block_size, bc.gamma))


def draft_trainer(cfg: DraftConfig, target: Target, tc: TrainConfig, bc: BlockConfig = BlockConfig()) -> Trainer:
    """The trainer of a drafter for this frozen target: its params are the TRAINABLE state (`trained_draft` makes
    them a Draft)."""
    # the graph from a drafter of shapes only: nothing is initialised twice
    graph, _, frozen = nnx.split(DraftTraining(nnx.eval_shape(lambda: init_draft(cfg, jax.random.key(0))), target),
                                 TRAINABLE, ...)

    def init(key: jax.Array) -> nnx.State:
        return nnx.state(DraftTraining(init_draft(cfg, key), target), TRAINABLE)

    return Trainer(functools.partial(batch_loss, graph=graph, cfg=cfg, tcfg=target.config, bc=bc), init, tc,
                   frozen=frozen)
