"""The DFlash drafter against the z-lab reference outputs of the fixture, and its loading checks."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import KernelConfig
from dflash_jax.engine.prefill import prefill
from dflash_jax.load import LoadError, load_draft, load_target
from dflash_jax.models import draft as D
from dflash_jax.models.target import init_state

from conftest import TINY

propose = jax.jit(D.propose, static_argnums=(1,), static_argnames=("kcfg",))
extend = jax.jit(D.extend_context, static_argnums=(1,))


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def target(tiny_gguf_path):
    return load_target(tiny_gguf_path, progress=False)


@pytest.mark.parametrize("impl,tol", [("reference", 1e-4), ("pallas", 2e-2)])  # pallas: bf16 attention products
@pytest.mark.parametrize("name", ["draft-full", "draft-swa"])
def test_drafter_matches_z_lab_reference_with_its_context_cache(target, name, impl, tol):
    kcfg = KernelConfig(impl=impl, interpret=impl == "pallas")
    draft = load_draft(TINY / name, target.config, progress=False)
    cfg, ref = draft.config, np.load(TINY / name / "ref.npz")
    state = D.init_draft_state(cfg, 40)
    for prefix in ("", "step2_"):  # the second call only appends the 3 newly committed tokens
        hidden = ref[prefix + "target_hidden"]
        taps = jnp.asarray(hidden).reshape(len(hidden), len(cfg.target_layer_ids), -1)
        state = extend(draft, cfg, state, taps, jnp.int32(len(hidden)))
        block = ref[prefix + "block_ids"]
        assert list(block[1:]) == [cfg.mask_token_id] * (cfg.block_size - 1)
        h, logits = propose(draft, cfg, state, target, jnp.int32(block[0]), kcfg=kcfg)
        assert rel(h, ref[prefix + "draft_hidden"]) < tol
        assert rel(logits, ref[prefix + "draft_logits"]) < tol
    assert int(state.length) == 23


def test_target_taps_are_the_reference_context_features(target):
    """The features the reference drafter was fed are the outputs of the fixture target's layers 1 and 5."""
    ref = np.load(TINY / "draft-full" / "ref.npz")
    _, taps, _ = prefill(target, target.config, init_state(target.config, 64), ref["prompt_ids"], taps=(1, 5))
    assert rel(np.asarray(taps).reshape(len(taps), -1), ref["target_hidden"]) < 1e-4


def _edited_copy(tmp_path, edit):
    path = tmp_path / "draft"
    shutil.copytree(TINY / "draft-full", path)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(num_target_layers=64), "made for a target of 64 layers, this one has 8"),
    (lambda c: c.update(vocab_size=2048), "vocab 2048 != the target's 1024"),
    (lambda c: c.update(hidden_size=512), "hidden size 512 != the target's 256"),
    (lambda c: c["dflash_config"].update(mask_token_id=5000), "mask_token_id 5000 is outside the vocab"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 9]), r"target_layer_ids \[1, 9\] must be in \[0, 8\)"),
    (lambda c: c.update(architectures=["LlamaForCausalLM"]), "LlamaForCausalLM is not a DFlash drafter"),
    (lambda c: c.update(num_hidden_layers=3, layer_types=["full_attention"] * 3), "missing"),
])
def test_drafters_that_do_not_fit_the_target_are_refused_at_load(target, tmp_path, edit, message):
    with pytest.raises(LoadError, match=message):
        load_draft(_edited_copy(tmp_path, edit), target.config, progress=False)


def test_drafter_file_path_and_missing_paths(target, tmp_path):
    draft = load_draft(TINY / "draft-swa" / "model.safetensors", target.config, progress=False)
    assert draft.config.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert draft.config.sliding_window == 12
    with pytest.raises(LoadError, match="no such file"):
        load_draft(tmp_path / "nothing", target.config, progress=False)


def test_loaded_models_are_nnx_modules_whose_paths_are_the_tensor_names(target, tiny_gguf_path):
    """load_target and load_draft return Flax NNX modules; a weight's path in the module is its HF / z-lab name, and
    the modules give back every tensor they were built from (target_tensors, draft_tensors)."""
    from flax import nnx
    from safetensors.numpy import load_file

    from dflash_jax.gguf import GGUFModel
    from dflash_jax.models.target import GatedAttention, GatedDeltaNet, target_tensors
    from dflash_jax.quant import dequantize

    draft = load_draft(TINY / "draft-swa", target.config, progress=False)
    assert isinstance(target, nnx.Module) and isinstance(draft, nnx.Module)
    cfg = target.config
    assert [type(layer.self_attn if t == "full_attention" else layer.linear_attn) for t, layer in
            zip(cfg.layer_types, target.layers)] == [GatedAttention if t == "full_attention" else GatedDeltaNet
                                                    for t in cfg.layer_types]
    gguf = GGUFModel(tiny_gguf_path)
    i = cfg.full_attention_layers[0]
    np.testing.assert_array_equal(target.layers[i].self_attn.q_proj.weight.get_value(),
                                  dequantize(gguf.load(f"blk.{i}.attn_q.weight")))  # reference: dequantized at load
    names = {n for n in gguf.tensors if not (n.startswith("blk.") and int(n.split(".")[1]) >= cfg.num_layers)}
    assert set(target_tensors(target)) == names | {"output.weight"}
    stored = load_file(str(TINY / "draft-swa" / "model.safetensors"))
    tensors = D.draft_tensors(draft)
    assert set(tensors) == {n.removeprefix("model.") for n in stored}
    for name, x in stored.items():
        np.testing.assert_array_equal(tensors[name.removeprefix("model.")], np.asarray(x, np.float32), err_msg=name)
