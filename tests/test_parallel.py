"""The target tensor-parallel over several devices (dflash_jax/parallel.py): the refusals, the value heads' order, and
(in a process of 4 CPU devices, tests/mesh_cases.py) 2- and 4-way meshes giving one device's logits and greedy ids, a
target loaded straight into its shards, and the sharded step with the GPU kernels lowering for CUDA."""

import json
import os
import re
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


def mesh_cases(*args: str) -> dict:
    """The JSON object tests/mesh_cases.py prints, run in a process of 4 CPU devices."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "mesh_cases.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def mesh_run():
    return mesh_cases()


def test_a_target_loads_straight_into_its_shards(mesh_run):
    """`load_sharded` on a 2-way mesh: each device holds its shard (the split tensors' halves and the replicated
    ones), device 0 no more than device 1 and far less than the whole target, the devices off the mesh nothing; every
    weight is one global array over the mesh; the commands load it so (its greedy ids: the fixture's test)."""
    run = mesh_run["load"]
    held, whole = run["held"], run["whole"]
    assert held[0] == held[1] and held[2] == held[3] == 0
    assert whole / 2 < held[0] < 0.75 * whole  # the embedding is whole on both, every split tensor halved
    assert run["placed"] and run["loaded"] == "ShardedTarget"
    assert run["synthetic_equal"]  # bench's synthetic target made straight into its shards: the split whole one's


def test_a_tied_head_is_split_from_the_embedding(mesh_run):
    """Without output.weight each shard's head is its rows of the embedding, in mesh order (the head's all-gather of
    the logits is the fixture's test)."""
    has_head, by_rows, equal = mesh_run["load"]["tied"]
    assert not has_head and by_rows and equal


def test_the_caches_are_checked_against_each_devices_share(mesh_run):
    """`state_bytes(per_device=True)` is what device 0 holds of an allocated state, half the caches' total on 2
    devices; a context whose share does not fit a device is refused naming it."""
    total, per_device, on_device0 = mesh_run["load"]["state_bytes"]
    assert per_device == on_device0 and total / 2 <= per_device < total
    assert re.fullmatch(r"a context of 17179869184 tokens needs [\d.]+ GiB of caches on each device, but device \d, "
                        r"one of the 2 it is split over, has [\d.]+ GiB free \(lower --max_ctx or --n_gen\)",
                        mesh_run["load"]["refusal"])


def test_the_sharded_step_lowers_for_cuda_with_the_gpu_kernels():
    """The step (AR and DDTree) of a target sharded 2 ways, with a Hopper's kernels and Q4_K/Q8_0 matrices, lowers
    for CUDA inside shard_map on a mesh of CPU devices: the Triton kernels (attention, conv, Gated DeltaNet, the
    Q8_0 products) and the Mosaic GPU Q4_K product inside the shard_map body, one all-reduce per layer's mixer and
    MLP, one all-gather of the head's logits."""
    run = mesh_cases("lowering")
    for mode, product in (("ar", "gemv_q8_0"), ("ddtree", "qmatmul_q8_0")):
        lowered = run[mode]
        assert {"tree_attention", "tree_conv", "gdn_blocks", "gdn_commit", product} <= set(lowered["kernels"]), mode
        assert "mosaic_gpu_v2" in lowered["calls"], mode
        assert lowered["all_reduce"] == 2 * 4 and lowered["all_gather"] == 1 and lowered["shard_map"] == 1, mode
        # nothing placed by the SPMD partitioner around it: the weights and the state enter as they lie
        assert set(lowered["outside"]) <= {"stablehlo.constant", "stablehlo.broadcast_in_dim", "return"}, mode
        assert lowered["resharded"] == [], mode


def test_the_sharded_step_moves_only_the_partial_sums_and_the_logits(mesh_run):
    """The AR and DDTree steps of a 2-way mesh compiled (CPU): between the devices only two all-reduces a layer of
    the block's hidden rows [N, H] (after o_proj / out_proj and after down_proj) and all-gathers of logits [rows, V]
    (the verify's; DDTree's also the drafter's rows through the target's head); every array of the donated state is
    written in place (no copy of the caches)."""
    run = mesh_run["hlo"]
    for mode in ("ar", "ddtree"):
        step = run[mode]
        moved, rows = step["collectives"], step["nodes"]
        assert set(moved) == {"all-reduce", "all-gather"}, mode
        assert moved["all-reduce"] == [f"f32[{rows},{run['hidden']}]"] * (2 * run["layers"]), mode
        logits = [rows] + ([step["draft_rows"]] if mode == "ddtree" else [])
        assert sorted(moved["all-gather"]) == sorted(f"f32[{n},{run['vocab']}]" for n in logits), mode
        assert step["aliased"] == step["state_arrays"], mode


def test_a_sharded_generation_compiles_its_functions_once(mesh_run):
    """Three generations on a 2-way mesh (one, then its continuations from a restored Snapshot and a rewound Mark)
    compile the step, the prefill chunk and the state's allocation once each: the first step's arguments are placed
    as later steps' are (replicated scalars and stop ids), and the state's allocation is one jitted function."""
    compiles = mesh_run["wide"]["compiles2"]
    assert [compiles.get(f"jit({name})") for name in ("run", "chunk", "init_state")] == [1, 1, 1]


def test_the_fixture_on_two_devices_decodes_the_reference_greedy_ids(mesh_run):
    """The fixture pair loaded into a 2-way mesh: AR and DDTree emit HF's greedy ids; its prompt logits are one
    device's to float32 rounding (the all-reduces sum in another order), and so is the top-2 gap bench.py reports
    where a run leaves AR's tokens."""
    run = mesh_run["fixture"]
    want = np.load(TINY / "ref.npz")["hf_q_greedy"][:len(run["ar2"])].tolist()
    assert mesh_run["devices"] == 4
    assert run["ar2"] == want and run["ddtree2"] == want
    assert run["logit_err2"] < 1e-5
    # bench.py's margin at a difference scores a sharded target on its mesh (it once scored it as one device's)
    assert abs(run["margin2"] - run["margin1"]) <= 1e-4 * max(1.0, abs(run["margin1"]))
    assert "sharded over 2 device(s)" in run["wrong_devices"]


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
