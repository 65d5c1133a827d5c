"""Training a Qwen3.5-architecture target from scratch with the engine's own forward (the reference path):
initialisation in the engine's GGUF conventions, next-token loss over packed sequences, and the tensors to write.

The one reparametrisation: the GDN decay `ssm_a = -exp(a_log)` is trained as `a_log`, so it stays negative. Value
heads need no reordering: a model trained from scratch in the tiled order is simply that model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import TargetConfig
from dflash_jax.gguf import tensor_specs
from dflash_jax.models.target import LAYER_PARAMS, params_from_tensors
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


def to_trainable(params: dict, tied: bool) -> dict:
    """The engine's parameter pytree with each GDN layer's ssm_a as a_log (trained so that ssm_a stays negative),
    and no lm_head leaf when the head is tied to the embedding (the engine's pytree holds it twice)."""
    layers = tuple({**{k: v for k, v in p.items() if k != "ssm_a"}, "a_log": jnp.log(-p["ssm_a"])} if "ssm_a" in p
                   else p for p in params["layers"])
    return {**{k: v for k, v in params.items() if not (tied and k == "lm_head")}, "layers": layers}


def to_engine(params: dict) -> dict:
    """The inverse of to_trainable: the pytree the engine's functions take."""
    layers = tuple({**{k: v for k, v in p.items() if k != "a_log"}, "ssm_a": -jnp.exp(p["a_log"])} if "a_log" in p
                   else p for p in params["layers"])
    return {"lm_head": params["embed"], **params, "layers": layers}


def init_params(cfg: TargetConfig, key: jax.Array) -> dict:
    """Trainable float32 parameters (see init_tensors)."""
    engine = jax.tree.map(jnp.asarray, params_from_tensors(cfg, init_tensors(cfg, key)))
    return to_trainable(engine, cfg.tie_word_embeddings)


def lm_loss(params: dict, cfg: TargetConfig, tokens: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross-entropy of a batch of sequences [batch, S] and the accuracy."""
    logits = jax.vmap(lambda t: sequence_logits(to_engine(params), cfg, t))(tokens)[:, :-1]
    labels = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    loss = -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))
    return loss, {"loss": loss, "acc": jnp.mean(jnp.argmax(logits, axis=-1) == labels)}


def tensors_to_write(params: dict, cfg: TargetConfig) -> dict[str, np.ndarray]:
    """Float32 tensors by GGUF name from trained parameters (for the GGUF writer)."""
    engine = to_engine(params)
    out = {"token_embd.weight": np.asarray(engine["embed"]), "output_norm.weight": np.asarray(engine["norm"])}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = np.asarray(engine["lm_head"])
    for i, p in enumerate(engine["layers"]):
        out.update({f"blk.{i}.{name}": np.asarray(p[short]) for name, short in LAYER_PARAMS.items() if short in p})
    return out


def target_trainer(cfg: TargetConfig, tc: TrainConfig) -> Trainer:
    """The trainer of a target of this config from scratch."""
    return Trainer(lambda params, _, tokens, key: lm_loss(params, cfg, tokens), lambda key: init_params(cfg, key), tc)
