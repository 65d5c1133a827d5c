"""The Mosaic GPU tree attention (pallas_kernels/tree_attention_mgpu.py): its mask words and that it lowers on a CPU,
and with -m gpu against reference.tree_attention and the Triton kernel at the 27B's shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import kv_quant as kvq
from dflash_jax.testing.trees import random_ancestors
from pallas_kernels import reference as ref
from pallas_kernels import tree_attention as ta
from pallas_kernels import tree_attention_mgpu as tam

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="Mosaic GPU kernels run on a Hopper GPU")


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def inputs(seed, n, hq, hkv, d, slots, layers=None, types=("bf16", "bf16")):
    """q and the K and V caches (and block rows) in `types` (bf16 or q8_0, keys' then values')."""
    ks = jax.random.split(jax.random.key(seed), 5)
    lead = (layers,) if layers else ()
    q = jax.random.normal(ks[0], (n, hq, d))
    kc, vc = (jax.random.normal(kk, (*lead, slots, hkv, d)) for kk in ks[1:3])
    kb, vb = (jax.random.normal(kk, (n, hkv, d)) for kk in ks[3:5])
    as_type = lambda x, t: x.astype(jnp.bfloat16) if t == "bf16" else kvq.quantize(x, t)  # noqa: E731
    return q, as_type(kc, types[0]), as_type(vc, types[1]), as_type(kb, types[0]), as_type(vb, types[1])


def readable(x, layer=None):
    return kvq.readable(x, layer).astype(jnp.float32)


def test_mask_bits_hold_each_rows_keys():
    rng = np.random.default_rng(0)
    n, group = 23, 6
    blk = random_ancestors(rng, n)
    words = np.asarray(tam.mask_bits(jnp.asarray(blk), group, 192)).view(np.uint32)  # [2, r_pad]
    assert words.shape == (2, 192)
    bits = (words[(np.arange(64) // 32)[None, :], np.arange(192)[:, None]] >> (np.arange(64) % 32)) & 1  # [192, 64]
    want = np.zeros((192, 64), bool)
    want[:n * group, :n] = np.repeat(blk, group, axis=0)
    np.testing.assert_array_equal(bits.astype(bool), want)


def test_refuses_what_it_cannot_take():
    """65 block tokens, a cache of 100 slots, a float32 cache, q8_0 keys with bf16 block rows, q4_0, and q8_0 at a
    head_dim of 128 (its scales' rows, 8 bytes, are not rows TMA takes: the drafter's heads)."""
    q, kc, vc, kb, vb = inputs(0, 65, 4, 2, 64, 128)
    with pytest.raises(ValueError, match="at most 64 tokens"):
        tam.tree_attention(q, kc, vc, jnp.int32(10), kb, vb, jnp.ones((65, 65), bool), jnp.zeros(65, jnp.int32))
    q, kc, vc, kb, vb = inputs(0, 4, 4, 2, 64, 128)
    q8 = kvq.quantize(kc.astype(jnp.float32), "q8_0")
    for bad in ((kc[:100], vc[:100], kb, vb), (kc.astype(jnp.float32), vc, kb, vb), (q8, vc, kb, vb),
                (kvq.quantize(kc.astype(jnp.float32), "q4_0"), vc, kvq.quantize(kb.astype(jnp.float32), "q4_0"), vb)):
        with pytest.raises(ValueError, match="bf16 or q8_0 caches"):
            tam.tree_attention(q, bad[0], bad[1], jnp.int32(10), bad[2], bad[3], jnp.ones((4, 4), bool),
                               jnp.zeros(4, jnp.int32))
        assert not tam.supports(q, *bad)
    assert tam.supports(q, kc, vc, kb, vb)
    for d, ok in ((128, False), (256, True)):
        q, kc, vc, kb, vb = inputs(0, 4, 4, 2, d, 128, types=("q8_0", "bf16"))
        assert tam.supports(q, kc, vc, kb, vb) == ok
    with pytest.raises(ValueError, match="bf16 or q8_0 caches"):
        tam.tree_attention(*inputs(0, 4, 4, 2, 128, 128, types=("q8_0", "q8_0"))[:3], jnp.int32(10),
                           *inputs(0, 4, 4, 2, 128, 128, types=("q8_0", "q8_0"))[3:], jnp.ones((4, 4), bool),
                           jnp.zeros(4, jnp.int32))


TARGET_HEADS, DRAFT_HEADS = (24, 4, 256), (32, 8, 128)  # the 27B's and its drafter's (query, KV, head_dim)


@pytest.mark.parametrize("n,slots,types,heads", [
    (1, 4160, ("bf16", "bf16"), TARGET_HEADS), (64, 136, ("bf16", "bf16"), TARGET_HEADS),
    (23, 40, ("bf16", "bf16"), TARGET_HEADS), (23, 4160, ("q8_0", "q8_0"), TARGET_HEADS),
    (1, 136, ("q8_0", "bf16"), TARGET_HEADS), (16, 2064, ("bf16", "bf16"), DRAFT_HEADS)])
def test_lowers_for_cuda_on_a_cpu(n, slots, types, heads):
    """Tracing and Mosaic GPU's lowering (layouts, TMA shapes, barriers, the pipeline's dynamic trip count, q8_0's
    decoding into a bf16 tile) run without a GPU at the 27B's heads and its drafter's over a stack of layers."""
    q, kc, vc, kb, vb = inputs(0, n, *heads, slots, layers=2, types=types)
    args = (q, kc, vc, jnp.int32(slots // 2), kb, vb, jnp.tril(jnp.ones((n, n), bool)), jnp.zeros(n, jnp.int32))
    text = jax.jit(lambda *a: tam.tree_attention(*a, layer=jnp.int32(1))).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("n,types,stages", [(23, ("bf16", "bf16"), 1), (23, ("q8_0", "q8_0"), 2),
                                            (9, ("q8_0", "bf16"), 2)])
def test_other_stages_lower_for_cuda_on_a_cpu(n, types, stages):
    """The depth a type does not take by default lowers at the 27B's heads too (one stage's slot refilled after each
    step, two stages over q8_0 beside the decoded tile)."""
    q, kc, vc, kb, vb = inputs(0, n, *TARGET_HEADS, 4160, layers=2, types=types)
    args = (q, kc, vc, jnp.int32(4000), kb, vb, jnp.tril(jnp.ones((n, n), bool)), jnp.zeros(n, jnp.int32))
    text = jax.jit(lambda *a: tam.tree_attention(*a, layer=jnp.int32(1), stages=stages)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_defaults_take_one_stage_and_more_splits_over_q8_0():
    """Over q8_0 one stage and one split per 256 slots up to 64, for a tree and a single token alike; bf16 caches
    keep two stages and the Triton kernel's splits."""
    q8, bf16 = ("q8_0", "q8_0"), (None, None)
    assert tam.default_stages(q8) == tam.default_stages(("q8_0", None)) == 1
    assert tam.default_stages(bf16) == 2
    assert [tam.default_splits(s, q8) for s in (40, 296, 4160, 16384, 32832, 131136)] == [1, 1, 16, 64, 64, 64]
    assert [tam.default_splits(s, bf16) for s in (40, 4160, 131136)] == [1, 5, 32]  # ta.default_splits


def test_stages_refuse_what_they_cannot_run():
    """Three stages, and two over bf16 at head_dim 512 (more shared memory than a block takes)."""
    for d, stages, match in ((256, 3, "1 or 2 pipeline stages"), (512, 2, "shared memory")):
        q, kc, vc, kb, vb = inputs(0, 23, 24, 4, d, 256, layers=2)
        args = (q, kc, vc, jnp.int32(100), kb, vb, jnp.tril(jnp.ones((23, 23), bool)), jnp.zeros(23, jnp.int32))
        with pytest.raises(ValueError, match=match):
            tam.tree_attention(*args, layer=jnp.int32(1), stages=stages)
    assert tam.smem_bytes(2, 256, ("q8_0", "q8_0")) < tam.smem_bytes(2, 256, (None, None)) < tam.SMEM_BYTES
    assert tam.smem_bytes(1, 256, ("q8_0", "q8_0")) < tam.SMEM_BYTES // 2  # two programs a multiprocessor


# (N, Hq, Hkv, slots, length, splits, prefix_lo, mask): N = 1, a tree, 64 tokens; contexts of 0, 1, odd length and a
# whole cache; a cache smaller than a key block, one not a multiple of it; more splits than the context needs; a
# window (prefix_lo) with a causal block
CPU_CASES = [(1, 6, 1, 136, 97, 2, 0, "tree"), (23, 6, 2, 200, 131, 3, 0, "tree"), (5, 4, 1, 40, 0, None, 0, "tree"),
             (7, 6, 1, 72, 1, 4, 0, "tree"), (64, 2, 1, 128, 64, 1, 0, "causal"), (8, 6, 1, 256, 200, 2, 150, "causal")]


TYPES = [("bf16", "bf16"), ("q8_0", "q8_0"), ("q8_0", "bf16"), ("bf16", "q8_0")]
# every shape in bf16, the block types at two of them (the file's time; their paths are the same at the others)
INTERPRET_CASES = ([case + (TYPES[0],) for case in CPU_CASES]
                   + [case + (types,) for case in CPU_CASES if case[0] in (23, 64) for types in TYPES[1:]])


# two stages (q8_0's at two, not its default one); one stage (its slot refilled after every step) where a split
# takes two steps
INTERPRET_STAGES = ([case + (2,) for case in INTERPRET_CASES] + [CPU_CASES[5] + (types, 1) for types in TYPES[:2]])


@pytest.mark.parametrize("n,hq,hkv,slots,length,splits,lo,kind,types,stages", INTERPRET_STAGES)
def test_kernel_matches_reference_in_interpret_mode(n, hq, hkv, slots, length, splits, lo, kind, types, stages):
    """The kernel in GPU interpret mode (its copies, barriers, slot reuse, q8_0 decoding, masks, softmax and merge;
    the products there in jnp) over layer 1 of a two-layer stack, against the reference over the caches as stored
    (dequantized). Unwritten partials would be NaN. head_dim 64, or 256 with q8_0 (the least it takes)."""
    q, kc, vc, kb, vb = inputs(n * slots, n, hq, hkv, 256 if "q8_0" in types else 64, slots, layers=2, types=types)
    rng = np.random.default_rng(n + slots)
    blk = jnp.asarray(random_ancestors(rng, n) if kind == "tree" else np.tril(np.ones((n, n), bool)))
    prefix_lo = jnp.full((n,), lo, jnp.int32)
    args = (q, kc, vc, jnp.int32(length), kb, vb, blk, prefix_lo)
    got = tam.tree_attention(*args, layer=jnp.int32(1), splits=splits, interpret=True, stages=stages)
    assert got.shape == q.shape and bool(jnp.all(jnp.isfinite(got)))
    want = ref.tree_attention(q, readable(kc, 1), readable(vc, 1), jnp.int32(length), readable(kb), readable(vb),
                              blk, prefix_lo)
    assert rel(got, want) < 1e-2  # q, k, v in bf16; p in two bf16 terms


def assert_decodes_as_bf16(run, kc, vc, kb, vb):
    """`run(kc, vc, kb, vb)` over q8_0 fields gives the bits it gives over the bf16 rows the kernel decodes them into:
    each code times its block's scale (exact in float32), rounded to bf16 once."""
    as_bf16 = [kvq.readable(x).astype(jnp.bfloat16) if isinstance(x, kvq.KVBlocks) else x for x in (kc, vc, kb, vb)]
    np.testing.assert_array_equal(np.asarray(run(kc, vc, kb, vb)), np.asarray(run(*as_bf16)))


@pytest.mark.parametrize("types", TYPES[1:], ids=str)
def test_q8_0_is_its_decoded_bf16_cache_in_interpret_mode(types):
    """A q8_0 field decodes into exactly the bf16 rows `assert_decodes_as_bf16` makes: attention over it is bit for
    bit attention over those rows as a bf16 cache (same tiles, so the same arithmetic after the decoding)."""
    q, kc, vc, kb, vb = inputs(5, 23, 6, 2, 256, 200, layers=2, types=types)
    blk, lo = jnp.asarray(random_ancestors(np.random.default_rng(5), 23)), jnp.zeros((23,), jnp.int32)

    def run(kc, vc, kb, vb):
        return tam.tree_attention(q, kc, vc, jnp.int32(131), kb, vb, blk, lo, layer=jnp.int32(1), splits=3,
                                  interpret=True, stages=2)

    assert_decodes_as_bf16(run, kc, vc, kb, vb)


# (N, slots, length, splits, prefix_lo): N = 1, a tree of 23, 64 tokens; contexts of 0, 1 and odd length; a cache
# smaller than a key block and one not a multiple of it; more splits than the context needs; a window
GPU_CASES = [(1, 4160, 4095, None, 0), (23, 4160, 4096, None, 0), (23, 296, 211, 4, 0), (23, 40, 0, None, 0),
             (5, 104, 1, None, 0), (64, 136, 97, 3, 0), (23, 32832, 32768, None, 0), (8, 504, 300, 2, 250)]


def gpu_case(n, slots, length, lo, types):
    """A GPU case at the 27B's heads: the kernel's arguments and the reference's output over the caches as stored."""
    q, kc, vc, kb, vb = inputs(n + slots, n, 24, 4, 256, slots, layers=2, types=types)
    blk = jnp.asarray(random_ancestors(np.random.default_rng(n + slots), n))
    prefix_lo = jnp.full((n,), min(lo, length), jnp.int32)
    if length == 0:  # every query must see a key: the block's own
        blk = blk | jnp.eye(n, dtype=bool)
    want = ref.tree_attention(q, readable(kc, 1), readable(vc, 1), jnp.int32(length), readable(kb), readable(vb),
                              blk, prefix_lo)
    return (q, kc, vc, jnp.int32(length), kb, vb, blk, prefix_lo), want


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("types", TYPES[:3])
@pytest.mark.parametrize("n,slots,length,splits,lo", GPU_CASES)
def test_kernel_matches_reference_and_the_triton_kernel(n, slots, length, splits, lo, types):
    args, want = gpu_case(n, slots, length, lo, types)
    got = tam.tree_attention(*args, layer=jnp.int32(1), splits=splits)
    assert got.shape == want.shape and bool(jnp.all(jnp.isfinite(got)))
    assert rel(got, want) < 1e-2  # q, k, v in bf16; p in two bf16 terms
    triton = ta.tree_attention(*args, layer=jnp.int32(1), splits=splits)
    assert rel(got, triton) < 1e-3


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("types", TYPES[:3])
@pytest.mark.parametrize("n,slots,length,splits,lo", [GPU_CASES[i] for i in (1, 2, 3, 5, 7)])
def test_other_stages_match_the_reference(n, slots, length, splits, lo, types):
    """The depth a type does not take by default (two over q8_0, one over bf16) at the 27B's heads: the shapes that
    take several row tiles and splits."""
    args, want = gpu_case(n, slots, length, lo, types)
    stages = 3 - tam.default_stages(tuple(None if t == "bf16" else t for t in types))
    got = tam.tree_attention(*args, layer=jnp.int32(1), splits=splits, stages=stages)
    assert got.shape == want.shape and bool(jnp.all(jnp.isfinite(got)))
    assert rel(got, want) < 1e-2
    default = tam.tree_attention(*args, layer=jnp.int32(1), splits=splits)
    assert rel(got, default) < 1e-3


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("n,slots,length,splits,lo", [GPU_CASES[i] for i in (1, 5)])
def test_q8_0_is_its_decoded_bf16_cache(n, slots, length, splits, lo, stages):
    """On the GPU with wgmma: attention over q8_0 keys and values is bit for bit attention over the bf16 rows they
    decode to (at q8_0's splits: bf16's default differs)."""
    (q, kc, vc, length, kb, vb, blk, prefix_lo), _ = gpu_case(n, slots, length, lo, TYPES[1])
    splits = splits or tam.default_splits(slots, ("q8_0", "q8_0"))

    def run(kc, vc, kb, vb):
        return tam.tree_attention(q, kc, vc, length, kb, vb, blk, prefix_lo, layer=jnp.int32(1), splits=splits,
                                  stages=stages)

    assert_decodes_as_bf16(run, kc, vc, kb, vb)


def lowered_kernels(kcfg, k_cache, v_cache, kb, vb, n=23) -> str:
    from dflash_jax import kernels

    q = jnp.zeros((n, 24, 256))
    args = (q, k_cache, v_cache, jnp.int32(100), kb, vb, jnp.tril(jnp.ones((n, n), bool)), jnp.zeros(n, jnp.int32))
    return jax.jit(lambda *a: kernels.tree_attention(*a, kcfg, layer=1)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()


def test_the_kernel_switch_takes_it_where_asked_and_supported():
    """kernels.tree_attention under mgpu_attention: this kernel for bf16 and q8_0 caches, the Triton one for
    another block type (q4_0) and without the flag."""
    from dflash_jax import kv_quant as kvq
    from dflash_jax.config import KernelConfig

    _, kc, vc, kb, vb = inputs(0, 23, 24, 4, 256, 256, layers=2)
    on, off = KernelConfig(impl="pallas", mgpu_attention=True), KernelConfig(impl="pallas")
    assert "mosaic_gpu" in lowered_kernels(on, kc, vc, kb, vb)
    text = lowered_kernels(off, kc, vc, kb, vb)
    assert "mosaic_gpu" not in text and "tree_attention" in text
    blocks = {t: [kvq.quantize(x.astype(jnp.float32), t) for x in (kc, vc, kb, vb)] for t in ("q8_0", "q4_0")}
    assert "mosaic_gpu" in lowered_kernels(on, *blocks["q8_0"])
    assert "mosaic_gpu" not in lowered_kernels(on, *blocks["q4_0"])
    with pytest.raises(ValueError, match="Mosaic GPU tree attention"):
        KernelConfig(mgpu_attention=True)


def test_ddtree_emits_what_ar_emits_on_it_in_interpret_mode():
    """A tiny target (head_dim 64, which the kernel takes) on a bf16 cache with the tree attention on this kernel
    in GPU interpret mode (`KernelConfig.mgpu_attention`): a DDTree over an oracle drafter's proposals of AR's
    continuation emits what AR emits, through the prefill's 64-token chunks and the trees' blocks."""
    from dflash_jax.config import MAX_TREE_NODES, EngineConfig, KernelConfig
    from dflash_jax.engine.generate import Engine
    from dflash_jax.models.target import init_state
    from dflash_jax.testing.oracle import OracleDrafter
    from dflash_jax.testing.tiny import random_target, tiny_target_config

    cfg = tiny_target_config(num_layers=2, interval=2, vocab_size=256, hidden_size=64, intermediate_size=128,
                             linear_key_head_dim=16, linear_value_head_dim=16, linear_num_value_heads=4)
    max_ctx, n_gen = 128, 12
    state = init_state(cfg, max_ctx + MAX_TREE_NODES, "bf16")
    for n in (9, 64):  # a budget-8 tree, a prefill chunk: the kernel takes them (not the Triton fallback)
        rows = state.k[0, :n]
        assert tam.supports(jnp.zeros((n, cfg.num_heads, cfg.head_dim)), state.k, state.v, rows, rows)
    params, kcfg = random_target(cfg, seed=4), KernelConfig(impl="pallas", interpret=True, mgpu_attention=True)
    ids = np.random.default_rng(200).integers(10, cfg.vocab_size, 70)
    want = Engine(cfg, params, EngineConfig(mode="ar", max_ctx=max_ctx, kv_type="bf16"), kcfg=kcfg).generate(
        ids, n_gen).tokens
    sequence = np.zeros(max_ctx, np.int32)
    sequence[:len(ids) + n_gen] = np.concatenate([ids, want])
    tree = Engine(cfg, params, EngineConfig(mode="ddtree", budget=8, topk=4, max_ctx=max_ctx, kv_type="bf16"),
                  OracleDrafter(8, cfg.vocab_size, 0.25, seed=1), {"sequence": jnp.asarray(sequence)}, kcfg=kcfg)
    out = tree.generate(ids, n_gen)
    assert out.tokens == want and max(out.accept_lengths) >= 4, (out.tokens, want, out.accept_lengths)
