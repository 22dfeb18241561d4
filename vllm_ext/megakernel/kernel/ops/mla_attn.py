# SPDX-License-Identifier: Apache-2.0
"""MLA_ATTN (reference: ``ops/mla_attn.py``): absorbed decode attention of
head group g over chunk c of each request's latent rows (chunks as ATTN's),
read in place from the paged latent cache; a partial (o_latent, lse) in
fp32 per head for MLA_COMBINE.

On tensor cores (``mma.sync.m16n8k16``, bf16 in, fp32 accumulators): a
score costs 576 multiply-adds per head and token and the value 512, about
240 FLOP per cache byte at DeepSeek-V3's 128 heads, above an H200's ridge,
so CUDA cores would bound the op. The group's heads are the MMA's M (tiles
of ``HEAD_ROWS``; Kimi-K2's 8 heads a group leave half a tile zero), the
chunk's tokens go by in blocks of ``TOKENS``:

* **Scores**: warp w takes the block's tokens ``8w .. 8w + 7`` (one MMA N)
  over the whole row: lane (g, q) loads 128-bit vectors of token g's row
  and feeds their 8 values to two MMAs' k slots, the A fragment (the head
  tile's queries, staged in shared memory once per request and tile) taking
  the same permuted k (gemv_mma.py's mapping: a sum over k does not depend
  on its order).
* **Softmax**: online, over blocks, the maximum of a block shared through
  shared memory so that every warp rescales by the same factor; P rounded
  to bf16 into shared memory (the MMA's input; the denominator sums the
  fp32 values, as FlashAttention does); each warp's share of the
  denominator meets the others' at the chunk's end, in warp order.
* **Values**: warp w owns latent dims ``64w .. 64w + 63`` as eight MMA N
  blocks of 8. Column n of block b is dim ``64w + 8n + b`` (``v_dim``), so
  lane (g, q) gets all eight blocks' B fragments from one 128-bit load per
  token row (dims ``64w + 8g ..``), for the four tokens its k slots hold
  (``pv_tokens``); the A fragment is P from shared memory.

Two consumer barriers a block (the block maximum; P), one per request and
tile for the staged queries and one for the denominators. The scratch is
MLA_Q's W_UK partial sums (``red``): the instructions run one at a time.
Tokens past the chunk load a valid row (the chunk's last) and are masked
out of the softmax, so no stale row reaches a sum as NaN.

The index functions (``q_stride``, ``score_token``, ``pv_tokens``,
``v_dim``, ``scratch_floats``) are plain arithmetic that the kernel traces
and tests/megakernel/test_mla_attn_mapping.py runs in Python."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from vllm_ext.megakernel.kernel.ops.attn import MAX_BLOCKS, NEG_INF, chunk_span
from vllm_ext.megakernel.kernel.ops.common import (
    NUM_THREADS,
    NUM_WARPS,
    VEC,
    consumer_sync,
    gmem,
    thread_ids,
)
from vllm_ext.megakernel.kernel.ops.gemv_mma import (
    K_BLOCK,
    N_BLOCK,
    ROWS,
    lane_vector,
    load_frag,
    mma_bf16,
)
from vllm_ext.megakernel.kernel.ops.kv import latent_row
from vllm_ext.megakernel.kernel.shape import GlobalSlot, KernelShape, LayerSlot

HEAD_ROWS = ROWS  # heads per tile: an MMA's M
TOKENS = NUM_WARPS * N_BLOCK  # tokens per block: one MMA N a warp
K_STEP = 16  # an MMA's k: tokens per step of P @ V
P_STRIDE = TOKENS + 8  # bf16 per staged P row: rows 36 banks apart
DIMS_PER_WARP = N_BLOCK * VEC  # latent dims a warp's P @ V covers


def q_stride(width: int) -> int:
    """bf16 per staged query row: the row padded to 64 bytes past a multiple
    of 128, so that lanes g and g + 1 of a quarter warp read disjoint banks
    with their 128-bit loads."""
    stride = (width + VEC - 1) // VEC * VEC
    while stride * 2 % 128 != 64:
        stride += VEC
    return stride


def scratch_floats(width: int) -> int:
    """fp32 words of the op's shared scratch: a head tile's staged queries,
    a block's P (bf16 each) and the warps' row maxima or denominators."""
    bf16 = HEAD_ROWS * q_stride(width) + HEAD_ROWS * P_STRIDE
    return bf16 // 2 + NUM_WARPS * HEAD_ROWS


def score_token(warp, g):
    """The block's token whose scores lane group g of ``warp`` computes."""
    return warp * N_BLOCK + g


def pv_tokens(step, q):
    """The block's tokens of lane quad position ``q``'s k slots in P @ V
    step ``step``: 2q, 2q + 1 (register b0), 2q + 8, 2q + 9 (b1)."""
    t = step * K_STEP + 2 * q
    return t, t + 1, t + 8, t + 9


def v_dim(warp, col, block):
    """The latent dim of column ``col`` of N block ``block`` in ``warp``'s
    share of P @ V: lane group g's 128-bit vector holds dims ``8g ..`` of
    the share, one per block."""
    return warp * DIMS_PER_WARP + col * VEC + block


def heads_per_tile(per_group: int) -> list[int]:
    """The heads of each tile of a group (the last may be short)."""
    return [min(HEAD_ROWS, per_group - t) for t in range(0, per_group, HEAD_ROWS)]


@cute.jit
def mla_attn(
    s: cutlass.Constexpr,
    ptrs: cute.Tensor,
    layer,
    glob,
    g,
    chunk,
    kv_block_stride,
    block_table_stride,
    scale: Float32,
    red: cute.Tensor,
):
    shape: KernelShape = s
    b, rank, rope = shape.batch, shape.kv_lora_rank, shape.qk_rope
    heads, per, chunks = shape.mla_heads, shape.mla_per_group, shape.attn_chunks
    width = rank + rope
    assert rank == NUM_WARPS * DIMS_PER_WARP, "P @ V: 64 latent dims a warp"
    assert width % K_BLOCK == 0, "scores: whole k blocks of 32"
    qs_stride = q_stride(width)
    q_lat = gmem(BFloat16, ptrs[layer, LayerSlot.Q_LAT], (b, heads, rank))
    q_pe = gmem(BFloat16, ptrs[layer, LayerSlot.Q_PE], (b, heads, rope))
    seq_lens = gmem(Int32, ptrs[glob, GlobalSlot.SEQ_LENS], (b,))
    table = gmem(Int32, ptrs[glob, GlobalSlot.BLOCK_TABLE], (b, MAX_BLOCKS),
                 (block_table_stride, 1))  # fmt: skip
    part_o = gmem(Float32, ptrs[layer, LayerSlot.PART_O],
                  (chunks, shape.mla_groups, b, per, rank))  # fmt: skip
    part_lse = gmem(Float32, ptrs[layer, LayerSlot.PART_LSE],
                    (chunks, shape.mla_groups, b, per))  # fmt: skip
    cache = ptrs[layer, LayerSlot.KV_CACHE]
    base = cute.recast_ptr(red.iterator, dtype=BFloat16)
    qs = cute.make_tensor(
        base, cute.make_layout((HEAD_ROWS, qs_stride), stride=(qs_stride, 1))
    )
    ps = cute.make_tensor(
        base + HEAD_ROWS * qs_stride,
        cute.make_layout((HEAD_ROWS, P_STRIDE), stride=(P_STRIDE, 1)),
    )
    warp_red = cute.make_tensor(
        red.iterator + (HEAD_ROWS * qs_stride + HEAD_ROWS * P_STRIDE) // 2,
        cute.make_layout((NUM_WARPS, HEAD_ROWS), stride=(HEAD_ROWS, 1)),
    )
    tidx, warp, lane = thread_ids()
    gl, q = lane // 4, lane % 4
    row_vecs = width // VEC
    lat_vecs = rank // VEC

    for i in cutlass.range(b):
        t_lo, t_hi = chunk_span(seq_lens[i], chunk, chunks)
        tiles = heads_per_tile(per)
        tile0 = 0
        for ti in cutlass.range_constexpr(len(tiles)):
            rows = tiles[ti]
            h0 = g * per + tile0
            # The tile's queries [q_latent | q_pe], rows past its heads zero.
            for idx in cutlass.range(tidx, HEAD_ROWS * row_vecs, NUM_THREADS):
                r, v = idx // row_vecs, idx % row_vecs
                val = cute.make_rmem_tensor((VEC,), BFloat16)
                val.fill(0.0)
                if r < rows:
                    if v < lat_vecs:
                        src = cute.zipped_divide(q_lat[i, h0 + r, None], (VEC,))
                        cute.autovec_copy(src[None, v], val)
                    else:
                        src = cute.zipped_divide(q_pe[i, h0 + r, None], (VEC,))
                        cute.autovec_copy(src[None, v - lat_vecs], val)
                cute.autovec_copy(val, cute.zipped_divide(qs[r, None], (VEC,))[None, v])
            consumer_sync()
            m = cute.make_rmem_tensor((2,), Float32)  # rows gl, gl + 8
            den = cute.make_rmem_tensor((2,), Float32)  # this warp's tokens
            acc = cute.make_rmem_tensor((N_BLOCK, 4), Float32)
            m.fill(NEG_INF)
            den.fill(0.0)
            acc.fill(0.0)
            for t0 in cutlass.range(t_lo, t_hi, TOKENS):
                _block(shape, qs, ps, warp_red, cache, table, i, t0, t_hi,
                       kv_block_stride, scale, m, den, acc)  # fmt: skip
            # The denominators: each warp's share, summed in warp order. (A
            # warp writes here only after the block's second barrier, which
            # every warp passes after its last read of the maxima.)
            if q == 0:
                warp_red[warp, gl] = den[0]
                warp_red[warp, gl + 8] = den[1]
            consumer_sync()
            for half in cutlass.range_constexpr(2):
                r = gl + 8 * half
                total = Float32(0.0)
                for w in cutlass.range_constexpr(NUM_WARPS):
                    total = total + warp_red[w, r]
                if r < rows:
                    hl = tile0 + r
                    lse = Float32(NEG_INF)
                    inv = Float32(0.0)
                    if total > Float32(0.0):  # else: no tokens (an empty chunk)
                        lse = m[half] + cute.math.log(total)
                        inv = Float32(1.0) / total
                    for c in cutlass.range_constexpr(2):
                        o = cute.make_rmem_tensor((N_BLOCK,), Float32)
                        for nb in cutlass.range_constexpr(N_BLOCK):
                            o[nb] = acc[nb, 2 * half + c] * inv
                        out = part_o[chunk, g, i, hl, None]
                        dst = cute.zipped_divide(out, (N_BLOCK,))
                        cute.autovec_copy(
                            o, dst[None, v_dim(warp, 2 * q + c, 0) // N_BLOCK]
                        )
                    if tidx == 4 * gl:  # warp 0, quad position 0
                        part_lse[chunk, g, i, hl] = lse
            # Every warp has read the denominators before the next tile's
            # queries and maxima overwrite the scratch.
            consumer_sync()
            tile0 += rows


@cute.jit
def _block(
    s: cutlass.Constexpr, qs, ps, warp_red, cache, table, i, t0, t_hi,
    kv_block_stride, scale: Float32, m, den, acc,
):  # fmt: skip
    """One block of ``TOKENS`` tokens from ``t0``: scores, the online
    softmax's update of (m, den, acc) and P @ V."""
    shape: KernelShape = s
    width = shape.kv_lora_rank + shape.qk_rope
    _, warp, lane = thread_ids()
    gl, q = lane // 4, lane % 4

    # Scores of heads (gl, gl + 8) x tokens (2q, 2q + 1) of the warp's 8.
    sc = cute.make_rmem_tensor((4,), Float32)
    sc.fill(0.0)
    krow = cute.zipped_divide(
        _row(shape, cache, table, i, t0 + score_token(warp, gl), t_hi, kv_block_stride),
        (VEC,),
    )
    qlo = cute.zipped_divide(qs[gl, None], (VEC,))
    qhi = cute.zipped_divide(qs[gl + 8, None], (VEC,))
    for kb in cutlass.range_constexpr(width // K_BLOCK):
        j = lane_vector(kb, q)
        a_lo = cute.make_rmem_tensor((4,), Int32)
        a_hi = cute.make_rmem_tensor((4,), Int32)
        kv = cute.make_rmem_tensor((4,), Int32)
        load_frag(qlo, j, a_lo)
        load_frag(qhi, j, a_hi)
        load_frag(krow, j, kv)
        for e in cutlass.range_constexpr(0, 4, 2):
            d = mma_bf16(a_lo[e], a_hi[e], a_lo[e + 1], a_hi[e + 1], kv[e], kv[e + 1],
                         sc[0], sc[1], sc[2], sc[3])  # fmt: skip
            for c in cutlass.range_constexpr(4):
                sc[c] = d[c]
    col0 = t0 + score_token(warp, 0) + 2 * q
    for c in cutlass.range_constexpr(4):
        sc[c] = sc[c] * scale
        if col0 + c % 2 >= t_hi:
            sc[c] = Float32(NEG_INF)
    # The block's maximum of each head, through the warps' maxima.
    for half in cutlass.range_constexpr(2):
        mx = cute.math.max(sc[2 * half], sc[2 * half + 1])
        mx = cute.math.max(mx, cute.arch.shuffle_sync_bfly(mx, 1))
        mx = cute.math.max(mx, cute.arch.shuffle_sync_bfly(mx, 2))
        if q == 0:
            warp_red[warp, gl + 8 * half] = mx
    consumer_sync()
    for half in cutlass.range_constexpr(2):
        bm = warp_red[0, gl + 8 * half]
        for w in cutlass.range_constexpr(1, NUM_WARPS):
            bm = cute.math.max(bm, warp_red[w, gl + 8 * half])
        m_new = cute.math.max(m[half], bm)  # finite: t0 < t_hi
        corr = cute.math.exp(m[half] - m_new)
        p0 = cute.math.exp(sc[2 * half] - m_new)
        p1 = cute.math.exp(sc[2 * half + 1] - m_new)
        part = p0 + p1
        part = part + cute.arch.shuffle_sync_bfly(part, 1)
        part = part + cute.arch.shuffle_sync_bfly(part, 2)
        den[half] = den[half] * corr + part
        for nb in cutlass.range_constexpr(N_BLOCK):
            acc[nb, 2 * half] = acc[nb, 2 * half] * corr
            acc[nb, 2 * half + 1] = acc[nb, 2 * half + 1] * corr
        m[half] = m_new
        pair = cute.make_rmem_tensor((2,), BFloat16)
        pair[0] = p0.to(BFloat16)
        pair[1] = p1.to(BFloat16)
        dst = cute.zipped_divide(ps[gl + 8 * half, None], (2,))
        cute.autovec_copy(pair, dst[None, (score_token(warp, 0) + 2 * q) // 2])
    consumer_sync()
    # P @ V over the block's tokens, 16 a step; this warp's 64 latent dims.
    plo = cute.zipped_divide(ps[gl, None], (2,))
    phi = cute.zipped_divide(ps[gl + 8, None], (2,))
    for step in cutlass.range_constexpr(TOKENS // K_STEP):
        t_a, t_b, t_c, t_d = pv_tokens(step, q)
        a0, a1 = _pair(plo, t_a // 2), _pair(phi, t_a // 2)
        a2, a3 = _pair(plo, t_c // 2), _pair(phi, t_c // 2)
        ts = (t_a, t_b, t_c, t_d)
        vecs = cute.make_rmem_tensor((4, VEC), BFloat16)
        for k in cutlass.range_constexpr(4):
            row = _row(shape, cache, table, i, t0 + ts[k], t_hi, kv_block_stride)
            src = cute.zipped_divide(row, (VEC,))
            cute.autovec_copy(src[None, v_dim(warp, gl, 0) // VEC], vecs[k, None])
        for nb in cutlass.range_constexpr(N_BLOCK):
            b0 = cute.make_rmem_tensor((2,), BFloat16)
            b1 = cute.make_rmem_tensor((2,), BFloat16)
            b0[0], b0[1] = vecs[0, nb], vecs[1, nb]
            b1[0], b1[1] = vecs[2, nb], vecs[3, nb]
            d = mma_bf16(a0, a1, a2, a3,
                         cute.recast_tensor(b0, Int32)[0],
                         cute.recast_tensor(b1, Int32)[0],
                         acc[nb, 0], acc[nb, 1], acc[nb, 2], acc[nb, 3])  # fmt: skip
            for c in cutlass.range_constexpr(4):
                acc[nb, c] = d[c]


def _row(shape: KernelShape, cache, table, i, t, t_hi, kv_block_stride):
    """Request i's latent row of token t; a token past the chunk reads the
    chunk's last row (its scores are masked out, its P is zero)."""
    tc = cutlass.min(t, t_hi - 1)
    bs = shape.block_size
    return latent_row(shape, cache, table[i, tc // bs], tc % bs, kv_block_stride)


def _pair(pairs: cute.Tensor, j) -> Int32:
    """Pair ``j`` of a bf16 row (one 32-bit shared load), packed."""
    r = cute.make_rmem_tensor((2,), BFloat16)
    cute.autovec_copy(pairs[None, j], r)
    return cute.recast_tensor(r, Int32)[0]
