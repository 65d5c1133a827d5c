"""GGUF fixture writer: HF weights -> qwen35 GGUF -> our reader, and the fixture written again with its own types."""

import dataclasses

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from dflash_jax import quant
from dflash_jax.gguf import GGUFModel
from dflash_jax.testing.gguf_writer import copy_metadata, q4_k_m_rule, uniform_rule, write_gguf, write_hf_as_gguf
from dflash_jax.testing.tiny import random_hf_state_dict, tiny_target_config
from dflash_jax.weights import gguf_to_hf, hf_to_gguf

# Worst block error as a fraction of the block's max |x|: the quantizers' bounds from tests/test_quantize.py, and
# for F32 the float rounding of the +-1 and -exp/log transforms.
MAX_BLOCK_ERROR = {GT.Q4_K: 0.10, GT.Q5_K: 0.06, GT.Q6_K: 0.02, GT.Q8_0: 0.005, GT.Q5_0: 0.07,
                   GT.Q5_1: 0.036, GT.F32: 1e-6}


def _float_tensors(model: GGUFModel) -> dict[str, np.ndarray]:
    out = {}
    for name in model.tensors:
        t = model.load(name)
        out[name] = np.asarray(quant.dequantize(t)) if isinstance(t, quant.QTensor) else t
    return out


def _assert_within_block_error(name, got, want, qtype):
    got, want = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    block = 256 if got.shape[-1] % 256 == 0 else got.shape[-1]
    g, w = got.reshape(-1, block), want.reshape(-1, block)
    bound = MAX_BLOCK_ERROR[qtype] * np.abs(w).max(axis=1) + 1e-7
    assert (np.abs(g - w).max(axis=1) <= bound).all(), f"{name} ({qtype.name})"


@pytest.mark.parametrize("overrides", [{}, {"linear_num_value_heads": 2, "tie_word_embeddings": True}])
def test_hf_model_written_as_q4_k_m_reads_back(tmp_path, overrides):
    cfg = tiny_target_config(**overrides)
    hf = random_hf_state_dict(cfg, seed=5)
    path = tmp_path / "tiny.gguf"
    chosen = write_hf_as_gguf(path, hf, cfg)
    model = GGUFModel(path)
    assert model.config == cfg
    assert {n: t.ggml_type for n, t in model.tensors.items()} == chosen
    assert set(chosen.values()) == {GT.Q4_K, GT.Q6_K, GT.Q5_0, GT.F32}
    assert chosen["blk.0.ssm_out.weight"] == GT.Q5_0  # 192-wide rows: llama-quantize's fallback for Q4_K
    assert gguf.GGUFReader(path).fields["general.file_type"].contents() == 15
    want = hf_to_gguf(hf, cfg)
    for name, got in _float_tensors(model).items():
        _assert_within_block_error(name, got, want[name], chosen[name])


def test_f32_file_round_trips_hf_weights(tmp_path):
    cfg = tiny_target_config(num_layers=8)
    hf = random_hf_state_dict(cfg, seed=6)
    path = tmp_path / "f32.gguf"
    write_hf_as_gguf(path, hf, cfg, types=uniform_rule(GT.F32))
    back = gguf_to_hf(_float_tensors(GGUFModel(path)), cfg)
    for name, x in hf.items():
        np.testing.assert_allclose(back[name], x, rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("qtype", [GT.Q5_K, GT.Q8_0])
def test_uniform_types(tmp_path, qtype):
    cfg = tiny_target_config()
    tensors = hf_to_gguf(random_hf_state_dict(cfg, seed=7), cfg)
    path = tmp_path / f"{qtype.name}.gguf"
    chosen = write_gguf(path, tensors, cfg, types=uniform_rule(qtype))
    model = GGUFModel(path)
    for name, got in _float_tensors(model).items():
        assert model.tensors[name].ggml_type == chosen[name]
        _assert_within_block_error(name, got, tensors[name], chosen[name])


def test_mtp_block_is_written_after_the_main_layers(tmp_path):
    cfg = dataclasses.replace(tiny_target_config(), num_mtp_layers=1)
    path = tmp_path / "mtp.gguf"
    write_hf_as_gguf(path, random_hf_state_dict(cfg, seed=8, mtp=True), cfg)
    model = GGUFModel(path)
    fields = model.reader.fields
    assert fields["qwen35.block_count"].contents() == 5 and fields["qwen35.nextn_predict_layers"].contents() == 1
    assert model.config.num_layers == 4 and model.config.num_mtp_layers == 1
    assert model.tensors["blk.4.nextn.eh_proj.weight"].shape == (256, 512)
    assert model.tensors["blk.4.attn_v.weight"].ggml_type == GT.Q6_K  # the last block gets more bits


def test_fixture_written_again_with_its_own_types(tiny_gguf_path, tmp_path):
    """HF weights recovered from the llama.cpp fixture, converted back: same names, shapes, types and values."""
    fixture = GGUFModel(tiny_gguf_path)
    cfg = fixture.config
    values = _float_tensors(fixture)
    hf = gguf_to_hf(values, cfg)
    path = tmp_path / "again.gguf"
    types = {n: t.ggml_type for n, t in fixture.tensors.items()}
    write_hf_as_gguf(path, hf, cfg, types=lambda name, spec: types[name],
                     metadata=copy_metadata(fixture.reader, "tokenizer."))
    again = GGUFModel(path)
    assert list(again.tensors) == list(fixture.tensors)
    for name, info in again.tensors.items():
        assert (info.ggml_type, info.shape, info.nbytes) == (types[name], fixture.tensors[name].shape,
                                                             fixture.tensors[name].nbytes)
    for name, got in _float_tensors(again).items():
        _assert_within_block_error(name, got, values[name], types[name])
    tokens = again.reader.fields["tokenizer.ggml.tokens"]
    assert tokens.contents() == fixture.reader.fields["tokenizer.ggml.tokens"].contents()
    assert q4_k_m_rule(cfg)("blk.0.attn_qkv.weight", again.specs["blk.0.attn_qkv.weight"]) == GT.Q6_K


def test_writer_rejects_tensors_that_do_not_fit(tmp_path):
    cfg = tiny_target_config()
    tensors = hf_to_gguf(random_hf_state_dict(cfg, seed=9), cfg)
    with pytest.raises(ValueError, match="missing \\['blk.0.ssm_a'\\]"):
        write_gguf(tmp_path / "x.gguf", {k: v for k, v in tensors.items() if k != "blk.0.ssm_a"}, cfg)
    with pytest.raises(ValueError, match="'blk.0.ssm_a' has shape \\[3\\], expected \\[6\\]"):
        write_gguf(tmp_path / "x.gguf", {**tensors, "blk.0.ssm_a": np.ones(3, np.float32)}, cfg)


def test_tiny_cli_writes_a_readable_random_model(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT
    from dflash_jax.config import load_target_config
    from dflash_jax.testing.tiny import CONFIG_DIR

    out = tmp_path / "tiny.gguf"
    run = subprocess.run([sys.executable, "-m", "dflash_jax.testing.tiny", f"--out={out}", "--seed=3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    model = GGUFModel(out)
    assert model.config == load_target_config(f"{CONFIG_DIR}/tiny-qwen35.json")
    norm = model.load("blk.0.attn_norm.weight")
    assert abs(float(norm.mean()) - 1.0) < 0.1 and float(norm.std()) > 0.1  # random, not constant
