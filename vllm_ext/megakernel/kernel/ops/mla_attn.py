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

**A verify step's shared pass** (``KernelShape.query_rows`` > 1): the
rows of a request (the step's query map: its first row and row count) go
together, heads x rows as the MMA's M (``query_row``: rows outer, the
group's heads inner), tiled by ``HEAD_ROWS``; up to ``pass_tiles`` tiles
share a pass, so each block's latent rows are loaded once for all their
heads and rows (a fragment feeds each tile's MMAs) and a request's cache is
read ``ceil(tiles / pass_tiles)`` times, not once a row. The chunks are the
request's longest row's (its last), and each M row masks the tokens past
its own row's length (causal among the step's tokens); a row with no token
in the chunk keeps (o, lse) = (0, -inf), its maximum's reference point 0
so that no -inf - -inf reaches an exponential. A pass of two tiles rolls
P @ V's four steps ``PV_UNROLL`` at a time: unrolled, the rows ptxas keeps
in flight beside 64 accumulators went past the consumers' registers. With
``query_rows`` 1 the code is the kernel's without speculation (a row per
request, a tile at a time).

The index functions (``q_stride``, ``score_token``, ``pv_tokens``,
``v_dim``, ``query_row``, ``pass_tiles``, ``scratch_floats``) are plain
arithmetic that the kernel traces and tests/megakernel/test_mla_attn_mapping.py
runs in Python."""

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
# M tiles a shared pass holds in flight: 32 accumulators a tile and lane.
PASS_TILES = 2
# P @ V steps a pass of two tiles unrolls (of TOKENS // K_STEP): all four
# (the tile-at-a-time kernel's) left five words in local memory on sm_100a
# (DeepSeek-V3 at 2, 4 and 8 rows, batches 16 and 64; Kimi-K2 at 4 rows):
# ptxas had 3 steps' 48 registers of rows in flight beside the 64
# accumulators. Two keep every built shape clean (docs/design.md, MLA_ATTN).
PV_UNROLL = 2


def q_stride(width: int) -> int:
    """bf16 per staged query row: the row padded to 64 bytes past a multiple
    of 128, so that lanes g and g + 1 of a quarter warp read disjoint banks
    with their 128-bit loads."""
    stride = (width + VEC - 1) // VEC * VEC
    while stride * 2 % 128 != 64:
        stride += VEC
    return stride


def scratch_floats(width: int, tiles: int = 1) -> int:
    """fp32 words of the op's shared scratch: a pass's tiles' staged
    queries, a block's P (bf16 each) and the warps' row maxima or
    denominators."""
    bf16 = tiles * (HEAD_ROWS * q_stride(width) + HEAD_ROWS * P_STRIDE)
    return bf16 // 2 + tiles * NUM_WARPS * HEAD_ROWS


def pass_tiles(per_group: int, query_rows: int) -> int:
    """M tiles of a pass: one (a tile of heads at a time) with a row per
    request; with a verify step's rows, heads x rows up to ``PASS_TILES``."""
    if query_rows == 1:
        return 1
    return min(-(-per_group * query_rows // HEAD_ROWS), PASS_TILES)


def query_row(m, per_group: int):
    """(row of the request, head of the group) of M row ``m`` of a shared
    pass: rows outer, so a request of fewer rows leaves the tail empty."""
    return m // per_group, m % per_group


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
    n_tiles = pass_tiles(per, shape.query_rows)
    m_rows = n_tiles * HEAD_ROWS
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
        base, cute.make_layout((m_rows, qs_stride), stride=(qs_stride, 1))
    )
    ps = cute.make_tensor(
        base + m_rows * qs_stride,
        cute.make_layout((m_rows, P_STRIDE), stride=(P_STRIDE, 1)),
    )
    warp_red = cute.make_tensor(
        red.iterator + (m_rows * qs_stride + m_rows * P_STRIDE) // 2,
        cute.make_layout((NUM_WARPS, m_rows), stride=(m_rows, 1)),
    )
    views = (q_lat, q_pe, seq_lens, table, part_o, part_lse, cache, qs, ps, warp_red)
    if cutlass.const_expr(shape.query_rows == 1):
        for i in cutlass.range(b):
            t_lo, t_hi = chunk_span(seq_lens[i], chunk, chunks)
            tiles = heads_per_tile(per)
            tile0 = 0
            for ti in cutlass.range_constexpr(len(tiles)):
                _pass(shape, views, g, chunk, i, t_lo, t_hi, tile0,
                      tile0 + tiles[ti], 1, kv_block_stride, scale)  # fmt: skip
                tile0 += tiles[ti]
    else:
        for i in cutlass.range(b):
            # (Made in the loop: a view held across it went to the stack.)
            qmap = gmem(Int32, ptrs[glob, GlobalSlot.QUERY_MAP], (b, 2))
            if qmap[i, 0] == i:  # the request's first row: its rows' pass
                count = qmap[i, 1]
                # The chunks of the request's longest row (its last).
                t_lo, t_hi = chunk_span(seq_lens[i + count - 1], chunk, chunks)
                for m0 in cutlass.range(0, per * count, m_rows):
                    _pass(shape, views, g, chunk, i, t_lo, t_hi, m0, per * count,
                          count, kv_block_stride, scale)  # fmt: skip


@cute.jit
def _pass(
    s: cutlass.Constexpr, views, g, chunk, i, t_lo, t_hi, m0, m_end, count,
    kv_block_stride, scale: Float32,
):  # fmt: skip
    """One pass over the chunk's tokens for M rows ``m0 ..`` of request
    ``i`` (up to ``pass_tiles`` tiles; those at ``m_end`` and past it
    zero): with a row per request (``count`` 1 at trace time) M rows are
    the group's heads from ``m0``, else (row, head) by ``query_row``."""
    shape: KernelShape = s
    q_lat, q_pe, seq_lens, table, part_o, part_lse, cache, qs, ps, warp_red = views
    per, rank = shape.mla_per_group, shape.kv_lora_rank
    width = rank + shape.qk_rope
    shared = shape.query_rows > 1
    n_tiles = pass_tiles(per, shape.query_rows)
    tidx, warp, lane = thread_ids()
    gl, q = lane // 4, lane % 4
    row_vecs = width // VEC
    lat_vecs = rank // VEC
    # The pass's queries [q_latent | q_pe], rows past its M rows zero.
    for idx in cutlass.range(tidx, n_tiles * HEAD_ROWS * row_vecs, NUM_THREADS):
        r, v = idx // row_vecs, idx % row_vecs
        val = cute.make_rmem_tensor((VEC,), BFloat16)
        val.fill(0.0)
        if r < m_end - m0:
            row, h = i, g * per + m0 + r
            if cutlass.const_expr(shared):
                rr, hh = query_row(m0 + r, per)
                row, h = i + rr, g * per + hh
            if v < lat_vecs:
                src = cute.zipped_divide(q_lat[row, h, None], (VEC,))
                cute.autovec_copy(src[None, v], val)
            else:
                src = cute.zipped_divide(q_pe[row, h, None], (VEC,))
                cute.autovec_copy(src[None, v - lat_vecs], val)
        cute.autovec_copy(val, cute.zipped_divide(qs[r, None], (VEC,))[None, v])
    consumer_sync()
    m = cute.make_rmem_tensor((n_tiles, 2), Float32)  # rows gl, gl + 8
    den = cute.make_rmem_tensor((n_tiles, 2), Float32)  # this warp's tokens
    acc = cute.make_rmem_tensor((n_tiles, N_BLOCK, 4), Float32)
    m.fill(NEG_INF)
    den.fill(0.0)
    acc.fill(0.0)
    # Each M row's own length (its row's: causal); rows past the request's
    # the chunk's end, as zero queries they are finite and never written.
    lens = cute.make_rmem_tensor((n_tiles, 2), Int32)
    for ti in cutlass.range_constexpr(n_tiles):
        for half in cutlass.range_constexpr(2):
            lens[ti, half] = t_hi
            if cutlass.const_expr(shared):
                mr = m0 + ti * HEAD_ROWS + gl + 8 * half
                if mr < m_end:
                    lens[ti, half] = seq_lens[i + query_row(mr, per)[0]]
    for t0 in cutlass.range(t_lo, t_hi, TOKENS):
        _block(shape, qs, ps, warp_red, cache, table, i, t0, t_hi,
               kv_block_stride, scale, m, den, acc, lens)  # fmt: skip
    # The denominators: each warp's share, summed in warp order. (A warp
    # writes here only after the block's second barrier, which every warp
    # passes after its last read of the maxima.)
    if q == 0:
        for ti in cutlass.range_constexpr(n_tiles):
            warp_red[warp, ti * HEAD_ROWS + gl] = den[ti, 0]
            warp_red[warp, ti * HEAD_ROWS + gl + 8] = den[ti, 1]
    consumer_sync()
    for ti in cutlass.range_constexpr(n_tiles):
        for half in cutlass.range_constexpr(2):
            r = ti * HEAD_ROWS + gl + 8 * half
            total = Float32(0.0)
            for w in cutlass.range_constexpr(NUM_WARPS):
                total = total + warp_red[w, r]
            if r < m_end - m0:
                row, hl = i, m0 + r
                if cutlass.const_expr(shared):
                    rr, hl = query_row(m0 + r, per)
                    row = i + rr
                lse = Float32(NEG_INF)
                inv = Float32(0.0)
                if total > Float32(0.0):  # else: no tokens (an empty chunk)
                    lse = m[ti, half] + cute.math.log(total)
                    inv = Float32(1.0) / total
                for c in cutlass.range_constexpr(2):
                    o = cute.make_rmem_tensor((N_BLOCK,), Float32)
                    for nb in cutlass.range_constexpr(N_BLOCK):
                        o[nb] = acc[ti, nb, 2 * half + c] * inv
                    out = part_o[chunk, g, row, hl, None]
                    dst = cute.zipped_divide(out, (N_BLOCK,))
                    cute.autovec_copy(
                        o, dst[None, v_dim(warp, 2 * q + c, 0) // N_BLOCK]
                    )
                if tidx == 4 * gl:  # warp 0, quad position 0
                    part_lse[chunk, g, row, hl] = lse
    # Every warp has read the denominators before the next pass's queries
    # and maxima overwrite the scratch.
    consumer_sync()


@cute.jit
def _block(
    s: cutlass.Constexpr, qs, ps, warp_red, cache, table, i, t0, t_hi,
    kv_block_stride, scale: Float32, m, den, acc, lens,
):  # fmt: skip
    """One block of ``TOKENS`` tokens from ``t0`` for the pass's tiles:
    scores, the online softmax's update of (m, den, acc) and P @ V, each
    latent fragment loaded once for every tile."""
    shape: KernelShape = s
    width = shape.kv_lora_rank + shape.qk_rope
    shared = shape.query_rows > 1
    n_tiles = pass_tiles(shape.mla_per_group, shape.query_rows)
    _, warp, lane = thread_ids()
    gl, q = lane // 4, lane % 4

    # Scores of M rows (gl, gl + 8) of each tile x tokens (2q, 2q + 1) of
    # the warp's 8.
    sc = cute.make_rmem_tensor((n_tiles, 4), Float32)
    sc.fill(0.0)
    krow = cute.zipped_divide(
        _row(shape, cache, table, i, t0 + score_token(warp, gl), t_hi, kv_block_stride),
        (VEC,),
    )
    kv = cute.make_rmem_tensor((4,), Int32)
    for kb in cutlass.range_constexpr(width // K_BLOCK):
        j = lane_vector(kb, q)
        for ti in cutlass.range_constexpr(n_tiles):
            qlo = cute.zipped_divide(qs[ti * HEAD_ROWS + gl, None], (VEC,))
            qhi = cute.zipped_divide(qs[ti * HEAD_ROWS + gl + 8, None], (VEC,))
            a_lo = cute.make_rmem_tensor((4,), Int32)
            a_hi = cute.make_rmem_tensor((4,), Int32)
            load_frag(qlo, j, a_lo)
            load_frag(qhi, j, a_hi)
            if cutlass.const_expr(ti == 0):  # the block's row: once a k block
                load_frag(krow, j, kv)
            for e in cutlass.range_constexpr(0, 4, 2):
                d = mma_bf16(a_lo[e], a_hi[e], a_lo[e + 1], a_hi[e + 1], kv[e],
                             kv[e + 1], sc[ti, 0], sc[ti, 1], sc[ti, 2],
                             sc[ti, 3])  # fmt: skip
                for c in cutlass.range_constexpr(4):
                    sc[ti, c] = d[c]
    col0 = t0 + score_token(warp, 0) + 2 * q
    for ti in cutlass.range_constexpr(n_tiles):
        for c in cutlass.range_constexpr(4):
            sc[ti, c] = sc[ti, c] * scale
            if col0 + c % 2 >= lens[ti, c // 2]:
                sc[ti, c] = Float32(NEG_INF)
    # The block's maximum of each M row, through the warps' maxima.
    for ti in cutlass.range_constexpr(n_tiles):
        for half in cutlass.range_constexpr(2):
            mx = cute.math.max(sc[ti, 2 * half], sc[ti, 2 * half + 1])
            mx = cute.math.max(mx, cute.arch.shuffle_sync_bfly(mx, 1))
            mx = cute.math.max(mx, cute.arch.shuffle_sync_bfly(mx, 2))
            if q == 0:
                warp_red[warp, ti * HEAD_ROWS + gl + 8 * half] = mx
    consumer_sync()
    for ti in cutlass.range_constexpr(n_tiles):
        for half in cutlass.range_constexpr(2):
            r = ti * HEAD_ROWS + gl + 8 * half
            bm = warp_red[0, r]
            for w in cutlass.range_constexpr(1, NUM_WARPS):
                bm = cute.math.max(bm, warp_red[w, r])
            # Finite with a row per request (t0 < t_hi); a shared pass's row
            # may have no token yet: its reference point is then 0.
            m_new = cute.math.max(m[ti, half], bm)
            m_ref = m_new
            if cutlass.const_expr(shared):
                if m_new == Float32(NEG_INF):
                    m_ref = Float32(0.0)
            corr = cute.math.exp(m[ti, half] - m_ref)
            p0 = cute.math.exp(sc[ti, 2 * half] - m_ref)
            p1 = cute.math.exp(sc[ti, 2 * half + 1] - m_ref)
            part = p0 + p1
            part = part + cute.arch.shuffle_sync_bfly(part, 1)
            part = part + cute.arch.shuffle_sync_bfly(part, 2)
            den[ti, half] = den[ti, half] * corr + part
            for nb in cutlass.range_constexpr(N_BLOCK):
                acc[ti, nb, 2 * half] = acc[ti, nb, 2 * half] * corr
                acc[ti, nb, 2 * half + 1] = acc[ti, nb, 2 * half + 1] * corr
            m[ti, half] = m_new
            pair = cute.make_rmem_tensor((2,), BFloat16)
            pair[0] = p0.to(BFloat16)
            pair[1] = p1.to(BFloat16)
            dst = cute.zipped_divide(ps[r, None], (2,))
            cute.autovec_copy(pair, dst[None, (score_token(warp, 0) + 2 * q) // 2])
    consumer_sync()
    # P @ V over the block's tokens, 16 a step; this warp's 64 latent dims,
    # each token's vector loaded once for every tile. Unrolled, ptxas issues
    # three steps' loads at once; beside two tiles' accumulators that is
    # past the consumers' registers, so a pass of two tiles rolls the steps
    # ``PV_UNROLL`` at a time (two steps' loads in flight).
    if cutlass.const_expr(n_tiles > 1):
        for step in cutlass.range(TOKENS // K_STEP, unroll=PV_UNROLL):
            _pv_step(shape, ps, cache, table, i, t0, t_hi, kv_block_stride,
                     acc, step)  # fmt: skip
    else:
        for step in cutlass.range_constexpr(TOKENS // K_STEP):
            _pv_step(shape, ps, cache, table, i, t0, t_hi, kv_block_stride,
                     acc, step)  # fmt: skip


@cute.jit
def _pv_step(
    s: cutlass.Constexpr, ps, cache, table, i, t0, t_hi, kv_block_stride, acc, step
):
    """P @ V step ``step`` of a block: its 16 tokens' rows, one 128-bit
    vector each (this lane's 8 dims of the warp's 64), fed to every
    tile's MMAs, N blocks outer (each block's values die after the
    tiles' MMAs)."""
    shape: KernelShape = s
    n_tiles = pass_tiles(shape.mla_per_group, shape.query_rows)
    _, warp, lane = thread_ids()
    gl, q = lane // 4, lane % 4
    t_a, t_b, t_c, t_d = pv_tokens(step, q)
    a = cute.make_rmem_tensor((n_tiles, 4), Int32)
    for ti in cutlass.range_constexpr(n_tiles):
        plo = cute.zipped_divide(ps[ti * HEAD_ROWS + gl, None], (2,))
        phi = cute.zipped_divide(ps[ti * HEAD_ROWS + gl + 8, None], (2,))
        a[ti, 0], a[ti, 1] = _pair(plo, t_a // 2), _pair(phi, t_a // 2)
        a[ti, 2], a[ti, 3] = _pair(plo, t_c // 2), _pair(phi, t_c // 2)
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
        for ti in cutlass.range_constexpr(n_tiles):
            d = mma_bf16(a[ti, 0], a[ti, 1], a[ti, 2], a[ti, 3],
                         cute.recast_tensor(b0, Int32)[0],
                         cute.recast_tensor(b1, Int32)[0],
                         acc[ti, nb, 0], acc[ti, nb, 1], acc[ti, nb, 2],
                         acc[ti, nb, 3])  # fmt: skip
            for c in cutlass.range_constexpr(4):
                acc[ti, nb, c] = d[c]


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
