"""The tensor-parallel target on 4 CPU devices, run as its own process by tests/test_parallel.py: XLA's device count is
fixed when jax starts, and the suite's processes have one. Prints a JSON object of what one device and 2- and 4-way
meshes give (greedy ids, prefill logits' error against one device's, where a loaded target's bytes lie, how often the
step compiled, the compiled step's collectives), which the test checks; with the argument `lowering`, what the sharded
step with the GPU kernels lowers to for CUDA instead."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from gguf import GGMLQuantizationType as GT  # noqa: E402

from dflash_jax.config import ConfigError, EngineConfig, ParallelConfig  # noqa: E402
from dflash_jax.defaults import resolve_kernels  # noqa: E402
from dflash_jax.engine.generate import Engine  # noqa: E402
from dflash_jax.engine.prefill import prefill_chunks, split_weights  # noqa: E402
from dflash_jax.engine.sampling import GREEDY  # noqa: E402
from dflash_jax.engine.state import DecodeState, rewind  # noqa: E402
from dflash_jax.engine.step import DFlashDrafter  # noqa: E402
from dflash_jax.errors import InputError  # noqa: E402
from dflash_jax.generate import check_memory, load_weights, open_models  # noqa: E402
from dflash_jax.kernels import REFERENCE  # noqa: E402
from dflash_jax.load import load_draft, load_target, open_target  # noqa: E402
from dflash_jax.models.target import Target  # noqa: E402
from dflash_jax.parallel import ShardedTarget, load_sharded  # noqa: E402
from dflash_jax.quant import repack  # noqa: E402
from dflash_jax.testing import synthetic  # noqa: E402
from dflash_jax.testing.oracle import OracleDrafter  # noqa: E402
from dflash_jax.testing.quantize import quantize  # noqa: E402
from dflash_jax.profiling import CompileLog  # noqa: E402
from dflash_jax.testing.hlo import aliased_outputs, collectives, outside_shard_map, resharded_arguments  # noqa: E402
from exactness import margin  # noqa: E402 (scripts/)
from dflash_jax.testing.tiny import (random_draft, random_gguf_tensors, random_target, tiny_draft_config,  # noqa: E402
                                     tiny_target_config)

TINY = ROOT / "tests" / "fixtures" / "tiny-qwen35"
N_GEN, MAX_CTX = 12, 128
# 4 KV heads, 4 Gated DeltaNet key heads / 8 value heads: splits 4 ways (the fixture's 2 KV heads split 2 ways)
WIDE = tiny_target_config(num_layers=4, interval=2, vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_heads=8, num_kv_heads=4, head_dim=16, rope_dim=8, linear_num_key_heads=4,
                          linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16)


def prefill_logits(engine: Engine, ids: np.ndarray) -> np.ndarray:
    """Each prompt chunk's last logits [chunks, V] through the engine's (sharded or not) prefill (the function its
    generation compiled)."""
    tstate, _ = engine._empty_states()
    return np.stack([np.asarray(logits) for _, logits, _, _ in prefill_chunks(engine.tsplit, engine.tcfg, tstate, ids,
                                                                               kcfg=engine.kcfg)])


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def fixture_cases(sharded: ShardedTarget, target: Target) -> dict:
    """The fixture pair (2 KV heads, 2 key heads), its target loaded into a 2-way mesh (`load_cases`) and whole on
    one device: the mesh's AR and DDTree ids (the reference's are in ref.npz), its prompt's last logits against one
    device's, the top-2 logit gap after 4 tokens scored on the mesh and on one device, and the refusal to score the
    sharded target as one device's."""
    draft = load_draft(TINY / "draft-full", target.config, progress=False)
    ids = np.load(TINY / "tokens.npy")
    one = Engine.from_loaded(target, None, EngineConfig(mode="ar", max_ctx=MAX_CTX))
    two = Engine.from_loaded(sharded, None, EngineConfig(mode="ar", max_ctx=MAX_CTX), ParallelConfig(2))
    tree = Engine.from_loaded(sharded, draft, EngineConfig(mode="ddtree", budget=8, max_ctx=MAX_CTX),
                              ParallelConfig(2))
    ar2 = two.generate(ids, N_GEN).tokens
    # bench.py's top-2 logit gap where a sharded DDTree run leaves AR's tokens: scored on the mesh, as on one device
    gaps = [margin(model, ids.tolist(), ar2[:4], GREEDY, ("f32", "f32"), parallel)["margin"]
            for model, parallel in ((sharded, ParallelConfig(2)), (target, None))]
    wrong_devices = ""
    try:
        margin(sharded, ids.tolist(), ar2[:4], GREEDY, ("f32", "f32"))
    except ConfigError as e:
        wrong_devices = str(e)
    return dict(ar2=ar2,
                ddtree2=tree.generate(ids, N_GEN).tokens,
                logit_err2=rel_err(prefill_logits(two, ids), prefill_logits(one, ids)),
                margin2=gaps[0], margin1=gaps[1], wrong_devices=wrong_devices)


def live_bytes() -> list[int]:
    """Bytes of the live arrays on each device, each buffer once (a global array and its blocks share theirs)."""
    gc.collect()
    seen = {(s.device.id, s.data.unsafe_buffer_pointer()): s.data.nbytes
            for a in jax.live_arrays() for s in a.addressable_shards}
    return [sum(b for (d, _), b in seen.items() if d == i) for i in range(jax.device_count())]


def load_cases() -> tuple[dict, ShardedTarget, Target]:
    """The fixture loaded straight into a 2-way mesh (`load_sharded`), before anything else lives on the devices:
    the bytes each device then holds (against one device's whole target), whether every weight is a global array
    over the mesh with each split one's blocks 1/2 of it; the commands' loader's result; a context too large for a
    device refused; a state's bytes on a device against `state_bytes(per_device=True)`; a tied head (no
    output.weight): split by rows, its shards' rows in mesh order the embedding. Returns them, the sharded target and
    the whole one (for `fixture_cases`)."""
    source, pcfg, ar = open_target(TINY / "model-q4_k_m.gguf"), ParallelConfig(2), EngineConfig(mode="ar",
                                                                                                 max_ctx=MAX_CTX)
    before = live_bytes()
    sharded = load_sharded(source, REFERENCE, pcfg, progress=False)
    held = [a - b for a, b in zip(live_bytes(), before)]
    mesh = set(jax.devices()[:2])
    placed = all(x.sharding.device_set == mesh and (x.sharding.is_fully_replicated or (
        x.sharding.spec == P("tp") and x.addressable_shards[0].data.shape[0] * 2 == x.shape[0]))
        for x in jax.tree.leaves(sharded.weights))
    target = load_target(source, progress=False)
    whole = sum(x.nbytes for x in jax.tree.leaves(split_weights(target)[1]))
    engine = Engine.from_loaded(sharded, None, ar, pcfg, REFERENCE)
    out = dict(held=held, whole=whole, placed=placed)
    tstate, _ = engine._empty_states()
    out["state_bytes"] = [engine.state_bytes(), engine.state_bytes(per_device=True),
                          sum(s.data.nbytes for x in jax.tree.leaves(tstate) for s in x.addressable_shards
                              if s.device == jax.devices()[0])]
    del tstate
    try:  # caches of 2**34 tokens: more than any device has free
        check_memory(Engine.from_loaded(sharded, None, dataclasses.replace(ar, max_ctx=2**34), pcfg, REFERENCE))
    except InputError as e:
        out["refusal"] = str(e)
    del engine
    models = load_weights(open_models(str(TINY / "model-q4_k_m.gguf"), None, "ar"), REFERENCE, False, pcfg)
    out["loaded"] = type(models.target).__name__
    tied = dataclasses.replace(WIDE, num_layers=2, layer_types=WIDE.layer_types[:2], tie_word_embeddings=True)
    tensors = random_gguf_tensors(tied, seed=5)
    head = ShardedTarget.from_tensors(tied, tensors.items(), REFERENCE, pcfg).weights["lm_head"]["weight"]
    out["tied"] = ["output.weight" in tensors, head.sharding.spec == P("tp"),
                   bool(np.array_equal(np.asarray(head), tensors["token_embd.weight"]))]
    # bench's synthetic target made straight into its shards, against the whole one split
    cfg = tiny_target_config(num_layers=4, vocab_size=2048)
    straight = synthetic.synthetic_sharded(cfg, REFERENCE, pcfg).weights
    split = ShardedTarget.over(synthetic.synthetic_target(cfg), REFERENCE, pcfg).weights
    out["synthetic_equal"] = all(a.sharding == b.sharding and bool(np.array_equal(a, b))
                                 for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(split), strict=True))
    return out, sharded, target


def lowering_cases() -> dict:
    """The step of a target sharded 2 ways with a Hopper's kernel configuration (Pallas: Triton and Mosaic GPU), its
    MLP's row-split gate and up Q4_K and its column-split down Q8_0 (one shape each: each packing compiles), a q8_0
    KV cache, lowered for CUDA (no GPU needed): the kernels and collectives each mode's program holds."""
    cfg = dataclasses.replace(WIDE, hidden_size=256, head_dim=32)
    kcfg, pcfg = resolve_kernels("ddtree", device="hopper"), ParallelConfig(2)
    tensors = random_gguf_tensors(cfg, seed=6)
    for name in tensors:
        base = name.split(".", 2)[-1]
        kind = {"ffn_gate.weight": GT.Q4_K, "ffn_up.weight": GT.Q4_K, "ffn_down.weight": GT.Q8_0}.get(base)
        if kind is not None:
            tensors[name] = repack(quantize(tensors[name], kind), kind, tensors[name].shape)
    sharded = ShardedTarget.from_tensors(cfg, tensors.items(), kcfg, pcfg)
    out = {}
    for mode in ("ar", "ddtree"):
        drafter = OracleDrafter(8, cfg.vocab_size, 0.25) if mode != "ar" else None
        engine = Engine(cfg, sharded, EngineConfig(mode=mode, budget=8, max_ctx=MAX_CTX, kv_type="q8_0"), drafter,
                        {"sequence": jnp.zeros(MAX_CTX, jnp.int32)} if drafter else None, kcfg=kcfg, parallel=pcfg)
        hlo = engine.step.trace(engine.tweights, engine.dweights, step_state(engine), engine.stop_array(())
                                ).lower(lowering_platforms=("cuda",)).as_text()
        out[mode] = dict(kernels=sorted(set(re.findall(r'name = "(\w+)"', hlo))),
                         calls=sorted(set(re.findall(r"custom_call @(\w+)", hlo))),
                         all_reduce=hlo.count("stablehlo.all_reduce"), all_gather=hlo.count("stablehlo.all_gather"),
                         shard_map=hlo.count("sdy.manual_computation") + hlo.count("@shmap_body"),
                         outside=sorted(outside_shard_map(hlo)), resharded=resharded_arguments(hlo))
    return out


def step_state(engine: Engine) -> DecodeState:
    """A fresh decode state of the engine, placed as its step's outputs are (`Engine._start`)."""
    tstate, dstate = engine._empty_states()
    root, remaining, done = engine.tsplit.replicated((jnp.int32(1), jnp.int32(10), jnp.bool_(False)))
    return DecodeState(target=tstate, draft=dstate, root=root, remaining=remaining, done=done)


def hlo_cases() -> dict:
    """The AR and DDTree steps (a random DFlash drafter's) of the 4-KV-head target on a 2-way mesh, compiled for the
    CPU: each kind of collective with its result shapes, how many outputs write in place of the donated state, and
    how many arrays that state holds (tests/test_parallel.py checks them against the model's layers and widths)."""
    model, dcfg = random_target(WIDE, seed=3), tiny_draft_config(WIDE, block_size=8)
    out = dict(layers=WIDE.num_layers, hidden=WIDE.hidden_size, vocab=WIDE.vocab_size)
    for mode in ("ar", "ddtree"):
        drafter = DFlashDrafter(dcfg) if mode == "ddtree" else None
        engine = Engine(WIDE, model, EngineConfig(mode=mode, budget=8, max_ctx=MAX_CTX), drafter,
                        random_draft(dcfg, seed=4) if drafter else None, parallel=ParallelConfig(2))
        state = step_state(engine)
        hlo = engine.step.lower(engine.tweights, engine.dweights, state, engine.stop_array(())).compile().as_text()
        out[mode] = dict(collectives=collectives(hlo), aliased=aliased_outputs(hlo),
                         state_arrays=len(jax.tree.leaves(state)), nodes=1 if mode == "ar" else 9,
                         draft_rows=dcfg.block_size - 1)
    return out


def resumed(engine: Engine, ids: np.ndarray) -> list[list[int]]:
    """The ids a conversation's later turns emit from a restored Snapshot and from a rewound Mark (the server's
    prefix cache and chat's regenerate), as `engine` emits them."""
    first = engine.generate(ids, 4, snapshot_at=(32,), mark_at=36)
    restored = engine.generate(ids[32:], 4, after=engine.restore(first.snapshots[0]), keep_pending=False)
    rewound = engine.generate(ids[36:], 4, after=rewind(first.state, first.mark), keep_pending=False)
    return [first.tokens, restored.tokens, rewound.tokens]


def wide_cases() -> dict:
    """A random target with 4 KV heads: one device's AR ids, 2- and 4-way meshes' AR ids and logits, and their
    DDTree with a drafter that knows the answer (so the commits take deep paths)."""
    model = random_target(WIDE, seed=3)
    ids = np.random.default_rng(0).integers(10, WIDE.vocab_size, 40)
    ar = EngineConfig(mode="ar", max_ctx=MAX_CTX)
    one = Engine(WIDE, model, ar)
    ref = one.generate(ids, N_GEN).tokens
    sequence = np.zeros(MAX_CTX, np.int32)
    sequence[:len(ids) + N_GEN] = np.concatenate([ids, ref])
    out = dict(ref=ref)
    out["resumed"] = resumed(one, ids)
    for n in (2, 4):
        mesh = Engine(WIDE, model, ar, parallel=ParallelConfig(n))
        if n == 4:  # the fixture's AR runs on 2
            out["ar4"] = mesh.generate(ids, N_GEN).tokens
        else:
            with CompileLog() as log:  # a generation, its continuations from a Snapshot and a Mark: one program
                out["resumed2"] = resumed(mesh, ids)
            out["compiles2"] = dict(log.compiles)
        out[f"logit_err{n}"] = rel_err(prefill_logits(mesh, ids), prefill_logits(one, ids))
        tree = Engine(WIDE, model, EngineConfig(mode="ddtree", budget=8, topk=3, max_ctx=MAX_CTX),
                      OracleDrafter(8, WIDE.vocab_size, 0.25, seed=1), {"sequence": jnp.asarray(sequence)},
                      parallel=ParallelConfig(n))
        gen = tree.generate(ids, N_GEN)
        out[f"ddtree{n}"], out[f"accept{n}"] = gen.tokens, gen.mean_accept_length
    return out


if __name__ == "__main__":
    if os.environ.get("DFLASH_TEST_JIT_CACHE"):  # the suite's compilation cache (tests/conftest.py)
        jax.config.update("jax_compilation_cache_dir", os.environ["DFLASH_TEST_JIT_CACHE"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    if sys.argv[1:] == ["lowering"]:
        print(json.dumps(lowering_cases()))
    else:
        load, sharded, target = load_cases()  # first: the bytes on the devices are the loaded target's alone
        fixture = fixture_cases(sharded, target)
        print(json.dumps(dict(devices=jax.device_count(), load=load, fixture=fixture, wide=wide_cases(),
                              hlo=hlo_cases())))
