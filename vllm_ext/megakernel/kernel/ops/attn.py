# SPDX-License-Identifier: Apache-2.0
"""ATTN (reference: ``ops/attn.py``): kv head g's q heads over chunk c of
each request's cached sequence, read in place from vLLM's paged cache;
writes a partial (o, lse) in fp32 for COMBINE.

Chunk c of a sequence of length n is tokens [c * ceil(n / chunks), ...)
clipped to n, so the program is fixed while lengths vary per step. Warps
take the chunk's tokens in turn with an online softmax each (lane l holds
head dims [l * d/32, (l+1) * d/32) of q, K, V); the warps' states then
merge in shared memory.

With ``shape.qk_in_attn`` (isa.py) ATTN first finishes the new K of the
requests whose newest token its chunk holds, and finishes q as it loads it
(``qk_finish.py``)."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from vllm_ext.megakernel.kernel.ops.common import (
    MAX_POSITIONS,
    NUM_THREADS,
    NUM_WARPS,
    consumer_sync,
    gmem,
    thread_ids,
    warp_sum,
)
from vllm_ext.megakernel.kernel.ops.kv import kv_entry, kv_slot_entry
from vllm_ext.megakernel.kernel.ops.qk_finish import norm_rope
from vllm_ext.megakernel.kernel.shape import GlobalSlot, KernelShape, LayerSlot

NEG_INF = float("-inf")
# Extent given to the block table view: only [0, ceil(len / block_size))
# of a row is read.
MAX_BLOCKS = 1 << 20


def chunk_span(n, chunk, chunks: int):
    """Tokens [lo, hi) of chunk ``chunk`` of a sequence of length ``n``:
    ``ceil(n / chunks)`` a chunk, clipped to n (trace time, dynamic values)."""
    size = (n + chunks - 1) // chunks
    lo = cutlass.min(chunk * size, n)
    return lo, cutlass.min(lo + size, n)


def qk_views(shape: KernelShape, ptrs: cute.Tensor, layer, glob):
    """What finishing q and the new K reads (``shape.qk_in_attn``): q_norm,
    k_norm, the positions, the cos/sin table and the slot mapping."""
    d = shape.head_dim
    return (
        gmem(BFloat16, ptrs[layer, LayerSlot.Q_NORM], (d,)),
        gmem(BFloat16, ptrs[layer, LayerSlot.K_NORM], (d,)),
        gmem(Int32, ptrs[glob, GlobalSlot.POSITIONS], (shape.batch,)),
        gmem(Float32, ptrs[glob, GlobalSlot.COS_SIN], (MAX_POSITIONS, d)),
        gmem(Int32, ptrs[glob, GlobalSlot.SLOT_MAPPING], (shape.batch,)),
    )


@cute.jit
def finish_new_k(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, glob, g, chunk,
                 kv_block_stride):  # fmt: skip
    """In place in the cache (``shape.qk_in_attn``; reference:
    ``ops/attn.finish_new_k``): QK-norm and RoPE of kv head g's new K, which
    QKV stored as projected, for each request whose newest token this chunk
    holds (the one chunk that reads it). A warp per request, then the
    consumers' barrier: the chunk's warps read that row next."""
    shape: KernelShape = s
    b, per_lane = shape.batch, shape.head_dim // 32
    _, k_norm, positions, cos_sin, slots = qk_views(shape, ptrs, layer, glob)
    seq_lens = gmem(Int32, ptrs[glob, GlobalSlot.SEQ_LENS], (b,))
    cache = ptrs[layer, LayerSlot.KV_CACHE]
    _, warp, lane = thread_ids()
    for i in cutlass.range(warp, b, NUM_WARPS):
        n = seq_lens[i]
        lo, hi = chunk_span(n, chunk, shape.attn_chunks)
        slot = slots[i]
        if (lo < n) & (hi == n) & (slot >= 0):  # warp-uniform
            entry = kv_slot_entry(shape, cache, slot, g, kv_block_stride)
            kv = cute.zipped_divide(entry, (per_lane,))  # column l: K's lane l
            kr = cute.make_rmem_tensor((per_lane,), BFloat16)
            cute.autovec_copy(kv[None, lane], kr)
            kf = cute.make_rmem_tensor((per_lane,), Float32)
            kf.store(kr.load().to(Float32))
            norm_rope(shape, kf, per_lane, lane * per_lane, 32, k_norm,
                      positions[i], cos_sin)  # fmt: skip
            kr.store(kf.load().to(BFloat16))
            cute.autovec_copy(kr, kv[None, lane])
    consumer_sync()


def attn_views(shape: KernelShape, ptrs: cute.Tensor, layer, glob, block_table_stride):
    """What ATTN reads and writes (every variant of it): q, the sequence
    lengths, the block table, the partial (o, lse) and this layer's cache."""
    b, d, group, chunks = shape.batch, shape.head_dim, shape.group, shape.attn_chunks
    nkv = shape.kv_heads
    q = gmem(BFloat16, ptrs[layer, LayerSlot.Q], (b, shape.q_heads, d))
    seq_lens = gmem(Int32, ptrs[glob, GlobalSlot.SEQ_LENS], (b,))
    table = gmem(Int32, ptrs[glob, GlobalSlot.BLOCK_TABLE], (b, MAX_BLOCKS),
                 (block_table_stride, 1))  # fmt: skip
    part_o = gmem(Float32, ptrs[layer, LayerSlot.PART_O], (chunks, nkv, b, group, d))
    part_lse = gmem(Float32, ptrs[layer, LayerSlot.PART_LSE], (chunks, nkv, b, group))
    return q, seq_lens, table, part_o, part_lse, ptrs[layer, LayerSlot.KV_CACHE]


@cute.jit
def attn(
    s: cutlass.Constexpr,
    ptrs: cute.Tensor,
    layer,
    glob,
    g,
    chunk,
    kv_block_stride,
    block_table_stride,
    scale: Float32,
    warp_m: cute.Tensor,  # smem [NUM_WARPS, group] fp32
    warp_l: cute.Tensor,  # smem [NUM_WARPS, group]
    warp_o: cute.Tensor,  # smem [NUM_WARPS, group, head_dim]
):
    shape: KernelShape = s
    b, d, group, chunks = shape.batch, shape.head_dim, shape.group, shape.attn_chunks
    bs = shape.block_size
    per_lane = d // 32
    q, seq_lens, table, part_o, part_lse, cache = attn_views(
        shape, ptrs, layer, glob, block_table_stride
    )
    tidx, warp, lane = thread_ids()
    if cutlass.const_expr(shape.qk_in_attn):
        finish_new_k(shape, ptrs, layer, glob, g, chunk, kv_block_stride)
        q_norm, _, positions, cos_sin, _ = qk_views(shape, ptrs, layer, glob)

    for i in cutlass.range(b):
        t_lo, t_hi = chunk_span(seq_lens[i], chunk, chunks)
        qf = cute.make_rmem_tensor((group, per_lane), Float32)
        for gi in cutlass.range_constexpr(group):
            qv = cute.zipped_divide(q[i, g * group + gi, None], (per_lane,))
            qr = cute.make_rmem_tensor((per_lane,), BFloat16)
            cute.autovec_copy(qv[None, lane], qr)
            head = cute.make_rmem_tensor((per_lane,), Float32)
            head.store(qr.load().to(Float32))
            if cutlass.const_expr(shape.qk_in_attn):
                norm_rope(shape, head, per_lane, lane * per_lane, 32, q_norm,
                          positions[i], cos_sin)  # fmt: skip
            for e in cutlass.range_constexpr(per_lane):
                qf[gi, e] = head[e]
        m = cute.make_rmem_tensor((group,), Float32)
        den = cute.make_rmem_tensor((group,), Float32)
        acc = cute.make_rmem_tensor((group, per_lane), Float32)
        m.fill(NEG_INF)
        den.fill(0.0)
        acc.fill(0.0)
        # Unrolled so the K/V loads of several tokens are in flight at once
        # (the softmax chain between them is short; the loads are not).
        for t in cutlass.range(t_lo + warp, t_hi, NUM_WARPS, unroll=4):
            entry = kv_entry(shape, cache, table[i, t // bs], t % bs, g,
                             kv_block_stride)  # fmt: skip
            ev = cute.zipped_divide(entry, (per_lane,))  # column l: K, 32 + l: V
            kr = cute.make_rmem_tensor((per_lane,), BFloat16)
            vr = cute.make_rmem_tensor((per_lane,), BFloat16)
            cute.autovec_copy(ev[None, lane], kr)
            cute.autovec_copy(ev[None, 32 + lane], vr)
            kf, vf = kr.load().to(Float32), vr.load().to(Float32)
            for gi in cutlass.range_constexpr(group):
                dot = Float32(0.0)
                for e in cutlass.range_constexpr(per_lane):
                    dot = dot + qf[gi, e] * kf[e]
                score = warp_sum(dot) * scale
                m_new = cute.math.max(m[gi], score)
                corr = cute.math.exp(m[gi] - m_new)
                p = cute.math.exp(score - m_new)
                den[gi] = den[gi] * corr + p
                for e in cutlass.range_constexpr(per_lane):
                    acc[gi, e] = acc[gi, e] * corr + p * vf[e]
                m[gi] = m_new
        for gi in cutlass.range_constexpr(group):
            if lane == 0:
                warp_m[warp, gi] = m[gi]
                warp_l[warp, gi] = den[gi]
            for e in cutlass.range_constexpr(per_lane):
                warp_o[warp, gi, lane * per_lane + e] = acc[gi, e]
        consumer_sync()
        for idx in cutlass.range(tidx, group * d, NUM_THREADS):
            gi, dim = idx // d, idx % d
            top = Float32(NEG_INF)
            for w in cutlass.range_constexpr(NUM_WARPS):
                top = cute.math.max(top, warp_m[w, gi])
            o, lse = Float32(0.0), Float32(NEG_INF)
            if top > Float32(NEG_INF):  # else: no tokens (an empty chunk)
                total, num = Float32(0.0), Float32(0.0)
                for w in cutlass.range_constexpr(NUM_WARPS):
                    scale_w = cute.math.exp(warp_m[w, gi] - top)
                    total = total + warp_l[w, gi] * scale_w
                    num = num + warp_o[w, gi, dim] * scale_w
                o = num / total
                lse = top + cute.math.log(total)
            part_o[chunk, g, i, gi, dim] = o
            if dim == 0:
                part_lse[chunk, g, i, gi] = lse
        consumer_sync()  # the warp states are reused by the next row
