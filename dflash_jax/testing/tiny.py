"""Tiny Qwen3.5 targets for tests: the 27B config shrunk, and seeded random HF weights (via transformers)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from dflash_jax.config import (FULL_ATTENTION, LINEAR_ATTENTION, DraftConfig, TargetConfig, default_target_layer_ids,
                               load_target_config, target_config_to_hf)
from dflash_jax.defaults import host_memory
from dflash_jax.errors import InputError, run_main
from dflash_jax.gguf import tensor_specs
from dflash_jax.models.draft import Draft, draft_from_tensors, tensor_shapes
from dflash_jax.models.target import Target, target_from_tensors
from dflash_jax.testing.gguf_writer import write_gguf

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


def tiny_target_config(num_layers: int = 4, interval: int = 4, **overrides: Any) -> TargetConfig:
    """The Qwen3.5-27B config shrunk: same layer pattern and head ratios, tiny widths (overrides win)."""
    big = load_target_config(os.path.join(CONFIG_DIR, "qwen3.5-27b.json"))
    layer_types = tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))
    small = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=num_layers,
                 layer_types=layer_types, num_heads=4, num_kv_heads=2, head_dim=64, rope_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=32,
                 linear_value_head_dim=32, max_position_embeddings=4096, num_mtp_layers=0)
    return dataclasses.replace(big, **{**small, **overrides})


def _hf_model(cfg: TargetConfig):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hf_cfg = target_config_to_hf(cfg)
    hf_cfg.pop("model_type"), hf_cfg.pop("architectures")
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**hf_cfg))


def random_hf_state_dict(cfg: TargetConfig, seed: int = 0, mtp: bool = False) -> dict[str, np.ndarray]:
    """Seeded random float32 weights of a transformers Qwen3_5ForCausalLM with this config.

    Norm weights, A_log and dt_bias are randomised too (HF initialises them to constants, which would hide
    layout mistakes). With mtp, random `mtp.*` tensors of one MTP block are added (HF's model has no such module).
    """
    import torch

    torch.manual_seed(seed)
    model = _hf_model(cfg)
    rng = np.random.default_rng(seed)
    out = {}
    for name, p in model.state_dict().items():
        x = p.detach().float().numpy().copy()
        if name.endswith("norm.weight"):
            x = x + rng.normal(0.0, 0.2, x.shape)  # zero-centred weights (+1 in GGUF), ones for the gated norm
        elif name.endswith("A_log"):
            x = rng.uniform(-1.0, 1.5, x.shape)
        elif name.endswith("dt_bias"):
            x = rng.normal(0.0, 1.0, x.shape)
        out[name] = x.astype(np.float32)
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    if mtp:
        prefix = f"model.layers.{cfg.full_attention_layers[0]}."
        layer = {k[len(prefix):]: v for k, v in out.items() if k.startswith(prefix)}
        h = cfg.hidden_size
        out.update({f"mtp.layers.0.{k}": rng.normal(0.0, 0.02, v.shape).astype(np.float32) for k, v in layer.items()})
        out.update({
            "mtp.fc.weight": rng.normal(0.0, 0.02, (h, 2 * h)).astype(np.float32),
            "mtp.pre_fc_norm_embedding.weight": rng.normal(0.0, 0.2, h).astype(np.float32),
            "mtp.pre_fc_norm_hidden.weight": rng.normal(0.0, 0.2, h).astype(np.float32),
            "mtp.norm.weight": rng.normal(0.0, 0.2, h).astype(np.float32),
        })
    return out


def hf_reference_model(cfg: TargetConfig, state_dict: dict[str, np.ndarray]):
    """The transformers `Qwen3_5ForCausalLM` (float32, eval mode) holding these HF weights: the reference."""
    import torch

    model = _hf_model(cfg).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()},
                                                strict=False)
    if unexpected or [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]:
        raise ValueError(f"state dict does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def write_hf_dir(path: str | os.PathLike, cfg: TargetConfig, state_dict: dict[str, np.ndarray], *,
                 dtype: Any = np.float32, vlm: bool = False) -> None:
    """Save HF weights as a transformers-style directory (config.json + model.safetensors).

    With vlm, lay it out as `Qwen3_5ForConditionalGeneration` (text config nested, `model.language_model.*`
    names, a stand-in vision tensor).
    """
    import json

    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    config = target_config_to_hf(cfg)
    tensors = {k: np.asarray(v).astype(dtype) for k, v in state_dict.items()}
    if vlm:
        config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                  "tie_word_embeddings": cfg.tie_word_embeddings, "text_config": config,
                  "vision_config": {"depth": 1, "hidden_size": 8}}
        tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
        tensors["model.visual.patch_embed.proj.weight"] = np.zeros((8, 3), dtype)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(path, "model.safetensors"))


def random_gguf_tensors(cfg: TargetConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random float32 weights in GGUF conventions (norms around 1, ssm_a < 0), no torch needed."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, spec in tensor_specs(cfg).items():
        if spec.optional:
            continue
        if name.endswith("ssm_a"):
            x = -np.exp(rng.uniform(-1.0, 1.5, spec.shape))
        elif name.endswith("norm.weight"):
            x = 1.0 + rng.normal(0.0, 0.2, spec.shape)
        elif spec.kind == "dense":  # conv kernel and dt bias
            x = rng.normal(0.0, 0.5, spec.shape)
        else:
            x = rng.normal(0.0, 1.0 / np.sqrt(spec.shape[-1]), spec.shape)
        out[name] = x.astype(np.float32)
    return out


def check_out(path: str) -> None:
    """--out must name a file in an existing folder."""
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise InputError(f"--out {path}: the folder {folder} does not exist")
    if os.path.isdir(path):
        raise InputError(f"--out {path}: is a directory")


def check_size(cfg: TargetConfig, where: str) -> None:
    """Refuse a config whose random float32 weights would not fit the host's free memory."""
    need = 8 * sum(math.prod(spec.shape) for spec in tensor_specs(cfg).values())  # float32 draws, then their quants
    free = host_memory()
    if free is not None and need > free:
        raise InputError(f"{where}: random weights for this config need {need / 2**30:.1f} GiB, but the host has "
                         f"{free / 2**30:.1f} GiB free")


def run(argv: list[str]) -> int:
    """`python -m dflash_jax.testing.tiny --out FILE.gguf`: write a random tiny qwen35 GGUF (Q4_K_M types)."""
    import logging

    from absl import flags

    f = flags.FLAGS
    if len(argv) > 1:
        raise InputError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.getLogger("gguf").setLevel(logging.WARNING)  # gguf-py's per-file INFO lines
    check_out(f.out)
    cfg = load_target_config(f.config)
    check_size(cfg, f.config)
    chosen = write_gguf(f.out, random_gguf_tensors(cfg, f.seed), cfg,
                        name=f"random {os.path.basename(f.config)} seed {f.seed}")
    print(f"wrote {f.out}: {len(chosen)} tensors, random weights, config {f.config}")
    return 0


def main(argv: list[str]) -> None:
    run_main("tiny", run, argv)


if __name__ == "__main__":
    from absl import app, flags

    from dflash_jax.generate import parse_flags

    flags.DEFINE_string("out", None, "Path of the GGUF file to write.", required=True)
    flags.DEFINE_string("config", os.path.join(CONFIG_DIR, "tiny-qwen35.json"), "HF-style target config.json.")
    flags.DEFINE_integer("seed", 0, "Seed of the random weights.")
    app.run(main, flags_parser=lambda argv: parse_flags(argv, "tiny"))


def tiny_draft_config(target: TargetConfig, layer_types: tuple[str, ...] = ("full_attention", "full_attention"),
                      block_size: int = 8, sliding_window: int | None = None, taps: tuple[int, ...] | None = None):
    """A small DFlash drafter config for a target: its hidden size and vocab, taps spread over its layers."""
    heads = max(1, target.hidden_size // 32)
    return DraftConfig(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, intermediate_size=2 * target.hidden_size,
        num_layers=len(layer_types), layer_types=tuple(layer_types), num_heads=heads, num_kv_heads=max(1, heads // 2),
        head_dim=32, rope_theta=1e7, rms_norm_eps=1e-6, sliding_window=sliding_window, block_size=block_size,
        mask_token_id=target.vocab_size - 1,
        target_layer_ids=taps or default_target_layer_ids(target.num_layers, min(2, target.num_layers)),
        num_target_layers=target.num_layers, max_position_embeddings=target.max_position_embeddings)


def random_draft_tensors(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random float32 drafter weights by z-lab name (norms around 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tensor_shapes(cfg).items():
        if len(shape) == 1:
            out[name] = (1.0 + rng.normal(0.0, 0.1, shape)).astype(np.float32)
        else:
            out[name] = rng.normal(0.0, 1.0 / np.sqrt(shape[1]), shape).astype(np.float32)
    return out


def random_target(cfg: TargetConfig, seed: int = 0) -> Target:
    """A Target of random_gguf_tensors on the device (float32 weights, as the reference path runs them)."""
    return target_from_tensors(cfg, {k: jnp.asarray(v) for k, v in random_gguf_tensors(cfg, seed).items()})


def random_draft(cfg: DraftConfig, seed: int = 0) -> Draft:
    """A Draft of random_draft_tensors on the device."""
    return draft_from_tensors(cfg, {k: jnp.asarray(v) for k, v in random_draft_tensors(cfg, seed).items()})
