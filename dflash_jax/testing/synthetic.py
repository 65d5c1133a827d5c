"""Full-size synthetic models generated on the device: a target with a config's exact tensor shapes and the stock
Q4_K_M type mix, and a bf16 DFlash drafter, from random values (no file needed). For benchmarks (scripts/bench.py).

Quantized fields are random bits with float scales sized so that every dequantized matrix has entries of about
1/sqrt(in) (as a trained model's do), norms sit near 1, `ssm_a` < 0: activations stay finite through all layers.
Each matrix is laid out for the KernelConfig as soon as it is made, so at most one matrix exists twice at a time.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Iterator

import jax
import jax.numpy as jnp

from dflash_jax.config import (SINGLE_DEVICE, DraftConfig, KernelConfig, ParallelConfig, TargetConfig,
                               load_draft_config, load_target_config)
from dflash_jax.gguf import tensor_specs
from dflash_jax.kernels import REFERENCE, prepare_matrices, prepare_matrix
from dflash_jax.load import prepare_target
from dflash_jax.models.draft import Draft, draft_from_tensors
from dflash_jax.models.draft import tensor_shapes as draft_tensor_shapes
from dflash_jax.models.target import Target, target_from_tensors
from dflash_jax.parallel import ShardedTarget
from dflash_jax.quant import QTensor, dequantize
from dflash_jax.testing.gguf_writer import q4_k_m_rule
from dflash_jax.testing.random_weights import random_normal, random_qtensor, random_uniform
from dflash_jax.testing.tiny import CONFIG_DIR

TARGET_27B = os.path.join(CONFIG_DIR, "qwen3.5-27b.json")
DRAFT_27B = os.path.join(CONFIG_DIR, "qwen3.5-27b-dflash.json")


@jax.jit
def _dequantized_std(qt: QTensor) -> jax.Array:
    return jnp.std(dequantize(qt))


def _unit_std(fmt: str, k: int) -> float:
    """Std of a dequantized random_qtensor with unit-scale float fields (a 256-row sample)."""
    return float(_dequantized_std(random_qtensor(jax.random.key(12345), fmt, (256, k), scale=1.0)))


def random_matrix(key: jax.Array, fmt: str, shape: tuple[int, int], std_cache: dict | None = None) -> QTensor:
    """A random [out, in] QTensor in `fmt` whose dequantized entries have a std of about 1/sqrt(in)."""
    cache = {} if std_cache is None else std_cache
    if (fmt, shape[1]) not in cache:
        cache[fmt, shape[1]] = _unit_std(fmt, shape[1])
    return random_qtensor(key, fmt, shape, scale=1.0 / (math.sqrt(shape[1]) * cache[fmt, shape[1]]))


def _dense(key: jax.Array, name: str, shape: tuple[int, ...]) -> jax.Array:
    if name.endswith("ssm_a"):
        return -jnp.exp(random_uniform(key, shape, -1.0, 1.5))
    if name.endswith("norm.weight"):
        return random_normal(key, shape, 1.0, 0.1)
    return random_normal(key, shape, 0.0, 0.5)  # conv kernel, dt bias


def synthetic_tensors(cfg: TargetConfig, seed: int = 0) -> Iterator[tuple[str, QTensor | jax.Array]]:
    """The tensors of a random target with cfg's shapes and the stock Q4_K_M types (MTP blocks left out), by GGUF
    name, as a GGUF stores them (QTensor matrices, float32 vectors), each made on the device when asked for."""
    rule, cache = q4_k_m_rule(cfg), {}
    key = jax.random.key(seed)
    for i, (name, spec) in enumerate(tensor_specs(cfg).items()):
        if spec.optional or (name.startswith("blk.") and int(name.split(".")[1]) >= cfg.num_layers):
            continue
        sub = jax.random.fold_in(key, i)
        if spec.kind == "dense":
            yield name, _dense(sub, name, spec.shape)
        else:
            yield name, random_matrix(sub, rule(name, spec).name, spec.shape, cache)


def synthetic_target(cfg: TargetConfig, *, kcfg: KernelConfig = REFERENCE, seed: int = 0,
                     on_tensor: Callable[[str, int], None] | None = None) -> Target:
    """A random target of `synthetic_tensors`, ready for the engine.

    on_tensor(name, stored bytes) is called after each tensor (progress). Returns a `Target` module as load_target
    does, built from these arrays (none is copied).
    """
    tensors = {}
    for name, x in synthetic_tensors(cfg, seed):
        nbytes = x.nbytes  # as stored in a GGUF, before any repacking
        if name != "token_embd.weight":  # read by row; stays a QTensor as load_target leaves it
            x = prepare_matrix(x, kcfg)  # dense vectors pass through
        tensors[name] = jax.block_until_ready(x)
        if on_tensor:
            on_tensor(name, nbytes)
    # reference: dequantized when small enough
    return target_from_tensors(cfg, prepare_target(tensors, kcfg), kcfg)


def synthetic_sharded(cfg: TargetConfig, kcfg: KernelConfig, pcfg: ParallelConfig, *, seed: int = 0,
                      on_tensor: Callable[[str, int], None] | None = None) -> ShardedTarget:
    """`synthetic_target`'s target made straight into its shards over pcfg's devices, as `parallel.load_sharded`
    loads a file: each tensor made on the default device, copied to the host, and its slices put on their devices
    and laid out for `kcfg` there, so no device ever holds the whole target."""
    def stream():
        for name, x in synthetic_tensors(cfg, seed):
            host = jax.device_get(x)
            del x  # off the device before the next tensor is made
            if on_tensor:
                on_tensor(name, host.nbytes)
            yield name, host

    return ShardedTarget.from_tensors(cfg, stream(), kcfg, pcfg)


def synthetic_draft(cfg: DraftConfig, *, kcfg: KernelConfig = REFERENCE, seed: int = 1) -> Draft:
    """A random DFlash drafter with cfg's shapes, matrices in bf16 (as z-lab ships them), norms near 1."""
    key = jax.random.key(seed)
    tensors = {}
    for i, (name, shape) in enumerate(draft_tensor_shapes(cfg).items()):
        sub = jax.random.fold_in(key, i)
        if len(shape) == 1:
            tensors[name] = random_normal(sub, shape, 1.0, 0.1)
        else:
            w = random_normal(sub, shape, 0.0, 1.0 / math.sqrt(shape[1]))
            tensors[name] = QTensor({"w": w.astype(jnp.bfloat16)}, "BF16", shape)
    return draft_from_tensors(cfg, prepare_matrices(tensors, kcfg), kcfg)


def synthetic_27b(kcfg: KernelConfig, seed: int = 0, on_tensor=None, parallel: ParallelConfig = SINGLE_DEVICE
                  ) -> tuple[Target | ShardedTarget, Draft]:
    """The Qwen3.5-27B Q4_K_M target and its 1.73B bf16 DFlash drafter, synthetic (configs/qwen3.5-27b*.json), laid
    out for `kcfg` as load_target and load_draft lay out a real pair (the target straight into its shards over
    `parallel`'s devices where there are several, as parallel.load_split loads one)."""
    cfg = load_target_config(TARGET_27B)
    if parallel.devices > 1:
        target = synthetic_sharded(cfg, kcfg, parallel, seed=seed, on_tensor=on_tensor)
    else:
        target = synthetic_target(cfg, kcfg=kcfg, seed=seed, on_tensor=on_tensor)
    return target, synthetic_draft(load_draft_config(DRAFT_27B), kcfg=kcfg, seed=seed + 1)
