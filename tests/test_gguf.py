"""GGUF reader: the fixture's config and tensor table, per-layer metadata forms, and every kind of bad file."""

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import GGUFValueType as VT

from dflash_jax import quant
from dflash_jax.config import FULL_ATTENTION, load_target_config
from dflash_jax.gguf import GGUFError, GGUFModel
from dflash_jax.testing.gguf_writer import q4_k_m_rule, rewrite_gguf
from dflash_jax.testing.tiny import CONFIG_DIR

from conftest import ROOT


@pytest.fixture(scope="module")
def fixture_model(tiny_gguf_path) -> GGUFModel:
    return GGUFModel(tiny_gguf_path)


def test_fixture_config_matches_the_fixture_readme(fixture_model):
    cfg = fixture_model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.intermediate_size) == (1024, 256, 8, 512)
    assert cfg.full_attention_layers == (3, 7)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_dim) == (4, 2, 64, 16)
    assert cfg.rope_theta == 1e7 and cfg.rms_norm_eps == 1e-6
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (2, 6)
    assert (cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.conv_kernel) == (128, 128, 4)
    assert not cfg.tie_word_embeddings and cfg.num_mtp_layers == 0
    assert cfg == load_target_config(os.path.join(CONFIG_DIR, "tiny-qwen35.json"))


def test_fixture_types_follow_stock_q4_k_m_rules(fixture_model):
    rule = q4_k_m_rule(fixture_model.config)
    for name, info in fixture_model.tensors.items():
        assert info.ggml_type == rule(name, fixture_model.specs[name]), name
    assert fixture_model.tensors["blk.6.attn_qkv.weight"].ggml_type == GT.Q6_K
    assert fixture_model.tensors["blk.7.attn_v.weight"].ggml_type == GT.Q6_K
    assert fixture_model.tensors["blk.1.ffn_down.weight"].ggml_type == GT.Q4_K


def test_load_gives_qtensors_and_float_arrays(fixture_model):
    qt = fixture_model.load("blk.0.attn_qkv.weight")
    assert isinstance(qt, quant.QTensor) and qt.fmt == "Q6_K" and qt.shape == (1280, 256)
    raw = fixture_model.raw("blk.0.attn_qkv.weight")
    np.testing.assert_array_equal(np.asarray(quant.dequantize(qt)), gguf.quants.dequantize(raw, GT.Q6_K))
    conv = fixture_model.load("blk.0.ssm_conv1d.weight")
    assert conv.shape == (1280, 4) and conv.dtype == np.float32
    assert (fixture_model.load("blk.0.ssm_a") < 0).all()  # stored as -exp(A_log)


def test_inspect_prints_config_and_tables(tiny_gguf_path):
    out = subprocess.run([sys.executable, "-m", "dflash_jax.inspect", str(tiny_gguf_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "full_attention at [3, 7]" in out.stdout
    assert "linear_num_value_heads   6" in out.stdout
    assert "Q4_K        55" in out.stdout and "Q6_K         9" in out.stdout
    assert "blk.7.attn_k_norm.weight" in out.stdout


def test_inspect_bad_file_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("hello")
    out = subprocess.run([sys.executable, "-m", "dflash_jax.inspect", str(bad)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0
    assert "not a GGUF file" in out.stderr and str(bad) in out.stderr


# ---------------------------------------------------------------------------------------------------------------
# Metadata in its other legal forms

def _per_layer(values):
    return ("qwen35.attention.head_count_kv", values, VT.ARRAY, VT.UINT32)


def test_per_layer_head_counts_and_recurrent_layers(tiny_gguf_path, tmp_path, fixture_model):
    path = tmp_path / "arrays.gguf"
    recurrent = [t != FULL_ATTENTION for t in fixture_model.config.layer_types]
    rewrite_gguf(tiny_gguf_path, path, drop_keys=["qwen35.full_attention_interval"],
                 set_keys=[("qwen35.attention.head_count", [0, 0, 0, 4, 0, 0, 0, 4], VT.ARRAY, VT.UINT32),
                           _per_layer([0, 0, 0, 2, 0, 0, 0, 2]),
                           ("qwen35.attention.recurrent_layers", recurrent, VT.ARRAY, VT.BOOL)])
    assert GGUFModel(path).config == fixture_model.config


def test_mtp_blocks_are_not_main_layers(tiny_gguf_path, tmp_path):
    # block_count 9 with nextn_predict_layers 1: eight main layers, blk.8 is an MTP block the file must carry.
    path = tmp_path / "mtp.gguf"
    rewrite_gguf(tiny_gguf_path, path, set_keys=[("qwen35.block_count", 9, VT.UINT32, None),
                                                  ("qwen35.nextn_predict_layers", 1, VT.UINT32, None)])
    with pytest.raises(GGUFError, match=r"missing tensor 'blk\.8\.attn_norm\.weight'"):
        GGUFModel(path)


# ---------------------------------------------------------------------------------------------------------------
# Bad files: each gives one GGUFError naming the file and the problem.

def _cut(src, dst, size):
    dst.write_bytes(src.read_bytes()[:size])
    return dst


BAD_EDITS = {
    "other architecture": (dict(arch="llama"), r"architecture 'llama' is not supported \(expected 'qwen35'"),
    "missing key": (dict(drop_keys=["qwen35.ssm.conv_kernel"]), r"missing metadata key 'qwen35.ssm.conv_kernel'"),
    "key of wrong type": (dict(set_keys=[("qwen35.block_count", "eight", VT.STRING, None)]),
                          r"'qwen35.block_count' should be a single int, found 'eight'"),
    "missing tensor": (dict(drop_tensors=["blk.5.ssm_out.weight"]), r"missing tensor 'blk.5.ssm_out.weight'"),
    "unexpected tensor": (dict(tensors={"blk.2.attn_q.weight": (np.zeros((512, 144), np.uint8), GT.Q4_K)}),
                          r"unexpected tensor 'blk.2.attn_q.weight'"),
    "wrong shape": (dict(tensors={"blk.1.ssm_norm.weight": (np.ones(64, np.float32), GT.F32)}),
                    r"tensor 'blk.1.ssm_norm.weight' has shape \[64\], expected \[128\]"),
    "shape against config": (dict(set_keys=[("qwen35.feed_forward_length", 1024, VT.UINT32, None)]),
                             r"'blk.0.ffn_gate.weight' has shape \[512, 256\], expected \[1024, 256\]"),
    "unsupported type": (dict(tensors={"blk.0.ffn_up.weight": (np.zeros((512, 84), np.uint8), GT.Q2_K)}),
                         r"'blk.0.ffn_up.weight' has type Q2_K, which is not supported \(supported: .*Q4_K"),
    "inconsistent metadata": (dict(set_keys=[("qwen35.ssm.inner_size", 700, VT.UINT32, None)]),
                              r"ssm.inner_size 700 is not a multiple of ssm.time_step_rank 6"),
    "differing head counts": (dict(set_keys=[_per_layer([0, 0, 0, 2, 0, 0, 0, 1])]),
                              r"'qwen35.attention.head_count_kv' differs between full-attention layers"),
    "recurrent layers disagree with tensors": (
        dict(set_keys=[("qwen35.attention.recurrent_layers", [True] * 7 + [False], VT.ARRAY, VT.BOOL)]),
        r"missing tensor 'blk.3.attn_qkv.weight'"),
}


@pytest.mark.parametrize("case", sorted(BAD_EDITS))
def test_bad_gguf_edits(case, tiny_gguf_path, tmp_path):
    edits, message = BAD_EDITS[case]
    path = tmp_path / "bad.gguf"
    rewrite_gguf(tiny_gguf_path, path, **edits)
    with pytest.raises(GGUFError, match=message) as err:
        GGUFModel(path)
    assert str(path) in str(err.value)


def test_bad_files(tiny_gguf_path, tmp_path):
    cases = {
        tmp_path / "absent.gguf": "no such file",
        tmp_path: "is a directory",
        _cut(tiny_gguf_path, tmp_path / "empty.gguf", 0): r"not a GGUF file \(starts with b''",
        _cut(tiny_gguf_path, tmp_path / "header.gguf", 3000): "tensor_count.* the file is truncated or corrupt",
        _cut(tiny_gguf_path, tmp_path / "data.gguf", os.path.getsize(tiny_gguf_path) - 100):
            r"file is truncated: tensor 'blk.7.attn_k_norm.weight' ends at byte 5370400 but the file has 5370300",
    }
    for path, message in cases.items():
        with pytest.raises(GGUFError, match=message) as err:
            GGUFModel(path)
        assert str(path) in str(err.value)
