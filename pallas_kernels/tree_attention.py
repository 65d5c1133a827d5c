"""Attention of a block of N tokens (a verified tree, a prefill chunk, a draft block) over a committed KV prefix
plus the block's own keys, flash-decoding style: q [N, Hq, d] -> [N, Hq, d].

Query i sees prefix slots s with prefix_lo[i] <= s < length (every committed slot for the target; a sliding window
for the drafter's sliding layers) and block key j where blk_mask[i, j] (ancestor-or-self for a tree, causal for a
chain, all for the drafter's full layers). The reference is `reference.tree_attention`.

GQA is folded into rows: the queries of the Hq / Hkv heads that share a KV head, for all N tokens, are the rows of one
matrix (row = token * group + head), so a tree of 23 tokens x 6 heads is 138 rows against one stream of keys. The
grid is (row tiles, KV heads, splits + 1): program `split < splits` streams one 1/splits share of the prefix
(split over the committed length, which is dynamic, so every split gets work at any context), the last program
attends to the block's keys under the mask. Each writes its softmax partial (max, sum, unnormalised output); a jnp
epilogue merges them by log-sum-exp. Keys and values are read as stored (float32 or bf16) and multiplied in bf16
with float32 accumulation. The softmax weights p = exp(s - running max) go into the value product as two bf16 terms
(`exact`, the default: hi + lo, about 16 significant bits): one bf16 term rounds p relative to a running max that
depends on where the keys fall (in the prefix or in the block, and the split boundaries move with the committed
length), so a position's output would depend on how many tokens were verified with it.

Keys and values may each be in a block type of dflash_jax/kv_quant.py (`KVBlocks`: one array per block field). The
kernel loads each field's tile [block_k, head_dim / 32, count] and decodes it in registers with
`kv_quant.block_values`, written with shifts, masks, selects and reshapes only (what the Triton lowering has; no
concatenate or gather), into rows in element order, rounded to bf16 for the products: one code path on the GPU and
in interpret mode. A rotated type (rq3_0, rq4_0) stays rotated: the wrapper rotates q instead (`rotate_query`: q . x = q' . y
for the rows x that rotated values y dequantize to) and, for values, rotates the merged output back (`unrotate`: the
output is linear in the values). The block's own rows come in the cache's type too and the block program decodes
them as the prefix programs decode the cache, so a token reads the same keys whether its ancestors are committed
(AR) or verified with it (issue 38's policy). Pallas Triton backend; `interpret=True` runs it on CPU for the tests.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dflash_jax import kv_quant as kvq
from dflash_jax.quant import Unsupported
from pallas_kernels.tiles import as_float32, dot_tile

NEG = -1e30  # finite "minus infinity": an all-masked row keeps max NEG, sum 0, and no NaN


# From this many cache slots a program takes 64 rows instead of 32 (its KV head's keys are then read by fewer row
# tiles: 3 instead of 5 for the 27B's 23 x 6 rows). With 3 pipeline stages, over the 27B's 16 layers and 23 tree
# tokens on an H200 (scripts/results/attn_tiles_h200_nov27.txt): 543 -> 434 us at 4K context (32 rows; 64 rows 543),
# 2429 -> 1962 us at 32K (64 rows; 32 rows 2560).
LONG_CACHE = 16384
NUM_STAGES = 3
# Each pipeline stage holds a key tile and a value tile in shared memory. Three stages fit the SM's 227 KiB only
# while a stage takes at most 64 KiB: the 27B's bfloat16 caches (64 keys x 256 x 2 bytes, twice) and the drafter's
# float32 ones; the 27B's float32 caches asked 283136 bytes at 3 stages and failed to launch on an H200. The block
# types' tiles are smaller (q8_0: 64 keys x 272 bytes, twice): at 3 stages Triton asks 90112-167936 bytes for them
# (scripts/results/attn_smem_sm90.txt has each case as Triton compiles it).
STAGE_BYTES = 64 * 1024


def default_block_rows(slots: int) -> int:
    """Rows (query tokens x heads of one KV head) a program takes for a cache of `slots`: 64 from LONG_CACHE
    slots, else 32."""
    return 64 if slots >= LONG_CACHE else 32


def default_stages(block_k: int, pair_bytes: int) -> int:
    """Pipeline stages for key and value tiles of block_k rows, a key row and a value row taking `pair_bytes` as
    stored (`row_bytes`): NUM_STAGES while one stage's pair of tiles fits STAGE_BYTES, else 2."""
    return NUM_STAGES if block_k * pair_bytes <= STAGE_BYTES else 2


def default_splits(slots: int) -> int:
    """Prefix splits for a cache of `slots`: about one per 1024 slots, at most 32 (partials stay small beside the
    keys they summarise; at 32K context that is 33 x 4 KV heads x 5 row tiles = 660 programs)."""
    return max(1, min(32, -(-slots // 1024)))


def _tile(ref: Any, kind: str | None, index: tuple) -> jax.Array:
    """Rows [rows, d] of the tile at `index` (the rows of one KV head): a float type's as stored, a block type's
    fields (each [rows, nb, count], `d` [rows, nb]) decoded by kv_quant.block_values (exact in float32, in the rotated
    domain for a rotated type) and rounded to bf16 as the products take them, before the reshape (which then moves
    half the bytes; docs/history.md 2026-11-27 has what that did to the compiled kernel's spills)."""
    if kind is None:
        return ref[index]
    fields = {name: r[index] for name, r in ref.items()}
    fields["d"] = fields["d"][..., None]
    values = kvq.block_values(kind, fields).astype(jnp.bfloat16)  # [rows, nb, 32]
    return values.reshape(values.shape[0], -1)


def _kernel(splits: int, br: int, block_k: int, exact: bool, interpret: bool, k_kind: str | None, v_kind: str | None,
            len_ref, layer_ref, q_ref, lo_ref, mask_ref, kc_ref, vc_ref, kb_ref, vb_ref, o_ref, m_ref, l_ref):
    # len_ref, layer_ref [1] int32; q_ref [Hkv, R, d] bf16; lo_ref [R] int32; mask_ref [R, Np] int32; kc_ref, vc_ref
    # [layers, S, Hkv, d] or fields [layers, S, Hkv, nb, count]; kb_ref, vb_ref [Hkv, Np, d] or fields [Hkv, Np, nb,
    # count]; o_ref [Hkv, splits + 1, R, d], m_ref and l_ref [Hkv, splits + 1, R] float32
    r_tile, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(r_tile * br, br)
    q = q_ref[h, rows, :]  # [br, d] bf16, scaled
    d = q.shape[-1]

    def update(carry, k, v, visible):
        m, l, acc = carry
        s = jax.lax.dot_general(q, k.astype(jnp.bfloat16), (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        s = jnp.where(visible, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        vb = v.astype(jnp.bfloat16)
        pv_dot = lambda a: jax.lax.dot_general(a, vb, (((1,), (0,)), ((), ())),  # noqa: E731
                                               preferred_element_type=jnp.float32)
        p_hi = p.astype(jnp.bfloat16)
        pv = pv_dot(p_hi)
        if exact:
            pv = pv + pv_dot((p - as_float32(p_hi, interpret)).astype(jnp.bfloat16))
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    init = (jnp.full((br,), NEG, jnp.float32), jnp.zeros((br,), jnp.float32), jnp.zeros((br, d), jnp.float32))

    def write(carry):
        m, l, acc = carry
        o_ref[h, split, rows, :] = acc
        m_ref[h, split, rows] = m
        l_ref[h, split, rows] = l

    @pl.when(split < splits)
    def _prefix():
        length, layer = len_ref[0], layer_ref[0]
        slots = jax.tree.leaves(kc_ref)[0].shape[1]
        chunk = pl.cdiv(pl.cdiv(length, splits), block_k) * block_k
        start = split * chunk
        end = jnp.minimum(start + chunk, length)
        lo = lo_ref[rows]

        def body(b, carry):
            want = start + b * block_k
            # the last block of a cache whose size is not a multiple of block_k is read ending at the cache's end
            # (no read past it); the slots before `want` it re-reads are masked off
            s0 = jnp.minimum(want, slots - block_k)
            slot = s0 + jnp.arange(block_k)
            ok = (slot >= want) & (slot < end)
            index = (layer, pl.ds(s0, block_k), h)
            k, v = _tile(kc_ref, k_kind, index), _tile(vc_ref, v_kind, index)
            visible = ok[None, :] & (slot[None, :] >= lo[:, None])
            return update(carry, k, v, visible)

        write(jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(end - start, 0), block_k), body, init))

    @pl.when(split == splits)
    def _block():
        # the block's own rows in the cache's type, decoded as the prefix's are: a token's output does not depend on
        # whether its ancestors are committed (AR) or verified with it
        n_keys = mask_ref.shape[1]
        if n_keys <= block_k:  # a tree, a draft block, a 64-token chunk: one tile
            write(update(init, _tile(kb_ref, k_kind, (h,)), _tile(vb_ref, v_kind, (h,)), mask_ref[rows, :] != 0))
            return

        def body(b, carry):  # a long prefill chunk: its keys a tile at a time (512 of the 27B's keys and values
            keys = pl.ds(b * block_k, block_k)  # are 512 KiB in bf16, past an SM's shared memory)
            return update(carry, _tile(kb_ref, k_kind, (h, keys)), _tile(vb_ref, v_kind, (h, keys)),
                          mask_ref[rows, keys] != 0)

        write(jax.lax.fori_loop(0, n_keys // block_k, body, init))


def _kind(x: Any) -> str | None:
    """The block type of rows (None for a float array)."""
    return x.kind if isinstance(x, kvq.KVBlocks) else None


def row_bytes(x: Any) -> int:
    """Bytes of one stored row: head_dim x itemsize for a float type, head_dim / 32 blocks for a block type."""
    if isinstance(x, kvq.KVBlocks):
        return x.shape[-1] // kvq.BLOCK * kvq.TYPES[x.kind].block_bytes
    return x.shape[-1] * jnp.dtype(x.dtype).itemsize


def loaded(x: Any) -> Any:
    """What the kernel loads of rows: a float array as it is; a block type's fields, `d` without its count of 1
    ([..., nb]), so that a tile of every field has the rows and blocks as its leading dimensions."""
    if not isinstance(x, kvq.KVBlocks):
        return x
    return {name: f[..., 0] if name == "d" else f for name, f in x.data.items()}


def _check(q: jax.Array, k_cache: Any, v_cache: Any, k_blk: Any, v_blk: Any, block_rows: int, block_k: int) -> None:
    """Refuse shapes and types the kernel cannot take, naming them."""
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    if hq % hkv or k_blk.shape != (n, hkv, d) or v_cache.shape != k_cache.shape or v_blk.shape != k_blk.shape:
        raise ValueError(f"shapes do not fit: q {q.shape}, caches {k_cache.shape} {v_cache.shape}, "
                         f"block {k_blk.shape} {v_blk.shape}")
    if d % 16 or block_rows % 16 or block_k % 16:
        raise ValueError(f"head_dim {d}, block_rows {block_rows} and block_k {block_k} must be multiples of 16")
    for name, cache, blk in (("keys", k_cache, k_blk), ("values", v_cache, v_blk)):
        if _kind(blk) != _kind(cache):
            raise ValueError(f"the block's {name} ({_kind(blk) or 'float'}) must be in the cache's type "
                             f"({_kind(cache) or 'float'}): the block program decodes them as the prefix's")
    nb = d // kvq.BLOCK
    if (_kind(k_cache) or _kind(v_cache)) and nb & (nb - 1):
        raise Unsupported(f"the tree-attention kernel reads a block-type KV cache for a head_dim / 32 that is a power "
                          f"of two (the Triton tiles of its fields); this model's head_dim is {d}")


@functools.partial(jax.jit, static_argnames=("splits", "block_rows", "block_k", "num_warps", "num_stages",
                                             "interpret", "exact"))
def tree_attention(q: jax.Array, k_cache: jax.Array | kvq.KVBlocks, v_cache: jax.Array | kvq.KVBlocks,
                   length: jax.Array, k_blk: jax.Array | kvq.KVBlocks, v_blk: jax.Array | kvq.KVBlocks,
                   blk_mask: jax.Array, prefix_lo: jax.Array, *, layer: int | jax.Array | None = None,
                   splits: int | None = None, block_rows: int | None = None, block_k: int = 64, num_warps: int = 4,
                   num_stages: int | None = None, interpret: bool = False, exact: bool = True) -> jax.Array:
    """Attention of q [N, Hq, d] over k/v_cache [S, Hkv, d] slots prefix_lo[i]..length-1 and the block's own
    k/v_blk [N, Hkv, d] where blk_mask [N, N]; float32 [N, Hq, d]. Every query must see at least one key.

    With `layer`, k/v_cache are stacked [layers, S, Hkv, d] and the kernel reads that layer: a slice of a stack
    passed to the kernel would be copied out first. The layer is an operand, not a constant, so that one compiled
    kernel serves every layer. Keys and values may each be in a float type (an array) or a block type
    (kv_quant.KVBlocks, fields [(layers,) S, Hkv, d / 32, count]); the block's rows must be in their cache's type."""
    if layer is None:
        k_cache, v_cache = (jax.tree.map(lambda x: x[None], c) for c in (k_cache, v_cache))
        layer = 0
    if len(k_cache.shape) != 4:
        raise ValueError(f"caches {k_cache.shape} with a layer: give stacked caches [layers, S, Hkv, d]")
    n, hq, d = q.shape
    _, s, hkv, _ = k_cache.shape
    block_rows = block_rows or default_block_rows(s)
    _check(q, k_cache, v_cache, k_blk, v_blk, block_rows, block_k)
    k_kind, v_kind = _kind(k_cache), _kind(v_cache)
    if num_stages is None:
        num_stages = default_stages(block_k, row_bytes(k_cache) + row_bytes(v_cache))
    group = hq // hkv
    splits = splits or default_splits(s)
    if s < block_k:  # a cache smaller than one key block (tests, tiny contexts): pad it, it is small
        pad = lambda x: jnp.pad(jax.lax.dynamic_index_in_dim(x, layer, keepdims=True),  # noqa: E731
                                ((0, 0), (0, block_k - s)) + ((0, 0),) * (x.ndim - 2))
        k_cache, v_cache = (jax.tree.map(pad, c) for c in (k_cache, v_cache))
        layer = 0
    rows = n * group
    r_pad = pl.cdiv(rows, block_rows) * block_rows
    n_pad = dot_tile(n) if n <= block_k else pl.cdiv(n, block_k) * block_k  # longer: read block_k keys a step
    qf, lo = query_rows(q, prefix_lo, hkv, r_pad, k_kind)
    mask = jnp.pad(jnp.repeat(blk_mask, group, axis=0), ((0, r_pad - rows), (0, n_pad - n))).astype(jnp.int32)
    # [Hkv, Np, ...]: the block's rows by KV head
    per_head = lambda x: jnp.pad(x.swapaxes(0, 1), ((0, 0), (0, n_pad - n)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
    kb, vb = (jax.tree.map(per_head, x) for x in (k_blk, v_blk))
    parts = splits + 1
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, splits, block_rows, block_k, exact, interpret, k_kind, v_kind),
        out_shape=(jax.ShapeDtypeStruct((hkv, parts, r_pad, d), jnp.float32),
                   jax.ShapeDtypeStruct((hkv, parts, r_pad), jnp.float32),
                   jax.ShapeDtypeStruct((hkv, parts, r_pad), jnp.float32)),
        grid=(r_pad // block_rows, hkv, parts),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="tree_attention",
    )(jnp.reshape(length, (1,)).astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32), qf, lo, mask,
      *map(loaded, (k_cache, v_cache, kb, vb)))
    return merge(o, m, l, n, hq, v_kind)


def query_rows(q: jax.Array, prefix_lo: jax.Array, hkv: int, r_pad: int, k_kind: str | None
               ) -> tuple[jax.Array, jax.Array]:
    """q [N, Hq, d] as the kernels' query rows [Hkv, r_pad, d] bf16 (row = token * group + head within the group,
    scaled by d^-0.5, rotated for a rotated key type, zero past N * group) and each row's prefix_lo [r_pad]."""
    n, hq, d = q.shape
    group = hq // hkv
    q = q.astype(jnp.float32)
    if k_kind and kvq.TYPES[k_kind].rotated:  # the keys stay rotated: q . x = q' . y
        q = kvq.rotate_query(q)
    qf = (q * d ** -0.5).reshape(n, hkv, group, d).transpose(1, 0, 2, 3).reshape(hkv, n * group, d)
    qf = jnp.pad(qf, ((0, 0), (0, r_pad - n * group), (0, 0))).astype(jnp.bfloat16)
    lo = jnp.pad(jnp.repeat(prefix_lo.astype(jnp.int32), group), (0, r_pad - n * group))
    return qf, lo


def merge(o: jax.Array, m: jax.Array, l: jax.Array, n: int, hq: int, v_kind: str | None) -> jax.Array:
    """The programs' softmax partials (o [Hkv, parts, r_pad, d], m and l [Hkv, parts, r_pad]) merged by
    log-sum-exp into the output [N, Hq, d] (rotated back for a rotated value type)."""
    hkv, _, _, d = o.shape
    used = n * (hq // hkv)  # the rows past it are padding: slicing first keeps the reductions from reading them
    o, m, l = o[:, :, :used], m[..., :used], l[..., :used]
    top = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp(m - top)  # [hkv, parts, used]; 0 for parts that saw no key
    total = jnp.sum(w * l, axis=1)
    out = jnp.sum(w[..., None] * o, axis=1) / jnp.where(total > 0, total, 1.0)[..., None]
    out = out.reshape(hkv, n, hq // hkv, d).transpose(1, 0, 2, 3).reshape(n, hq, d)
    return kvq.unrotate(out) if v_kind and kvq.TYPES[v_kind].rotated else out
