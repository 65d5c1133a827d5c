"""Target model against the fixture's HF and llama.cpp references, and tree verify / commit against plain prefill."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import KernelConfig
from dflash_jax.engine.prefill import prefill_chunks
from dflash_jax.load import load_target
from dflash_jax.models import target as T
from dflash_jax.models.target import init_state
from pallas_kernels import reference as ref

from conftest import TINY

verify = jax.jit(T.verify, static_argnums=(1, 5, 6))
commit = jax.jit(T.commit, static_argnums=(3,))
SLOTS = 160


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def model(tiny_gguf_path):
    m = load_target(tiny_gguf_path, progress=False)
    return m.config, m


def run_prefill(cfg, params, ids):
    """Prefill a prompt in fixed chunks of 64 (one compilation), returning all logits and the state."""
    logits = []
    for _, lg, _, state in prefill_chunks(params, cfg, init_state(cfg, SLOTS), ids, all_logits=True):
        logits.append(np.asarray(lg))
    return np.concatenate(logits), state


def test_prefill_matches_hf_and_llama_cpp(model):
    cfg, params = model
    ids = np.load(TINY / "tokens.npy")
    refs = np.load(TINY / "ref.npz")
    logits, state = run_prefill(cfg, params, ids)
    assert rel(logits, refs["hf_q_logits"]) < 1e-4
    assert rel(logits, refs["llama_q4_k_m_logits"]) < 0.1  # llama.cpp quantizes activations to 8 bits
    assert int(state.length) == len(ids)


def test_greedy_decode_matches_hf(model):
    cfg, params = model
    ids = np.load(TINY / "tokens.npy")
    want = np.load(TINY / "ref.npz")["hf_q_greedy"]
    logits, state = run_prefill(cfg, params, ids)
    tok, out = int(np.argmax(logits[-1])), []
    for _ in range(len(want)):
        out.append(tok)
        lg, _, state, ver = verify(params, cfg, state, jnp.array([tok], jnp.int32), jnp.array([-1], jnp.int32), ())
        state = commit(state, ver, jnp.int32(0))
        tok = int(np.argmax(np.asarray(lg)[0]))
    assert out == list(want)


def random_tree(rng, n):
    parents = [-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, n)]
    return np.array(parents, np.int32)


def path_to(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_verify_equals_prefill_of_each_path(model, seed):
    cfg, params = model
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg.vocab_size, 37)
    n = 16
    tokens = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
    parents = random_tree(rng, n)
    _, state = run_prefill(cfg, params, prompt)
    tree_logits, _, _, _ = verify(params, cfg, state, jnp.asarray(tokens), jnp.asarray(parents), ())
    for node in range(n):
        seq = np.concatenate([prompt, tokens[path_to(parents, node)]])
        plain, _ = run_prefill(cfg, params, seq)
        assert rel(np.asarray(tree_logits)[node], plain[-1]) < 1e-4, node


def test_commit_of_any_node_then_decode_equals_plain_sequence(model):
    cfg, params = model
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, cfg.vocab_size, 21)
    tokens = rng.integers(0, cfg.vocab_size, 12).astype(np.int32)
    parents = random_tree(rng, 12)
    _, state = run_prefill(cfg, params, prompt)
    _, _, verified_state, ver = verify(params, cfg, state, jnp.asarray(tokens), jnp.asarray(parents), ())
    for leaf in (0, 5, 11):
        after = commit(verified_state, ver, jnp.int32(leaf))
        nxt = np.int32(rng.integers(0, cfg.vocab_size))
        lg, _, _, _ = verify(params, cfg, after, jnp.array([nxt]), jnp.array([-1], jnp.int32), ())
        seq = np.concatenate([prompt, tokens[path_to(parents, leaf)], [nxt]])
        plain, _ = run_prefill(cfg, params, seq)
        assert int(after.length) == len(seq) - 1
        assert rel(np.asarray(lg)[0], plain[-1]) < 1e-4, leaf


def test_pallas_attention_and_gdn_verify_and_commit_like_the_reference(model):
    """The Pallas kernels (tree attention, the delta rule; interpret mode on CPU) on a 16-node tree, the matrices
    on the reference product."""
    cfg, params = model
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, 16).astype(np.int32))
    parents = jnp.asarray(random_tree(rng, 16))
    _, state = run_prefill(cfg, params, rng.integers(0, cfg.vocab_size, 37))
    out = {}
    for impl in ("reference", "pallas"):
        kcfg = KernelConfig(impl=impl, interpret=impl == "pallas")
        logits, _, verified_state, ver = verify(params, cfg, state, tokens, parents, (), kcfg)
        out[impl] = logits, commit(verified_state, ver, jnp.int32(13), kcfg)
    (lg, after), (lg_ref, after_ref) = out["pallas"], out["reference"]
    assert rel(lg, np.asarray(lg_ref)) < 2e-2  # attention products in bf16
    assert np.mean(np.argmax(lg, -1) == np.argmax(lg_ref, -1)) > 0.9
    assert rel(after.ssm, np.asarray(after_ref.ssm)) < 2e-2
    assert rel(after.k, np.asarray(after_ref.k)) < 2e-2 and int(after.length) == int(after_ref.length)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])
def test_chunked_gdn_equals_recurrence(n):
    rng = np.random.default_rng(n)
    h, dk, dv = 3, 16, 8
    k = rng.normal(size=(n, h, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q = rng.normal(size=(n, h, dk)) / np.sqrt(dk)
    v, g = rng.normal(size=(n, h, dv)), -rng.uniform(0, 1.5, (n, h))
    beta, s0 = rng.uniform(0, 1, (n, h)), rng.normal(size=(h, dk, dv))
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, s0)]
    o1, s1 = ref.gdn_chunked(*args)
    o2, s2 = ref.gdn_recurrent(*args)
    assert rel(o1, np.asarray(o2)) < 1e-5 and rel(s1, np.asarray(s2)) < 1e-5


def test_tree_block_masks_and_depths():
    block = T.tree_block(jnp.array([-1, 0, 0, 1, 3, 2], jnp.int32))
    np.testing.assert_array_equal(block.depth, [0, 1, 1, 2, 3, 2])
    np.testing.assert_array_equal(np.asarray(block.anc)[4], [1, 1, 0, 1, 1, 0])
    idx = np.asarray(T._conv_index(block, 4))  # rows of concat(3 committed inputs, 6 block inputs)
    np.testing.assert_array_equal(idx[4], [3 + 0, 3 + 1, 3 + 3, 3 + 4])
    np.testing.assert_array_equal(idx[2], [1, 2, 3 + 0, 3 + 2])


@pytest.mark.parametrize("n", [1, 2, 5, 23, 64])
def test_unit_lower_inverse(n):
    a = np.tril(np.random.default_rng(n).normal(0.0, 0.5, (2, n, n)), -1).astype(np.float32)
    got = np.asarray(ref.unit_lower_inverse(jnp.asarray(a)))
    want = np.linalg.inv(np.eye(n) + a.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sign", [1, -1])
def test_unit_lower_inverse_when_keys_align(sign):
    """A run of one repeated key (or its negation, alternating) with beta 0.95 gives a = 0.95 (+-1)^(i+j) below the
    diagonal: the inverse is bounded by 1, which a power series (the first implementation) got wrong by 4e9."""
    k = np.array([sign ** i for i in range(64)], np.float64)
    a = np.tril(0.95 * np.outer(k, k), -1)
    got = np.asarray(ref.unit_lower_inverse(jnp.asarray(a, jnp.float32)))
    np.testing.assert_allclose(got, np.linalg.inv(np.eye(64) + a), rtol=1e-5, atol=1e-5)
