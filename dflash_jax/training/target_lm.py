"""Training a Qwen3.5-architecture target from scratch with the engine's own forward (the reference path):
initialisation in the engine's GGUF conventions, next-token loss over packed sequences, and the tensors to write.

The trained params are the `nnx.Param` state of a Target (`nnx.state`, what a checkpoint holds), with one
reparametrisation: each GDN layer's `A = ssm_a = -exp(A_log)` holds A_log there, so that A stays negative. A tied
head shares the embedding's variable, so the state holds it once. Value heads need no reordering: a model trained
from scratch in the tiled order is simply that model."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.config import TargetConfig
from dflash_jax.gguf import tensor_specs
from dflash_jax.models.target import Target, target_from_tensors, target_tensors
from dflash_jax.testing.tiny import tiny_target_config
from dflash_jax.training.features import sequence_logits
from dflash_jax.training.loop import Trainer, TrainConfig


def code_target_config(hidden: int, layers: int, vocab: int, ffn: int, tie: bool = False) -> TargetConfig:
    """A small Qwen3.5 hybrid (every 4th layer attention) with 64-wide heads: hidden/64 query heads, a quarter as
    many KV heads, half as many GDN key heads as value heads; partial RoPE over 16 dims, 4096 positions."""
    heads = hidden // 64
    return tiny_target_config(num_layers=layers, interval=4, vocab_size=vocab, hidden_size=hidden,
                              intermediate_size=ffn, num_heads=heads, num_kv_heads=max(1, heads // 4), head_dim=64,
                              rope_dim=16, linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads,
                              linear_key_head_dim=64, linear_value_head_dim=64, tie_word_embeddings=tie,
                              max_position_embeddings=4096)


def init_tensors(cfg: TargetConfig, key: jax.Array, std: float = 0.02) -> dict[str, np.ndarray]:
    """Float32 tensors by GGUF name as Qwen3.5 starts training: normal(0, std) matrices (output projections scaled
    by 1/sqrt(2L)), norms at one (the +1 of Qwen's norms folded in), A in [1, 16], dt in [1e-3, 0.1]."""
    out = {}
    for i, (name, spec) in enumerate(tensor_specs(cfg).items()):
        if spec.optional:
            continue
        k = jax.random.fold_in(key, i)
        if name.endswith("ssm_a"):
            x = -jax.random.uniform(k, spec.shape, minval=1.0, maxval=16.0)
        elif name.endswith("ssm_dt.bias"):
            dt = jnp.exp(jax.random.uniform(k, spec.shape, minval=np.log(1e-3), maxval=np.log(0.1)))
            x = dt + jnp.log(-jnp.expm1(-dt))  # the inverse of softplus
        elif name.endswith("norm.weight"):
            x = jnp.ones(spec.shape)
        elif name.endswith("ssm_conv1d.weight"):
            x = jax.random.normal(k, spec.shape) / np.sqrt(spec.shape[-1])
        else:
            scale = std / np.sqrt(2 * cfg.num_layers) if name.endswith(("ffn_down.weight", "attn_output.weight",
                                                                         "ssm_out.weight")) else std
            x = scale * jax.random.normal(k, spec.shape)
        out[name] = np.asarray(x, np.float32)
    return out


def _is_a(path: tuple) -> bool:
    """Whether a state path is a GDN layer's A (its variable's value under the key "A")."""
    return any(getattr(k, "key", None) == "A" for k in path[-2:])


def to_trainable(state: nnx.State) -> nnx.State:
    """A Target's Param state with each GDN layer's A as A_log = log(-A) (trained so that A stays negative)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: jnp.log(-x) if _is_a(p) else x, state)


@functools.lru_cache(maxsize=None)
def _graph(cfg: TargetConfig) -> nnx.GraphDef:
    """The graph of a Target of this config (from shapes alone), its head tied where the config says."""
    specs = {name: jax.ShapeDtypeStruct(spec.shape, jnp.float32) for name, spec in tensor_specs(cfg).items()
             if not spec.optional}
    return nnx.graphdef(target_from_tensors(cfg, specs))


def to_engine(params: nnx.State, cfg: TargetConfig) -> Target:
    """The inverse of to_trainable, as the Target the engine's functions take."""
    engine = jax.tree_util.tree_map_with_path(lambda p, x: -jnp.exp(x) if _is_a(p) else x, params)
    return nnx.merge(_graph(cfg), engine)


def init_params(cfg: TargetConfig, key: jax.Array) -> nnx.State:
    """Trainable float32 parameters (see init_tensors)."""
    model = target_from_tensors(cfg, {name: jnp.asarray(x) for name, x in init_tensors(cfg, key).items()})
    return to_trainable(nnx.state(model, nnx.Param))


def lm_loss(params: nnx.State, cfg: TargetConfig, tokens: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross-entropy of a batch of sequences [batch, S] and the accuracy."""
    model = to_engine(params, cfg)
    logits = jax.vmap(lambda t: sequence_logits(model, cfg, t))(tokens)[:, :-1]
    labels = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    loss = -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))
    return loss, {"loss": loss, "acc": jnp.mean(jnp.argmax(logits, axis=-1) == labels)}


def tensors_to_write(params: nnx.State, cfg: TargetConfig) -> dict[str, np.ndarray]:
    """Float32 tensors by GGUF name from trained parameters (for the GGUF writer)."""
    tensors = target_tensors(to_engine(params, cfg))
    return {name: np.asarray(x) for name, x in tensors.items()
            if not (cfg.tie_word_embeddings and name == "output.weight")}


def target_trainer(cfg: TargetConfig, tc: TrainConfig) -> Trainer:
    """The trainer of a target of this config from scratch."""
    return Trainer(lambda params, _, tokens, key: lm_loss(params, cfg, tokens), lambda key: init_params(cfg, key), tc)
