"""Decode state of the target: fixed-shape caches donated through every step (DESIGN.md "State")."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dflash_jax.config import TargetConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetState:
    """KV cache of the full-attention layers, conv and recurrent state of the GDN layers, committed length."""

    k: jax.Array  # [attn_layers, slots, kv_heads, head_dim]
    v: jax.Array  # [attn_layers, slots, kv_heads, head_dim]
    conv: jax.Array  # [gdn_layers, conv_kernel - 1, conv_dim]: the last pre-conv inputs, oldest first
    ssm: jax.Array  # [gdn_layers, value_heads, key_head_dim, value_head_dim], float32
    length: jax.Array  # [] int32: committed tokens (KV slots 0..length-1 are valid)

    @property
    def slots(self) -> int:
        return self.k.shape[1]


def init_state(cfg: TargetConfig, slots: int, kv_dtype: jnp.dtype = jnp.float32) -> TargetState:
    """An empty state with room for `slots` tokens (committed context plus tree slack)."""
    n_attn, n_gdn = len(cfg.full_attention_layers), len(cfg.linear_attention_layers)
    kv_shape = (n_attn, slots, cfg.num_kv_heads, cfg.head_dim)
    return TargetState(
        k=jnp.zeros(kv_shape, kv_dtype),
        v=jnp.zeros(kv_shape, kv_dtype),
        conv=jnp.zeros((n_gdn, cfg.conv_kernel - 1, cfg.conv_dim), jnp.float32),
        ssm=jnp.zeros((n_gdn, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                      jnp.float32),
        length=jnp.zeros((), jnp.int32),
    )
