"""Tree attention (pallas_kernels/tree_attention.py's, same signature and result) on Hopper in Mosaic GPU, for
bfloat16 and q8_0 caches and blocks of at most 64 tokens: wgmma on tiles that TMA brings into shared memory.

As the Triton kernel: GQA folded into rows (row = token * group + head within the group, per KV head), a grid of
(row tiles, KV heads, splits + 1), program `split < splits` streaming one 1/splits share of the committed prefix
and the last one the block's own keys under its mask, each writing a softmax partial (max, sum, unnormalised
output) that `tree_attention.merge` adds by log-sum-exp. A program is one warpgroup on 64 rows (wgmma's M): per
step TMA brings 64 keys and their values ([64, 256] bf16 each at the 27B's heads, `stages` steps in flight), the
scores are one wgmma of q [64, d] by the keys^T from shared memory, the softmax runs on them in registers, and the
values' product is a wgmma with p as its A operand from registers. A q8_0 field is decoded into one bf16 tile (the
keys', then the values'). With `exact`, p enters as two bf16 terms (hi + lo) as in the Triton kernel, so that a
position's output does not hang on where the split boundaries or the running max fell. The block's mask arrives as
two 32-bit words of ancestor bits per row; a prefix tile every row sees whole (inside its split, past the largest
prefix_lo) skips the mask, as the kernel is bound by its warps' instruction chains (docs/kernels.md).

On a CPU the tests check that it lowers for CUDA and run it in Pallas' GPU interpret mode (`interpret=True`: its
copies, barriers, masks, softmax and merge, the products there in jnp); its numerics with wgmma are checked on a GPU
(`pytest -m gpu`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dflash_jax import kv_quant as kvq
from pallas_kernels import tree_attention as ta
from pallas_kernels.tree_attention import NEG, loaded, merge, query_rows

ROWS = 64  # query rows a program takes: wgmma's M
BLOCK = 64  # the most block tokens the kernel takes (the mask's two 32-bit words a row); also the keys of a step
SMEM_BYTES = 227 * 1024  # shared memory a Hopper block may take
TILE = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # bf16 tiles of 64-column swizzle units
# q8_0's codes, 64 columns (two blocks, 64 bytes) a swizzle unit: a [64, 64] slice loads in wgmma's layout without
# bank conflicts
CODES = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))


def smem_bytes(stages: int, d: int, kinds: tuple[str | None, str | None]) -> int:
    """Shared memory of the pipeline's scope (q, lo, mask words, key and value stages, the decoded tile), plus 8 KiB
    for the buffers' alignment and the barriers."""
    field = lambda kind: BLOCK * (d + d // 32 * 2 if kind == "q8_0" else 2 * d)  # noqa: E731
    decoded = BLOCK * d * 2 if "q8_0" in kinds else 0
    return ROWS * (2 * d + 12) + stages * sum(field(k) for k in kinds) + decoded + 8 * 1024


def check_stages(stages: int, d: int, kinds: tuple[str | None, str | None]) -> None:
    """Raises ValueError for a pipeline depth this kernel cannot run with these heads and cache types."""
    if stages not in (1, 2):
        raise ValueError(f"the Mosaic tree attention takes 1 or 2 pipeline stages, got {stages}")
    if smem_bytes(stages, d, kinds) > SMEM_BYTES:
        raise ValueError(f"{stages} stages at head_dim {d} over {kinds} take {smem_bytes(stages, d, kinds) // 1024} "
                         f"KiB of shared memory, more than {SMEM_BYTES // 1024}")


def default_stages(kinds: tuple[str | None, str | None]) -> int:
    """Pipeline stages for these cache types, as measured on an H200
    (scripts/results/mgpu_attention_defaults_h200_nov30.txt): over q8_0 one, whose 107 KiB of shared memory let two
    programs share a multiprocessor (the kernel is latency-bound: each hides the other's waits; with `default_splits`
    23 tree tokens take -47 % at 4K, -6 % at 128K, one token -33 % at 128K); over bf16 two. A row's arithmetic is the
    same at either depth."""
    return 1 if "q8_0" in kinds else 2


def default_splits(slots: int, kinds: tuple[str | None, str | None]) -> int:
    """Prefix splits for a cache of `slots` in these types: over q8_0 one per 256 slots, at most 64 (16 at 4K, 64 from
    16K: enough programs for two one-stage programs a multiprocessor, same file); otherwise the Triton kernel's
    (tree_attention.default_splits). The split depends on the cache alone, so a tree and a single token sum a row's
    keys alike."""
    if "q8_0" in kinds:
        return max(1, min(64, slots // 256))
    return ta.default_splits(slots)


def _kernel(splits: int, slots: int, exact: bool, interpret: bool, stages: int, kinds: tuple[str | None, str | None],
            *refs):
    # refs: len_ref, layer_ref, lo_max_ref [1] int32 (the last: the largest prefix_lo); q_ref [Hkv, R, d] bf16;
    # lo_ref [R] int32; bits_ref [2, R] int32 (the block's mask, key j at bit j % 32 of word j // 32); the keys' then
    # the values' cache fields, [layers, S, Hkv, d] bf16 or, for q8_0, qs [layers, S, Hkv, d] int8 and d [layers, S,
    # Hkv, d / 32] float16; the block's keys' then values' fields, [Hkv, 64, ...] alike; o_ref [Hkv, splits + 1, R,
    # d], m_ref and l_ref [Hkv, splits + 1, R]
    len_ref, layer_ref, lo_max_ref, q_ref, lo_ref, bits_ref, *fields, o_ref, m_ref, l_ref = refs
    bk = BLOCK
    widths = [2 if kind == "q8_0" else 1 for kind in kinds]
    kc_f, vc_f = fields[:widths[0]], fields[widths[0]:sum(widths)]
    kb_f, vb_f = fields[sum(widths):sum(widths) + widths[0]], fields[sum(widths) + widths[0]:]
    r_tile, h, split = jax.lax.axis_index("r"), jax.lax.axis_index("h"), jax.lax.axis_index("s")
    rows = pl.ds(r_tile * ROWS, ROWS)
    d = q_ref.shape[-1]
    row = plgpu.Layout.WGMMA.reduce(1)  # a vector over the tile's rows, as wgmma's accumulator holds them
    # GPU interpret mode (jax 0.10.2) has no plgpu.load nor layout casts: it reads the ref plainly, keeps the layout
    load_row = (lambda ref: ref[...]) if interpret else (lambda ref: plgpu.load(ref, (), layout=row))  # noqa: E731
    cast = (lambda x, _: x) if interpret else plgpu.layout_cast  # noqa: E731
    col = cast(jax.lax.broadcasted_iota(jnp.int32, (64, 64), 1), plgpu.Layout.WGMMA)
    key = cast(jax.lax.broadcasted_iota(jnp.int32, (ROWS, bk), 1), plgpu.Layout.WGMMA)
    def attend(q_smem, k_st, v_st, dec, lo_smem, bits_smem, q_bar, k_bar, v_bar):
        # k_st, v_st: each field's pipeline stages [stages, bk, ...]; dec: the bf16 tile q8_0 fields decode into
        # (keys', then values')
        at = lambda stage, slot: tuple(f.at[slot] for f in stage)  # noqa: E731

        def decode(stage):
            """q8_0's codes times their blocks' scales, rounded to bf16 (as the Triton kernel decodes them), into
            `dec`, 64 columns (two blocks) at a time."""
            codes, scales = stage
            for c in range(d // 64):
                part = codes.at[:, pl.ds(c * 64, 64)]
                q8 = part[...] if interpret else plgpu.load(part, (), layout=plgpu.Layout.WGMMA)
                per_row = [jax.lax.broadcast_in_dim(load_row(scales.at[:, 2 * c + j]).astype(jnp.float32),
                                                    (64, 64), [0]) for j in range(2)]
                dec.at[:, pl.ds(c * 64, 64)][...] = (
                    q8.astype(jnp.float32) * jnp.where(col < 32, per_row[0], per_row[1])).astype(jnp.bfloat16)
            plgpu.commit_smem()  # the generic proxy's stores, before wgmma reads the tile
            return dec

        def keys(slot):
            return k_st[0].at[slot] if kinds[0] is None else decode(at(k_st, slot))

        def values(slot):
            return v_st[0].at[slot] if kinds[1] is None else decode(at(v_st, slot))

        def update(carry, slot, visible):
            # visible: which of the tile's keys each row sees, or None where every row sees all of them
            m, l, acc = carry
            k_smem = keys(slot)

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
                return acc_ref[...]

            if interpret:  # GPU interpret mode (jax 0.10.2) takes no transposed wgmma operand: the product in jnp
                s = jnp.dot(q_smem[...], k_smem[...].T, preferred_element_type=jnp.float32)
            else:
                s = pl.run_scoped(scores, plgpu.ACC((ROWS, bk), jnp.float32))
            if visible is not None:
                s = jnp.where(visible, s, NEG)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.exp(s - jax.lax.broadcast_in_dim(m_new, s.shape, [0]))
            if visible is not None:
                p = jnp.where(visible, p, 0.0)
            alpha = jnp.exp(m - m_new)
            l = l * alpha + p.sum(axis=1)
            acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
            p_hi = p.astype(jnp.bfloat16)
            terms = (p_hi, (p - p_hi.astype(jnp.float32)).astype(jnp.bfloat16)) if exact else (p_hi,)
            v_smem = values(slot)

            def products(acc_ref):
                for t in terms:
                    plgpu.wgmma(acc_ref, t, v_smem)

            if interpret:  # nor run_state nor an A operand in registers: the products in jnp, then added
                return m_new, l, acc + sum(jnp.dot(t, v_smem[...], preferred_element_type=jnp.float32)
                                           for t in terms)
            # the running output is the accumulator the products add into (a second [64, d] one would not fit the
            # registers beside it)
            return m_new, l, pl.run_state(products)(plgpu.ACC.init(acc))

        def pipeline(steps, fetch, visible, carry, whole=None):
            """`steps` key tiles through the stages: `fetch(i, slot)` issues tile i's copies (they arrive on
            k_bar[slot] and v_bar[slot]), tile i is folded into the rows' softmax, and the slot takes tile i + stages
            once its products are done. Where `whole(i)` holds, every row sees all of tile i's keys and its mask is
            left out (the same bits, fewer instructions)."""
            for i in range(stages):
                pl.when(i < steps)(functools.partial(fetch, i, i))

            def body(i, carry):
                slot = jax.lax.rem(i, stages)
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])
                if whole is None:
                    carry = update(carry, slot, visible(i))
                else:
                    carry = jax.lax.cond(whole(i), lambda c: update(c, slot, None),
                                         lambda c: update(c, slot, visible(i)), carry)
                # the products are done (their results are in registers): the slot is free
                pl.when(i + stages < steps)(lambda: fetch(i + stages, slot))
                return carry

            return jax.lax.fori_loop(0, steps, body, carry)

        plgpu.copy_gmem_to_smem(q_ref.at[h, rows], q_smem, q_bar)
        plgpu.copy_gmem_to_smem(lo_ref.at[rows], lo_smem, q_bar)
        plgpu.copy_gmem_to_smem(bits_ref.at[:, rows], bits_smem, q_bar)
        init = (cast(jnp.full((ROWS,), NEG, jnp.float32), row), cast(jnp.zeros((ROWS,), jnp.float32), row),
                cast(jnp.zeros((ROWS, d), jnp.float32), plgpu.Layout.WGMMA))
        plgpu.barrier_wait(q_bar)

        def prefix():
            length, layer, lo_max = len_ref[0], layer_ref[0], lo_max_ref[0]
            chunk = pl.cdiv(pl.cdiv(length, splits), bk) * bk
            start = split * chunk
            end = jnp.minimum(start + chunk, length)
            steps = pl.cdiv(jnp.maximum(end - start, 0), bk)
            lo = jax.lax.broadcast_in_dim(load_row(lo_smem), (ROWS, bk), [0])
            # the last tile of a cache whose size is not a multiple of bk is read ending at the cache's end (no read
            # past it); the slots before the wanted ones that it re-reads are masked off
            first = lambda i: jnp.minimum(start + i * bk, slots - bk)  # noqa: E731

            def fetch(i, slot):
                index = (layer, pl.ds(first(i), bk), h)
                for src, dst, bar in ((kc_f, k_st, k_bar), (vc_f, v_st, v_bar)):
                    for f, stage in zip(src, dst):
                        plgpu.copy_gmem_to_smem(f.at[index], stage.at[slot], bar.at[slot])

            def visible(i):
                slot_id = first(i) + key
                return (slot_id >= start + i * bk) & (slot_id < end) & (slot_id >= lo)

            def whole(i):  # tile i lies within [start, end) and past every row's prefix_lo
                return (start + i * bk >= lo_max) & (start + (i + 1) * bk <= end)

            return pipeline(steps, fetch, visible, init, whole)

        def block():
            def fetch(i, slot):
                for src, dst, bar in ((kb_f, k_st, k_bar), (vb_f, v_st, v_bar)):
                    for f, stage in zip(src, dst):
                        plgpu.copy_gmem_to_smem(f.at[h, pl.ds(i * bk, bk)], stage.at[slot], bar.at[slot])

            def visible(i):
                words = [jax.lax.broadcast_in_dim(load_row(bits_smem.at[w]), (ROWS, bk), [0]) for w in range(2)]
                word = jnp.where(key < 32, words[0], words[1])
                return jax.lax.shift_right_logical(word, key & 31) & 1 != 0

            return pipeline(1, fetch, visible, init)

        return jax.lax.cond(split < splits, prefix, block)

    def stage_fields(kind):  # a pipeline stage's fields
        if kind is None:
            return (plgpu.SMEM((stages, bk, d), jnp.bfloat16, transforms=TILE),)
        return (plgpu.SMEM((stages, bk, d), jnp.int8, transforms=CODES),
                plgpu.SMEM((stages, bk, d // 32), jnp.float16))

    m, l, acc = pl.run_scoped(
        attend,
        plgpu.SMEM((ROWS, d), jnp.bfloat16, transforms=TILE),
        stage_fields(kinds[0]), stage_fields(kinds[1]),
        plgpu.SMEM((bk, d), jnp.bfloat16, transforms=TILE) if "q8_0" in kinds else None,
        plgpu.SMEM((ROWS,), jnp.int32),
        plgpu.SMEM((2, ROWS), jnp.int32),
        plgpu.Barrier(num_arrivals=3),  # q, lo and the mask words
        # each field's copy arrives on its stage's barrier
        plgpu.Barrier(num_arrivals=widths[0], num_barriers=stages),
        plgpu.Barrier(num_arrivals=widths[1], num_barriers=stages),
    )

    def store(o_smem, m_smem, l_smem):
        o_smem[...] = acc
        m_smem[...] = m
        l_smem[...] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[h, split, rows])
        plgpu.copy_smem_to_gmem(m_smem, m_ref.at[h, split, rows])
        plgpu.copy_smem_to_gmem(l_smem, l_ref.at[h, split, rows])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM((ROWS, d), jnp.float32), plgpu.SMEM((ROWS,), jnp.float32),
                  plgpu.SMEM((ROWS,), jnp.float32))


def mask_bits(blk_mask: jax.Array, group: int, r_pad: int) -> jax.Array:
    """The block's mask [N, N] (N <= 64) as the kernel reads it: per query row (token * group + head, zero past the
    tokens) two int32 words of key bits, [2, r_pad]."""
    n = blk_mask.shape[0]
    m = jnp.pad(jnp.repeat(blk_mask.astype(jnp.uint32), group, axis=0), ((0, r_pad - n * group), (0, BLOCK - n)))
    shifted = m.reshape(r_pad, 2, 32) << jnp.arange(32, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(jnp.sum(shifted, axis=-1, dtype=jnp.uint32), jnp.int32).T


def _kind(x: Any) -> str | None | bool:
    """A cache's or block's type as this kernel takes it: None for bf16 rows, "q8_0" for q8_0 blocks, False for
    anything else."""
    if isinstance(x, kvq.KVBlocks):
        return "q8_0" if x.kind == "q8_0" else False
    return None if isinstance(x, jax.Array) and x.dtype == jnp.bfloat16 else False


def supports(q: jax.Array, k_cache, v_cache, k_blk, v_blk) -> bool:
    """Whether this kernel takes these operands: keys and values each in bf16 or q8_0 (kv_quant.KVBlocks), the
    block's rows in their cache's type, caches of a multiple of 8 slots (TMA's tiling of the slot dimension; fewer
    than BLOCK are padded), at most BLOCK block tokens, a head_dim that is a multiple of 64."""
    kinds = [_kind(x) for x in (k_cache, v_cache, k_blk, v_blk)]
    slots = k_cache.shape[-3]
    return (False not in kinds and kinds[:2] == kinds[2:] and q.shape[0] <= BLOCK and q.shape[-1] % 64 == 0
            and (slots % 8 == 0 or slots < BLOCK)
            # TMA takes rows of a multiple of 16 bytes: q8_0's scales, d / 32 float16 a row, need d % 256 == 0
            and ("q8_0" not in kinds or q.shape[-1] % 256 == 0))


def _fields(x: jax.Array | kvq.KVBlocks) -> tuple[jax.Array, ...]:
    """What the kernel reads of rows [..., d]: bf16 rows as they are; q8_0's codes as [..., d] int8 and scales as
    [..., d / 32] float16 (the Triton kernel's fields, `loaded`, its codes' blocks flattened: free reshapes)."""
    f = loaded(x)
    if isinstance(f, dict):
        return f["qs"].reshape(*f["qs"].shape[:-2], -1), f["d"]
    return (f,)


def _interpret_params() -> Any:
    """The parameters of Pallas' GPU interpret mode (shared memory, barriers and TMA simulated on a CPU)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # not public in jax 0.10.2

    return InterpretGPUParams()


@functools.partial(jax.jit, static_argnames=("splits", "exact", "interpret", "stages"))
def tree_attention(q: jax.Array, k_cache: jax.Array | kvq.KVBlocks, v_cache: jax.Array | kvq.KVBlocks,
                   length: jax.Array, k_blk: jax.Array | kvq.KVBlocks, v_blk: jax.Array | kvq.KVBlocks,
                   blk_mask: jax.Array, prefix_lo: jax.Array, *, layer: int | jax.Array | None = None,
                   splits: int | None = None, exact: bool = True, interpret: bool = False,
                   stages: int | None = None) -> jax.Array:
    """pallas_kernels.tree_attention.tree_attention on caches [(layers,) S, Hkv, d] of bf16 or q8_0 rows (keys and
    values each) and a block of at most 64 tokens (k/v_blk [N, Hkv, d] in their caches' types): float32 [N, Hq, d].
    Every query must see at least one key. `interpret` runs it in Pallas' GPU interpret mode (a CPU test of its
    copies, barriers, decoding, masks and softmax: the products there are jnp's, as that mode (jax 0.10.2) takes no
    transposed or register operand of wgmma). `splits` and `stages` default to `default_splits` and
    `default_stages`."""
    if not supports(q, k_cache, v_cache, k_blk, v_blk):
        raise ValueError(f"the Mosaic GPU tree attention takes bf16 or q8_0 caches (slots a multiple of 8), the "
                         f"block's rows in their caches' types, and blocks of at most {BLOCK} tokens with head_dim "
                         f"a multiple of 64, got q {q.shape}, caches {_describe(k_cache)} {_describe(v_cache)}, "
                         f"block {_describe(k_blk)} {_describe(v_blk)}")
    if layer is None:
        k_cache, v_cache = (jax.tree.map(lambda x: x[None], c) for c in (k_cache, v_cache))
        layer = 0
    if len(k_cache.shape) != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {k_cache.shape} {v_cache.shape} with a layer: give stacked caches "
                         f"[layers, S, Hkv, d]")
    n, hq, d = q.shape
    _, s, hkv, _ = k_cache.shape
    if hq % hkv or k_blk.shape != (n, hkv, d) or v_blk.shape != k_blk.shape:
        raise ValueError(f"shapes do not fit: q {q.shape}, caches {k_cache.shape}, block {k_blk.shape} {v_blk.shape}")
    kinds = (_kind(k_cache), _kind(v_cache))
    splits = splits or default_splits(s, kinds)
    stages = stages or default_stages(kinds)
    check_stages(stages, d, kinds)
    if s < BLOCK:  # a cache smaller than one key block (tests, tiny contexts): pad it, it is small
        pad = lambda x: jnp.pad(jax.lax.dynamic_index_in_dim(x, layer, keepdims=True),  # noqa: E731
                                ((0, 0), (0, BLOCK - s)) + ((0, 0),) * (x.ndim - 2))
        k_cache, v_cache = (jax.tree.map(pad, c) for c in (k_cache, v_cache))
        layer, s = 0, BLOCK
    group = hq // hkv
    r_pad = pl.cdiv(n * group, ROWS) * ROWS
    qf, lo = query_rows(q, prefix_lo, hkv, r_pad, None)
    per_head = lambda x: jnp.pad(x.swapaxes(0, 1), ((0, 0), (0, BLOCK - n)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
    parts = splits + 1
    fields = [f for x in (k_cache, v_cache) for f in _fields(x)]
    fields += [per_head(f) for x in (k_blk, v_blk) for f in _fields(x)]
    o, m, l = plgpu.kernel(
        functools.partial(_kernel, splits, s, exact, interpret, stages, kinds),
        out_type=(jax.ShapeDtypeStruct((hkv, parts, r_pad, d), jnp.float32),
                  jax.ShapeDtypeStruct((hkv, parts, r_pad), jnp.float32),
                  jax.ShapeDtypeStruct((hkv, parts, r_pad), jnp.float32)),
        grid=(r_pad // ROWS, hkv, parts), grid_names=("r", "h", "s"),
        kernel_name="tree_attention_mgpu", interpret=_interpret_params() if interpret else None,
        # written for Lane semantics (per-thread register arrays, explicit layouts); jax 0.11's default is Warpgroup
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(jnp.reshape(length, (1,)).astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32),
      jnp.max(prefix_lo).astype(jnp.int32).reshape(1), qf, lo,
      mask_bits(blk_mask, group, r_pad), *fields)
    return merge(o, m, l, n, hq, None)


def _describe(x: Any) -> str:
    """A cache's or block's type and shape, for an error."""
    return f"{x.kind if isinstance(x, kvq.KVBlocks) else x.dtype}{tuple(x.shape)}"
