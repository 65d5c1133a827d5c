"""The tensor-parallel target on 4 CPU devices, run as its own process by tests/test_parallel.py: XLA's device count is
fixed when jax starts, and the suite's processes have one. Prints a JSON object of what one device and 2- and 4-way
meshes give (greedy ids, prefill logits' error against one device's), which the test checks."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dflash_jax.config import EngineConfig, ParallelConfig  # noqa: E402
from dflash_jax.engine.generate import Engine  # noqa: E402
from dflash_jax.engine.prefill import prefill_chunks  # noqa: E402
from dflash_jax.engine.state import rewind  # noqa: E402
from dflash_jax.load import load_draft, load_target  # noqa: E402
from dflash_jax.testing.oracle import OracleDrafter  # noqa: E402
from dflash_jax.testing.tiny import random_target, tiny_target_config  # noqa: E402

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


def fixture_cases() -> dict:
    """The fixture pair (2 KV heads, 2 key heads): a 2-way mesh's AR and DDTree ids (the reference's are in
    ref.npz), its prompt's last logits against one device's."""
    target = load_target(TINY / "model-q4_k_m.gguf", progress=False)
    draft = load_draft(TINY / "draft-full", target.config, progress=False)
    ids = np.load(TINY / "tokens.npy")
    one = Engine.from_loaded(target, None, EngineConfig(mode="ar", max_ctx=MAX_CTX))
    two = Engine.from_loaded(target, None, EngineConfig(mode="ar", max_ctx=MAX_CTX), ParallelConfig(2))
    tree = Engine.from_loaded(target, draft, EngineConfig(mode="ddtree", budget=8, max_ctx=MAX_CTX),
                              ParallelConfig(2))
    return dict(ar2=two.generate(ids, N_GEN).tokens,
                ddtree2=tree.generate(ids, N_GEN).tokens,
                logit_err2=rel_err(prefill_logits(two, ids), prefill_logits(one, ids)))


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
            out["resumed2"] = resumed(mesh, ids)
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
    print(json.dumps(dict(devices=jax.device_count(), fixture=fixture_cases(), wide=wide_cases())))
