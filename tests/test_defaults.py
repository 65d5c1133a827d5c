"""The device classes' defaults (dflash_jax/defaults.py) and the one resolution of the flags against them."""

import dataclasses

import jax
import pytest

from dflash_jax.config import ConfigError, EngineConfig, KernelConfig
from dflash_jax.defaults import DEVICE_DEFAULTS, device_class, resolve_engine, resolve_kernels

MODES = ("ar", "chain", "ddtree")


def test_this_machine_gets_its_row_of_the_table():
    """With no choices, this machine's class decides (on a CPU: the reference path, exact numerics, float32 caches,
    budget 8)."""
    device = device_class()
    assert device == device_class(jax.devices()[0]) == ("cpu" if jax.default_backend() == "cpu" else device)
    assert resolve_kernels() == resolve_kernels(device=device) and resolve_engine() == resolve_engine(device=device)
    if device == "cpu":
        assert resolve_kernels() == KernelConfig(impl="reference", interpret=False, mgpu="off", small_rows=64,
                                                 numerics="exact")
        assert resolve_engine() == EngineConfig(mode="ddtree", budget=8, kv_type="f32")


@pytest.mark.parametrize("device, want", [
    ("cpu", ("reference", False, "off", "off", "exact", False)),
    ("gpu", ("pallas", False, "off", "off", "exact", False)),
    # every mode multiplies the same rounded weights; tree attention on Mosaic GPU
    ("hopper", ("pallas", False, "only", "only", "exact", True)),
])
def test_each_device_class_gets_its_row_of_the_table(device, want):
    impl, interpret, ar_layout, tree_layout, numerics, mgpu_attention = want
    got = {mode: resolve_kernels(mode, device=device) for mode in MODES}
    assert {k.impl for k in got.values()} == {impl} and {k.interpret for k in got.values()} == {interpret}
    assert {k.mgpu_attention for k in got.values()} == {mgpu_attention}
    assert {k.numerics for k in got.values()} == {numerics}
    assert [got[m].mgpu for m in MODES] == [ar_layout, tree_layout, tree_layout]
    ecfg = resolve_engine("ddtree", device=device)
    assert (ecfg.kv_type, ecfg.budget) == (DEVICE_DEFAULTS[device].kv_type, DEVICE_DEFAULTS[device].budget)
    assert (ecfg.kv_type, ecfg.budget) == (("f32", 8) if device == "cpu" else ("bf16", 22))


def test_flags_override_the_table():
    assert resolve_kernels("ar", mgpu=True, device="hopper").mgpu == "only"
    assert resolve_kernels("ar", mgpu=False, device="hopper").mgpu == "off"
    assert resolve_kernels("ddtree", mgpu=True, device="hopper").mgpu == "only"
    assert resolve_kernels(numerics="exact", device="gpu").numerics == "exact"
    assert resolve_kernels(numerics="fast", device="cpu").numerics == "fast"
    assert resolve_kernels("ddtree", mgpu=False, device="hopper").mgpu == "off"
    assert resolve_kernels(impl="pallas", device="cpu") == KernelConfig(impl="pallas", interpret=True)
    assert resolve_kernels(impl="reference", device="hopper").mgpu == "off"
    assert not resolve_kernels(impl="reference", device="hopper").mgpu_attention
    assert not resolve_kernels(mgpu_attention=False, device="hopper").mgpu_attention
    assert resolve_kernels(small_rows=0, device="gpu").small_rows == 0
    ecfg = resolve_engine("chain", budget=5, topk=3, chain_seed=True, max_ctx=100, kv_type="bf16",
                          draft_rule="tempered", compile_ahead=True, device="cpu")
    assert ecfg == EngineConfig(mode="chain", budget=5, topk=3, chain_seed=True, max_ctx=100, kv_type="bf16",
                                draft_rule="tempered", compile_ahead=True)
    assert ecfg.step_config() == EngineConfig(mode="chain", budget=5, topk=3, chain_seed=True, max_ctx=100,
                                              kv_type="bf16", draft_rule="tempered")


def test_keys_and_values_take_their_own_types_and_the_drafter_a_context_bound():
    """K's and V's types default to --kv_type (a type equal to it is no separate choice: one configuration, one
    compilation); the drafter's context is bounded at 2048 tokens unless asked otherwise (0: the whole context)."""
    ecfg = resolve_engine(kv_type_k="q8_0", device="gpu")
    assert ecfg.kv_types == ("q8_0", "bf16") and ecfg.draft_ctx == EngineConfig().draft_ctx == 2048
    assert resolve_engine(kv_type="q4_0", kv_type_v="f16", draft_ctx=512, device="cpu").kv_types == ("q4_0", "f16")
    assert resolve_engine(draft_ctx=512).draft_ctx == 512 and resolve_engine(draft_ctx=0).draft_ctx is None
    assert resolve_engine(kv_type="bf16", kv_type_k="bf16", kv_type_v="bf16") == resolve_engine(kv_type="bf16")
    assert EngineConfig(kv_type="q8_0", kv_type_v="f32").kv_types == ("q8_0", "f32")


def test_the_prefill_chunk_is_64_tokens_unless_asked():
    """One block of the delta rule on every device until a GPU measurement picks another (issue 42)."""
    assert resolve_engine(device="cpu").prefill_chunk == resolve_engine(device="hopper").prefill_chunk == 64
    assert resolve_engine(prefill_chunk=512).prefill_chunk == EngineConfig(prefill_chunk=512).prefill_chunk == 512


@pytest.mark.parametrize("call, message", [
    (lambda: resolve_kernels(mgpu=True, device="gpu"), "needs a Hopper GPU"),
    (lambda: resolve_kernels(mgpu=True, device="cpu"), "needs a Hopper GPU"),
    (lambda: resolve_kernels(mgpu_attention=True, device="gpu"), "needs a Hopper GPU"),
    (lambda: resolve_kernels(impl="triton"), "impl must be one of auto, reference, pallas"),
    (lambda: resolve_kernels(device="tpu"), "device class 'tpu'"),
    (lambda: resolve_engine(kv_type="fp8"), "kv_type must be one of f32, bf16, f16, q8_0, q4_0, rq3_0"),
    (lambda: resolve_engine(draft_rule="greedy"), "draft_rule must be one of coupled, tempered, plain"),
    (lambda: resolve_engine(kv_type_k="fp8"), "kv_type_k must be one of f32, bf16, f16, q8_0, q4_0, rq3_0"),
    (lambda: resolve_engine(kv_type_v="q3_0"), "kv_type_v must be one of f32, bf16"),
    (lambda: resolve_engine(draft_ctx=-1), r"draft_ctx must be at least 0 \(0: the whole context\); got -1"),
    (lambda: EngineConfig(draft_ctx=0), r"draft_ctx 0 must be at least 1 \(None: the whole context\)"),
    (lambda: EngineConfig(kv_type_v="fp8"), "kv_type_v 'fp8' is not one of f32"),
    (lambda: EngineConfig(kv_type=None), "kv_type None is not one of f32"),
    (lambda: resolve_engine(prefill_chunk=96), "prefill_chunk 96 must be a positive multiple of 64"),
    (lambda: EngineConfig(prefill_chunk=0), "prefill_chunk 0 must be a positive multiple of 64"),
    (lambda: resolve_kernels(numerics="approx"), "numerics must be one of exact, fast"),
    (lambda: KernelConfig(numerics="approx"), "numerics 'approx'"),
    (lambda: KernelConfig(impl="pallas", interpret=True, mgpu="only"), "needs impl 'pallas' on a Hopper GPU"),
    (lambda: KernelConfig(mgpu="both"), "mgpu layout 'both'"),
    (lambda: KernelConfig(impl="reference", interpret=True), "interpret mode is for the Pallas kernels"),
    (lambda: KernelConfig(small_rows=-1), "small_rows -1"),
])
def test_bad_choices_are_refused(call, message):
    with pytest.raises(ConfigError, match=message):
        call()


def test_a_kernel_config_is_a_hashable_static_value():
    """Frozen and hashable: it is a static argument of every jitted function, so part of each jit cache key."""
    kcfg = resolve_kernels(device="hopper")
    assert hash(kcfg) == hash(dataclasses.replace(kcfg)) and kcfg != dataclasses.replace(kcfg, small_rows=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        kcfg.impl = "reference"
