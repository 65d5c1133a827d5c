"""The target's KV cache in each type (dflash_jax/kv_quant.py) through the engine: q8_0 decodes what bf16 decodes on the
fixture pair in every mode, speculative decoding stays exact on the low-bit types (reference and interpret-mode
kernels), the state's bytes are the type's, the interpret-mode kernels read every type, the GPU step lowers with a
block type, and the step writes a quantized cache in place."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY, TINY_GGUF
from dflash_jax import kv_quant as kvq
from dflash_jax.config import KV_TYPES, MAX_TREE_NODES, EngineConfig, KernelConfig
from dflash_jax.engine.generate import Engine
from dflash_jax.engine.prefill import prefill, split_weights
from dflash_jax.engine.state import DecodeState
from dflash_jax.engine.step import MAX_STOP_IDS, make_step
from dflash_jax.kernels import REFERENCE
from dflash_jax.load import load_draft, load_target
from dflash_jax.models.target import init_state
from dflash_jax.testing.oracle import OracleDrafter
from dflash_jax.engine.state import tree_bytes
from dflash_jax.testing.tiny import random_target, tiny_target_config

N_GEN, MAX_CTX = 16, 128
CFG = tiny_target_config(num_layers=4, interval=2, vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_heads=2, num_kv_heads=1, head_dim=32, rope_dim=8, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_num_value_heads=4)


@pytest.fixture(scope="module")
def pair():
    target = load_target(TINY_GGUF, progress=False)
    return target, load_draft(TINY / "draft-full", target.config, progress=False)


@pytest.fixture(scope="module")
def bf16_greedy(pair):
    engine = Engine.from_loaded(*pair, EngineConfig(mode="ar", max_ctx=MAX_CTX, kv_type="bf16"))
    return engine.generate(np.load(TINY / "tokens.npy"), N_GEN).tokens


@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
def test_q8_0_decodes_what_bf16_decodes_on_the_fixture_pair(pair, bf16_greedy, mode):
    """bf16's greedy continuation is the reference's (HF transformers on the same weights); q8_0 gives it too."""
    assert bf16_greedy == np.load(TINY / "ref.npz")["hf_q_greedy"][:N_GEN].tolist()
    engine = Engine.from_loaded(*pair, EngineConfig(mode=mode, budget=8, max_ctx=MAX_CTX, kv_type="q8_0"))
    assert engine.generate(np.load(TINY / "tokens.npy"), N_GEN).tokens == bf16_greedy


@pytest.fixture(scope="module")
def params():
    return random_target(CFG, seed=4)


def prompt(seed):
    rng = np.random.default_rng(200 + seed)
    return rng.integers(10, CFG.vocab_size, int(rng.choice([5, 40, 70])))


def tree_equals_ar(params, kv_type: str, prompts: int, n_gen: int, kcfg: KernelConfig = REFERENCE,
                   v_type: str | None = None):
    """Each of the first `prompts` prompts decoded by AR, then by a DDTree over an oracle drafter's proposals of AR's
    continuation (deep paths, sibling branches), both with the same cache types (the values in `v_type` if given) and
    kernels: the tree must emit what AR emits. Returns [(prompt, AR's tokens)] and the tree's acceptance lengths."""
    types = dict(max_ctx=MAX_CTX, kv_type=kv_type, kv_type_v=v_type)
    ar = Engine(CFG, params, EngineConfig(mode="ar", **types), kcfg=kcfg)
    tree = Engine(CFG, params, EngineConfig(mode="ddtree", budget=8, topk=4, **types),
                  OracleDrafter(8, CFG.vocab_size, 0.25, seed=1), None, kcfg=kcfg)
    pairs, lengths = [], []
    for seed in range(prompts):
        ids, want = prompt(seed), ar.generate(prompt(seed), n_gen).tokens
        sequence = np.zeros(MAX_CTX, np.int32)
        sequence[:len(ids) + len(want)] = np.concatenate([ids, want])
        tree.dparams = {"sequence": jnp.asarray(sequence)}
        out = tree.generate(ids, n_gen)
        assert out.tokens == want, seed
        pairs.append((ids, want))
        lengths += out.accept_lengths
    return pairs, lengths


@pytest.mark.parametrize("kv_type, v_type", [("q4_0", None), ("rq3_0", None), ("rq4_0", None), ("q4_0", "bf16")])
def test_speculative_decoding_stays_exact_on_low_bit_caches(params, kv_type, v_type):
    """A DDTree emits what AR emits with the same cache types (q4_0 keys beside bf16 values too): the tree's keys are
    read as the cache will hold them. The type does change the output (from f32's), so the quantization is in the
    path."""
    pairs, lengths = tree_equals_ar(params, kv_type, 4, 24, v_type=v_type)
    f32 = Engine(CFG, params, EngineConfig(mode="ar", max_ctx=MAX_CTX, kv_type="f32"))
    assert any(f32.generate(ids, 24).tokens != want for ids, want in pairs) and max(lengths) >= 5


def test_speculative_decoding_stays_exact_with_the_interpret_kernels(params):
    """As above with the Pallas kernels in interpret mode, on the rotated type: the tree-attention kernel decodes the
    tree's own blocks as it decodes the cache's (and rotates the queries and outputs of both alike), so a DDTree
    emits what AR emits."""
    _, lengths = tree_equals_ar(params, "rq3_0", 2, 16, KernelConfig(impl="pallas", interpret=True))
    assert max(lengths) >= 4


@pytest.mark.parametrize("kv_type", KV_TYPES)
def test_state_bytes_are_the_types(pair, kv_type):
    """The state counts the target's K and V and the drafter's context cache at the type's bits per value against
    the float32 state, from shapes alone."""
    target, draft = pair
    ecfg = EngineConfig(mode="ddtree", max_ctx=256, kv_type=kv_type)
    got = Engine.from_loaded(*pair, ecfg).state_bytes()
    f32 = Engine.from_loaded(*pair, EngineConfig(mode="ddtree", max_ctx=256, kv_type="f32")).state_bytes()
    cfg, dcfg, t = target.config, draft.config, kvq.kv_type(kv_type)
    values = 2 * len(cfg.full_attention_layers) * (256 + MAX_TREE_NODES) * cfg.num_kv_heads * cfg.head_dim
    draft_values = 2 * dcfg.num_layers * 256 * dcfg.num_kv_heads * dcfg.head_dim
    assert got == f32 - (values + draft_values) * (4 - t.bits / 8)


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_keys_and_values_of_different_types_decode_what_ar_decodes(pair, mode):
    """q8_0 keys beside bf16 values: the target's and the drafter's keys are blocks and their values arrays, the
    state counts each at its type, and greedy speculative decoding emits what AR emits with the same caches."""
    target, draft = pair
    ecfg = EngineConfig(mode="ar", max_ctx=MAX_CTX, kv_type="bf16", kv_type_k="q8_0")
    ids = np.load(TINY / "tokens.npy")
    want = Engine.from_loaded(target, None, ecfg).generate(ids, N_GEN).tokens
    engine = Engine.from_loaded(*pair, dataclasses.replace(ecfg, mode=mode, budget=8))
    gen = engine.generate(ids, N_GEN)
    assert gen.tokens == want  # the fixture's drafter is random: the oracle test below has the deep paths
    t, d = gen.state.target, gen.state.draft
    assert isinstance(t.k, kvq.KVBlocks) and t.k.kind == "q8_0" and t.v.dtype == jnp.bfloat16
    assert [c.kind for c in d.k] == ["q8_0"] and [c.dtype for c in d.v] == [jnp.bfloat16]
    cfg, dcfg = target.config, draft.config
    values = len(cfg.full_attention_layers) * (MAX_CTX + MAX_TREE_NODES) * cfg.num_kv_heads * cfg.head_dim
    values += dcfg.num_layers * MAX_CTX * dcfg.num_kv_heads * dcfg.head_dim  # K (and V) of each
    f32 = Engine.from_loaded(*pair, EngineConfig(mode=mode, max_ctx=MAX_CTX)).state_bytes()
    assert engine.state_bytes() == f32 - values * (4 - 8.5 / 8) - values * 2


@pytest.mark.parametrize("k_type, v_type", [("q8_0", "bf16"), ("f32", "rq3_0")])
def test_the_interpret_kernels_read_keys_and_values_of_different_types(params, k_type, v_type):
    """A prompt's second chunk over a first chunk's keys and values of different types (one a block type, one a
    float type): the Pallas kernels in interpret mode give the reference path's logits, to their bf16 products."""
    ids = np.random.default_rng(10).integers(10, CFG.vocab_size, 80).tolist()
    _, _, state = prefill(params, CFG, init_state(CFG, 128, k_type, v_type), ids[:64])

    def logits(kcfg):
        out, _, _ = prefill(params, CFG, jax.tree.map(jnp.copy, state), ids[64:], kcfg=kcfg)
        return np.asarray(out)

    ref, interp = logits(REFERENCE), logits(KernelConfig(impl="pallas", interpret=True))
    assert 0 < np.linalg.norm(interp - ref) / np.linalg.norm(ref) < 5e-3


def test_the_interpret_kernels_read_a_rotated_cache(params):
    """A prompt's second chunk over the rq3_0 blocks of its first (written by the reference path): the Pallas
    kernels in interpret mode decode them tile by tile (the chunk's own rows too) and give the reference path's
    logits, to the kernels' bf16 products."""
    ids = np.random.default_rng(9).integers(10, CFG.vocab_size, 80).tolist()  # chunks of 64 and 16
    _, _, state = prefill(params, CFG, init_state(CFG, 128, "rq3_0"), ids[:64])

    def logits(kcfg):
        out, _, _ = prefill(params, CFG, jax.tree.map(jnp.copy, state), ids[64:], kcfg=kcfg)
        return np.asarray(out)

    ref, interp = logits(REFERENCE), logits(KernelConfig(impl="pallas", interpret=True))
    assert 0 < np.linalg.norm(interp - ref) / np.linalg.norm(ref) < 5e-3
    assert int(np.argmax(ref)) == int(np.argmax(interp))


@pytest.mark.parametrize("mode, kv_type", [("ar", "q8_0"), ("ddtree", "rq3_0")])
def test_the_gpu_step_lowers_with_a_block_type(params, mode, kv_type):
    """The step with the Pallas GPU kernels (not interpret mode) over a block-type cache lowers for CUDA without a
    GPU, its attention on the tree-attention kernel (no refusal, no fallback to the reference)."""
    max_ctx = 256
    drafter = OracleDrafter(8, CFG.vocab_size, 0.25) if mode != "ar" else None
    (tgraph, tweights), (dgraph, dweights) = split_weights(params), split_weights(
        {"sequence": jnp.zeros(max_ctx, jnp.int32)} if drafter else None)
    state = DecodeState(target=init_state(CFG, max_ctx + MAX_TREE_NODES, kv_type), draft=None,
                        root=jnp.int32(1), remaining=jnp.int32(10), done=jnp.bool_(False))
    step = make_step(CFG, drafter, EngineConfig(mode=mode, budget=8, max_ctx=max_ctx, kv_type=kv_type), tgraph,
                     dgraph, KernelConfig(impl="pallas"))
    hlo = step.trace(tweights, dweights, state, jnp.full(MAX_STOP_IDS, -1, jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert 'name = "tree_attention"' in hlo


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_the_step_writes_a_quantized_cache_in_place(params, mode):
    """The compiled step aliases the whole q4_0 state to its output (the commit moves blocks within the donated
    cache), and its temporaries are those of the float32 cache's step (the reference attention's own, over a
    dequantized layer): no copy of the blocks."""
    max_ctx = 4096
    drafter = OracleDrafter(8, CFG.vocab_size, 0.25) if mode != "ar" else None
    (tgraph, tweights), (dgraph, dweights) = split_weights(params), split_weights(
        {"sequence": jnp.zeros(max_ctx, jnp.int32)} if drafter else None)
    memory = {}
    for kv_type in ("q4_0", "f32"):
        state = DecodeState(target=init_state(CFG, max_ctx + MAX_TREE_NODES, kv_type), draft=None,
                            root=jnp.int32(1), remaining=jnp.int32(10), done=jnp.bool_(False))
        step = make_step(CFG, drafter, EngineConfig(mode=mode, budget=22, max_ctx=max_ctx, kv_type=kv_type), tgraph,
                         dgraph)
        memory[kv_type] = step.lower(tweights, dweights, state,
                                     jnp.full(MAX_STOP_IDS, -1, jnp.int32)).compile().memory_analysis()
        assert memory[kv_type].alias_size_in_bytes == tree_bytes(state), kv_type
    assert memory["q4_0"].temp_size_in_bytes < 1.01 * memory["f32"].temp_size_in_bytes
