"""Prefill in large chunks (issue 42): the fixture target's logits and state after a prompt in chunks of 256 and 512
(the gated delta rule and the attention over the cache blockwise, a padded tail) equal the 64-token chunks' and HF's;
an engine's drafter context and output do not depend on the chunk; on a GPU, the same with the GPU kernels."""

import jax
import numpy as np
import pytest

from dflash_jax.config import ConfigError, EngineConfig
from dflash_jax.defaults import resolve_kernels
from dflash_jax.engine.generate import Engine
from dflash_jax.engine.prefill import SplitTarget, prefill_chunks
from dflash_jax.engine.step import DFlashDrafter
from dflash_jax.load import load_target
from dflash_jax.models.target import init_state
from dflash_jax.testing.tiny import random_draft, tiny_draft_config

from conftest import TINY

SLOTS = 640
SAME = 1e-5  # measured 1.3e-6 (logits) on a CPU; the references' tolerance is 1e-4


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def prompt(vocab: int) -> np.ndarray:
    """The fixture's 48 tokens, then 552 random ones: 600, a padded last chunk at 64, 256 and 512."""
    return np.concatenate([np.load(TINY / "tokens.npy"), np.random.default_rng(0).integers(0, vocab, 552)])


def prefilled(model, ids, chunk, kv_types=("f32", None)):
    """(every position's logits, the state) of ids prefilled in chunks of `chunk`, the keys' and values' cache in
    `kv_types` (init_state's kv_type, v_type)."""
    cfg, logits = model.config, []
    for _, lg, _, state in prefill_chunks(model, cfg, init_state(cfg, SLOTS, *kv_types), ids, chunk=chunk,
                                          all_logits=True, kcfg=model.kcfg):
        logits.append(np.asarray(lg))
    return np.concatenate(logits), state


def assert_same_prefill(model, tol, length=600, chunks=(256, 512), kv_types=("f32", None)):
    """The first `length` tokens of `prompt` in each of `chunks` give the 64-token chunks' logits and state."""
    ids = prompt(model.config.vocab_size)[:length]
    logits, state = prefilled(model, ids, 64, kv_types)
    for chunk in chunks:
        got, got_state = prefilled(model, ids, chunk, kv_types)
        assert got.shape == logits.shape and rel(got, logits) < tol, (chunk, rel(got, logits))
        for name in ("k", "v", "conv", "ssm"):
            a, b = (jax.tree.leaves(getattr(s, name)) for s in (got_state, state))
            assert all(rel(x, y) < tol for x, y in zip(a, b)), (chunk, name)
        assert int(got_state.length) == len(ids)
    return logits


def layer_differences(model, ids, chunk) -> list[tuple[int, str, float]]:
    """(layer, its type, relative difference) of every layer's output over the prompt in chunks of `chunk` against
    64 (the prefill's taps at every layer): where a difference of the logits begins."""
    cfg, taps = model.config, tuple(range(model.config.num_layers))

    def hidden(size):
        rows = [np.asarray(t)[:n] for n, _, t, _ in prefill_chunks(model, cfg, init_state(cfg, SLOTS), ids,
                                                                     chunk=size, taps=taps, kcfg=model.kcfg)]
        return np.concatenate(rows)  # [tokens, layers, hidden]

    a, b = hidden(chunk), hidden(64)
    return [(i, cfg.layer_types[i], rel(a[:, i], b[:, i])) for i in taps]


@pytest.fixture(scope="module")
def model(tiny_gguf_path):
    return load_target(tiny_gguf_path, progress=False)


def test_large_chunks_give_the_64_token_chunks_logits_and_hfs(model):
    logits = assert_same_prefill(model, SAME)
    assert rel(logits[:48], np.load(TINY / "ref.npz")["hf_q_logits"]) < 1e-4


def test_every_layer_of_a_large_chunk_gives_the_64_token_chunks_output(model):
    ids = prompt(model.config.vocab_size)[:200]
    diffs = layer_differences(model, ids, 128)
    assert len(diffs) == model.config.num_layers and all(d < SAME for _, _, d in diffs), diffs


def test_a_chunk_that_is_not_a_multiple_of_64_is_refused(model):
    with pytest.raises(ConfigError, match="prefill_chunk 100 must be a positive multiple of 64"):
        next(prefill_chunks(model, model.config, init_state(model.config, SLOTS), [1, 2, 3], chunk=100))


def test_the_engine_and_its_drafter_context_do_not_depend_on_the_chunk(model):
    """The drafter's context is extended from each prefill chunk's taps: with a ring of 128 (draft_ctx 64), shorter
    than a chunk of 256 or 512, it holds what the 64-token chunks leave, and DDTree emits the same tokens."""
    dcfg = tiny_draft_config(model.config, ("full_attention",) * 2, block_size=8, taps=(1, 5))
    drafter, dparams = DFlashDrafter(dcfg), random_draft(dcfg, seed=3)
    ids = prompt(model.config.vocab_size)[:560]
    runs = {}
    for chunk in (64, 512):
        ecfg = EngineConfig(mode="ddtree", budget=8, max_ctx=SLOTS, draft_ctx=64, prefill_chunk=chunk)
        engine = Engine(model.config, model, ecfg, drafter, dparams)
        state, first = engine.start(ids, 16)
        d = state.draft  # read before decode, which consumes the state
        assert d.rings == (True,) and int(d.length) == len(ids)
        runs[chunk] = np.asarray(d.k[0]), np.asarray(d.v[0]), engine.decode(state, first, 16).tokens
    (k64, v64, tokens64), (k512, v512, tokens512) = runs[64], runs[512]
    assert rel(k512, k64) < SAME and rel(v512, v64) < SAME
    assert tokens512 == tokens64


def test_large_chunks_on_the_kernels_in_interpret_mode(tiny_gguf_path):
    """The Pallas kernels in interpret mode (the GPU's numerics on a CPU): 200 tokens in chunks of 128 (a padded
    tail) give the 64-token chunks' logits and state, the keys cached in q8_0 and the values in bf16. Before each
    64-token block of a long chunk ran as a 64-token chunk's kernel calls (kernels.chunk_attention,
    kernels.gdn_chunked) they differed by 7.6e-4: the kernels round activations to bf16, which turned the long
    chunk's other float32 summation order into 1e-4s of the logits (docs/history.md, 2026-11-28)."""
    model = load_target(tiny_gguf_path, progress=False, kcfg=resolve_kernels("ddtree", impl="pallas", device="cpu"))
    assert_same_prefill(model, SAME, length=200, chunks=(128,), kv_types=("q8_0", "bf16"))


@pytest.mark.gpu
def test_large_chunks_on_the_gpu_kernels(tiny_gguf_path):
    """The same prompt through the device's kernels (Pallas; on Hopper the Mosaic GPU products): chunks of 256 and
    512 against 64 at the references' tolerance."""
    model = load_target(tiny_gguf_path, progress=False, kcfg=resolve_kernels("ddtree"))
    try:
        assert_same_prefill(model, 1e-4)
    except AssertionError as e:  # say where it begins: each layer's output at 256 against 64
        diffs = layer_differences(model, prompt(model.config.vocab_size)[:600], 256)
        raise AssertionError(f"{e}; layer outputs at 256 against 64: {diffs}") from e


def test_a_long_chunk_over_a_long_context_keeps_its_temporaries_bounded(model):
    """A 512-token chunk at the end of a 16K context: the blockwise attention and delta rule keep the compiled
    chunk's temporaries under the [heads, 512, slots] scores a one-pass softmax would hold (measured on a CPU: 41.6
    MiB, against 287 MiB with the one-pass softmax; the bound is 128 MiB)."""
    cfg, slots = model.config, 16384
    state = jax.eval_shape(lambda: init_state(cfg, slots))
    split, tokens, n = SplitTarget.of(model), jax.ShapeDtypeStruct((512,), np.int32), jax.ShapeDtypeStruct((), np.int32)
    compiled = split.chunk.lower(split.weights, cfg, state, tokens, n, (), False, kcfg=model.kcfg).compile()
    memory = compiled.memory_analysis()
    assert memory.temp_size_in_bytes < cfg.num_heads * 512 * slots * 4
