"""HF <-> GGUF conventions: exact inverses, and the inverse reproduces llama.cpp's conversion of the fixture."""

import dataclasses

import numpy as np
import pytest

from dflash_jax import quant
from dflash_jax.config import target_config_to_hf
from dflash_jax.gguf import GGUFModel, tensor_specs
from dflash_jax.testing.tiny import random_hf_state_dict, tiny_target_config
from dflash_jax.weights import WeightsError, gguf_to_hf, hf_to_gguf, tiled_value_order

from conftest import TINY


def test_tiled_value_order_matches_the_spec():
    # nk = 2, nv = 6 (R = 3): GGUF head j = r*2 + g holds HF head g*3 + r.
    np.testing.assert_array_equal(tiled_value_order(2, 6), [0, 3, 1, 4, 2, 5])
    np.testing.assert_array_equal(tiled_value_order(4, 4), np.arange(4))


@pytest.mark.parametrize("overrides", [{}, {"linear_num_value_heads": 2}, {"tie_word_embeddings": True},
                                       {"num_layers": 8, "interval": 2}])
def test_hf_to_gguf_and_back_is_identity(overrides):
    cfg = tiny_target_config(**overrides)
    hf = random_hf_state_dict(cfg, seed=1)
    converted = hf_to_gguf(hf, cfg)
    specs = tensor_specs(cfg)
    assert set(converted) == set(specs)
    assert all(converted[n].shape == specs[n].shape for n in specs)
    back = gguf_to_hf(converted, cfg)
    assert set(back) == set(hf)
    for name, x in hf.items():
        np.testing.assert_allclose(back[name], x, rtol=1e-6, atol=1e-6, err_msg=name)


def test_conventions_on_known_tensors():
    cfg = tiny_target_config()  # nk 2, nv 6, value head dim 32
    hf = random_hf_state_dict(cfg, seed=2)
    g = hf_to_gguf(hf, cfg)
    p = "model.layers.0.linear_attn."
    np.testing.assert_allclose(g["blk.0.attn_norm.weight"], hf["model.layers.0.input_layernorm.weight"] + 1)
    np.testing.assert_array_equal(g["blk.0.ssm_norm.weight"], hf[p + "norm.weight"])  # the gated norm: no +1
    np.testing.assert_allclose(g["blk.0.ssm_a"], -np.exp(hf[p + "A_log"][tiled_value_order(2, 6)]), rtol=1e-6)
    # GGUF value head 1 (r=0, g=1) is HF head 3: rows 32..63 of z are HF rows 96..127.
    np.testing.assert_array_equal(g["blk.0.attn_gate.weight"][32:64], hf[p + "in_proj_z.weight"][96:128])
    kd2 = 2 * cfg.key_dim  # q and k channels are not reordered
    np.testing.assert_array_equal(g["blk.0.attn_qkv.weight"][:kd2], hf[p + "in_proj_qkv.weight"][:kd2])
    np.testing.assert_array_equal(g["blk.0.attn_qkv.weight"][kd2 + 32:kd2 + 64],
                                  hf[p + "in_proj_qkv.weight"][kd2 + 96:kd2 + 128])
    np.testing.assert_array_equal(g["blk.0.ssm_out.weight"][:, 32:64], hf[p + "out_proj.weight"][:, 96:128])
    assert g["blk.0.ssm_conv1d.weight"].shape == (cfg.conv_dim, 4)


def test_vlm_names_are_accepted_and_errors_name_the_tensor():
    cfg = tiny_target_config()
    hf = random_hf_state_dict(cfg, seed=3)
    vlm = {k.replace("model.", "model.language_model.", 1): v for k, v in hf.items()}
    vlm["model.visual.patch_embed.proj.weight"] = np.zeros((4, 4), np.float32)
    for name, x in hf_to_gguf(vlm, cfg).items():
        np.testing.assert_array_equal(x, hf_to_gguf(hf, cfg)[name])
    with pytest.raises(WeightsError, match="missing HF tensor 'model.layers.2.linear_attn.dt_bias'"):
        hf_to_gguf({k: v for k, v in hf.items() if k != "model.layers.2.linear_attn.dt_bias"}, cfg)
    with pytest.raises(WeightsError, match="unexpected HF tensor 'model.layers.9.mlp.up_proj.weight'"):
        hf_to_gguf({**hf, "model.layers.9.mlp.up_proj.weight": np.zeros(1)}, cfg)
    bad = dict(hf, **{"model.norm.weight": np.zeros(3, np.float32)})
    with pytest.raises(WeightsError, match=r"'model.norm.weight' has shape \[3\], expected \[256\]"):
        hf_to_gguf(bad, cfg)
    conv = "model.layers.0.linear_attn.conv1d.weight"  # a shape numpy's conversion could not take
    with pytest.raises(WeightsError, match=rf"'{conv}' has shape \[{hf[conv].shape[0]}, 4\], expected"):
        hf_to_gguf({**hf, conv: hf[conv][:, 0, :]}, cfg)


def test_mtp_block_converts_both_ways():
    cfg = dataclasses.replace(tiny_target_config(), num_mtp_layers=1)
    hf = random_hf_state_dict(cfg, seed=4, mtp=True)
    g = hf_to_gguf(hf, cfg)
    np.testing.assert_allclose(g["blk.4.nextn.enorm.weight"], hf["mtp.pre_fc_norm_embedding.weight"] + 1)
    np.testing.assert_array_equal(g["blk.4.attn_q.weight"], hf["mtp.layers.0.self_attn.q_proj.weight"])
    back = gguf_to_hf(g, cfg)
    assert set(back) == set(hf)
    # The same HF weights for a config without MTP drop the mtp.* tensors.
    assert "blk.4.attn_q.weight" not in hf_to_gguf(hf, tiny_target_config())


def test_fixture_weights_back_in_hf_reproduce_hf_logits(tiny_gguf_path):
    """gguf_to_hf on the fixture's dequantized tensors, run by transformers, gives the fixture's hf_q_logits."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    model = GGUFModel(tiny_gguf_path)
    tensors = {}
    for name in model.tensors:
        t = model.load(name)
        tensors[name] = np.asarray(quant.dequantize(t)) if isinstance(t, quant.QTensor) else t
    hf_cfg = target_config_to_hf(model.config)
    hf_cfg.pop("model_type"), hf_cfg.pop("architectures")
    hf_model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**hf_cfg)).eval()
    hf_model.load_state_dict({k: torch.tensor(v) for k, v in gguf_to_hf(tensors, model.config).items()})
    ids = torch.from_numpy(np.load(TINY / "tokens.npy").astype(np.int64))[None]
    with torch.no_grad():
        logits = hf_model(ids).logits[0].numpy()
    ref = np.load(TINY / "ref.npz")["hf_q_logits"]
    assert np.linalg.norm(logits - ref) / np.linalg.norm(ref) < 1e-4
