"""The target tensor-parallel over several devices (dflash_jax/parallel.py): the refusals, the value heads' order, and
(in a process of 4 CPU devices, tests/mesh_cases.py) 2- and 4-way meshes giving one device's logits and greedy ids."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import ROOT, TINY
from dflash_jax.config import ConfigError, EngineConfig, ParallelConfig
from dflash_jax.engine.generate import Engine
from dflash_jax.parallel import check_split, local_config, parallel_config, value_heads
from dflash_jax.testing.random_weights import random_qtensor
from dflash_jax.testing.tiny import random_target, tiny_target_config

CFG = tiny_target_config(num_layers=2, interval=2, vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=4,
                         num_kv_heads=2, head_dim=16, rope_dim=8, linear_num_key_heads=2, linear_num_value_heads=6,
                         linear_key_head_dim=16, linear_value_head_dim=16)


@pytest.fixture(scope="module")
def mesh_run():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "mesh_cases.py")], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_fixture_on_two_devices_decodes_the_reference_greedy_ids(mesh_run):
    """The fixture pair over a 2-way mesh: AR and DDTree emit HF's greedy ids; its prompt logits are one device's to
    float32 rounding (the all-reduces sum in another order)."""
    run = mesh_run["fixture"]
    want = np.load(TINY / "ref.npz")["hf_q_greedy"][:len(run["ar2"])].tolist()
    assert mesh_run["devices"] == 4
    assert run["ar2"] == want and run["ddtree2"] == want
    assert run["logit_err2"] < 1e-5


def test_a_four_kv_head_target_on_two_and_four_devices_matches_one(mesh_run):
    """A random target of 4 KV heads and 4/8 GDN key/value heads (value heads permuted across the shards) over 2- and
    4-way meshes: logits as one device's, AR and DDTree (deep accepted paths, from a drafter that knows the answer)
    emit one device's greedy ids."""
    run = mesh_run["wide"]
    for n in (2, 4):
        assert run[f"logit_err{n}"] < 1e-5, n
        assert run[f"ddtree{n}"] == run["ref"], n
        assert run[f"accept{n}"] > 2, n  # the commits took paths deeper than the root
    assert run["ar4"] == run["ref"]


def test_a_sharded_state_resumes_from_a_snapshot_and_a_mark(mesh_run):
    """The server's prefix cache and chat's regenerate on a 2-way mesh: a Snapshot restored and a Mark rewound (their
    copies of the sharded caches and recurrent state) continue as one device's do."""
    run = mesh_run["wide"]
    assert run["resumed2"] == run["resumed"] and run["resumed"][0] == run["ref"][:4]


def test_value_heads_follow_their_key_heads():
    """Each shard's value heads read its key heads in its local tiling (value head j reads key head j mod nk_l),
    and the shards together hold every value head once."""
    cfg = tiny_target_config(linear_num_key_heads=4, linear_num_value_heads=12)
    for n in (1, 2, 4):
        heads = [value_heads(cfg, n, s) for s in range(n)]
        assert sorted(np.concatenate(heads).tolist()) == list(range(12))
        local = 4 // n
        for s, vh in enumerate(heads):
            assert (vh % 4).tolist() == [s * local + j % local for j in range(len(vh))]
    assert value_heads(cfg, 2, 1).tolist() == [2, 3, 6, 7, 10, 11]


def test_heads_that_do_not_divide_are_refused():
    with pytest.raises(ConfigError, match="2 KV heads do not split 4 ways"):
        check_split(CFG, {}, 4)
    with pytest.raises(ConfigError, match="2 Gated DeltaNet key heads do not split 4 ways"):
        check_split(tiny_target_config(num_kv_heads=4, num_heads=8), {}, 4)
    check_split(CFG, {}, 2)
    local = local_config(CFG, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 32)
    assert (local.linear_num_key_heads, local.linear_num_value_heads, local.conv_dim) == (1, 3, 80)


def test_a_quantized_projection_split_off_its_blocks_is_refused():
    """A Q4_K down projection of 512 input columns splits 2 ways (256 each), not 4 (128: half a super-block)."""
    cfg = tiny_target_config(num_kv_heads=4, num_heads=8, linear_num_key_heads=4, linear_num_value_heads=8,
                             intermediate_size=512)
    down = {"blk.0.ffn_down.weight": random_qtensor(jax.random.PRNGKey(0), "Q4_K", (256, 512))}
    check_split(cfg, down, 2)
    with pytest.raises(ConfigError, match="ffn_down.weight is Q4_K, whose blocks of 256 columns do not split into "
                                          "slices of 128 columns"):
        check_split(cfg, down, 4)


def test_more_devices_than_present_and_bad_counts_are_refused():
    present = jax.local_device_count()
    with pytest.raises(ConfigError, match=f"--devices {present + 1}: only {present} local device"):
        parallel_config(str(present + 1))
    if present == 1:  # an engine asked for 2 devices on this machine's one (CFG splits 2 ways)
        with pytest.raises(ConfigError, match="--devices 2: only 1 local device"):
            Engine(CFG, random_target(CFG, seed=0), EngineConfig(mode="ar", max_ctx=32), parallel=ParallelConfig(2))
    for bad, match in (("two", "should be a device count"), ("0", "must be at least 1"), ("-1", "must be at least 1")):
        with pytest.raises(ConfigError, match=match):
            parallel_config(bad)
    assert parallel_config("all").devices == present and parallel_config("1") == ParallelConfig()
