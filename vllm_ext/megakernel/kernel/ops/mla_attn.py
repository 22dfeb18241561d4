# SPDX-License-Identifier: Apache-2.0
"""MLA_ATTN (reference: ``ops/mla_attn.py``): absorbed decode attention of
head group g over chunk c of each request's latent rows (chunks as ATTN's),
read in place from the paged latent cache; a partial (o_latent, lse) in
fp32 per head for MLA_COMBINE.

A warp owns a head (``per_group / 8`` heads a warp when the group is
larger than the CTA's 8 warps) over all the chunk's tokens, with an online
softmax: no cross-warp merge. Lane l holds latent dims ``[l * r, (l+1) *
r)``, r = kv_lora_rank / 32, of the query and of each row (128-bit loads:
two per lane at rank 512), and lanes ``[0, rope / 8)`` one 128-bit vector
of q_pe and k_pe each. The warps of a CTA read the same rows, the later
ones from L1.

CUDA cores only: a score costs 576 multiply-adds per head and token, the
value 512, so at DeepSeek-V3's 16 heads a group the op is compute-bound
(docs/design.md); tensor cores (mma.sync over the group's heads) are left
to do."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from vllm_ext.megakernel.kernel.ops.attn import MAX_BLOCKS, NEG_INF, chunk_span
from vllm_ext.megakernel.kernel.ops.common import (
    NUM_WARPS,
    VEC,
    gmem,
    thread_ids,
    warp_sum,
)
from vllm_ext.megakernel.kernel.ops.kv import latent_row
from vllm_ext.megakernel.kernel.shape import GlobalSlot, KernelShape, LayerSlot


def heads_per_warp(shape: KernelShape) -> int:
    return max(1, shape.mla_per_group // NUM_WARPS)


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
):
    shape: KernelShape = s
    _, warp, _ = thread_ids()
    if cutlass.const_expr(shape.mla_per_group < NUM_WARPS):
        if warp < shape.mla_per_group:  # the other warps have no head
            _warp_heads(shape, ptrs, layer, glob, g, chunk, kv_block_stride,
                        block_table_stride, scale)  # fmt: skip
    else:
        _warp_heads(shape, ptrs, layer, glob, g, chunk, kv_block_stride,
                    block_table_stride, scale)  # fmt: skip


@cute.jit
def _warp_heads(s: cutlass.Constexpr, ptrs, layer, glob, g, chunk, kv_block_stride,
                block_table_stride, scale: Float32):  # fmt: skip
    """This warp's heads of group g: heads warp, warp + 8, ... of it."""
    shape: KernelShape = s
    b, rank, rope, bs = shape.batch, shape.kv_lora_rank, shape.qk_rope, shape.block_size
    heads, per, chunks = shape.mla_heads, shape.mla_per_group, shape.attn_chunks
    hpw = heads_per_warp(shape)
    r = rank // 32  # latent dims a lane
    pe_lanes = rope // VEC
    q_lat = gmem(BFloat16, ptrs[layer, LayerSlot.Q_LAT], (b, heads, rank))
    q_pe = gmem(BFloat16, ptrs[layer, LayerSlot.Q_PE], (b, heads, rope))
    seq_lens = gmem(Int32, ptrs[glob, GlobalSlot.SEQ_LENS], (b,))
    table = gmem(Int32, ptrs[glob, GlobalSlot.BLOCK_TABLE], (b, MAX_BLOCKS),
                 (block_table_stride, 1))  # fmt: skip
    groups = shape.mla_groups
    part_o = gmem(Float32, ptrs[layer, LayerSlot.PART_O],
                  (chunks, groups, b, per, rank))  # fmt: skip
    part_lse = gmem(Float32, ptrs[layer, LayerSlot.PART_LSE],
                    (chunks, groups, b, per))  # fmt: skip
    cache = ptrs[layer, LayerSlot.KV_CACHE]
    _, warp, lane = thread_ids()

    for i in cutlass.range(b):
        t_lo, t_hi = chunk_span(seq_lens[i], chunk, chunks)
        qf = cute.make_rmem_tensor((hpw, r), Float32)
        qp = cute.make_rmem_tensor((hpw, VEC), Float32)
        qp.fill(0.0)
        for k in cutlass.range_constexpr(hpw):
            head = g * per + warp + k * NUM_WARPS
            qr = cute.make_rmem_tensor((r,), BFloat16)
            qv = cute.zipped_divide(q_lat[i, head, None], (r,))
            cute.autovec_copy(qv[None, lane], qr)
            for e in cutlass.range_constexpr(r):
                qf[k, e] = qr[e].to(Float32)
            if lane < pe_lanes:
                pr = cute.make_rmem_tensor((VEC,), BFloat16)
                cute.autovec_copy(
                    cute.zipped_divide(q_pe[i, head, None], (VEC,))[None, lane], pr
                )
                for e in cutlass.range_constexpr(VEC):
                    qp[k, e] = pr[e].to(Float32)
        m = cute.make_rmem_tensor((hpw,), Float32)
        den = cute.make_rmem_tensor((hpw,), Float32)
        acc = cute.make_rmem_tensor((hpw, r), Float32)
        m.fill(NEG_INF)
        den.fill(0.0)
        acc.fill(0.0)
        # Unrolled: the next row's loads are in flight during this one's
        # softmax.
        for t in cutlass.range(t_lo, t_hi, unroll=2):
            row = latent_row(shape, cache, table[i, t // bs], t % bs, kv_block_stride)
            kr = cute.make_rmem_tensor((r,), BFloat16)
            cute.autovec_copy(cute.zipped_divide(row, (r,))[None, lane], kr)
            pr = cute.make_rmem_tensor((VEC,), BFloat16)
            pr.fill(0.0)
            if lane < pe_lanes:
                cute.autovec_copy(
                    cute.zipped_divide(row, (VEC,))[None, rank // VEC + lane], pr
                )
            kf, pf = kr.load().to(Float32), pr.load().to(Float32)
            for k in cutlass.range_constexpr(hpw):
                dot = Float32(0.0)
                for e in cutlass.range_constexpr(r):
                    dot = dot + qf[k, e] * kf[e]
                for e in cutlass.range_constexpr(VEC):
                    dot = dot + qp[k, e] * pf[e]
                score = warp_sum(dot) * scale
                m_new = cute.math.max(m[k], score)
                corr = cute.math.exp(m[k] - m_new)
                p = cute.math.exp(score - m_new)
                den[k] = den[k] * corr + p
                for e in cutlass.range_constexpr(r):
                    acc[k, e] = acc[k, e] * corr + p * kf[e]
                m[k] = m_new
        for k in cutlass.range_constexpr(hpw):
            hl = warp + k * NUM_WARPS
            o = cute.make_rmem_tensor((r,), Float32)
            o.fill(0.0)
            lse = Float32(NEG_INF)
            if den[k] > Float32(0.0):  # else: no tokens (an empty chunk)
                for e in cutlass.range_constexpr(r):
                    o[e] = acc[k, e] / den[k]
                lse = m[k] + cute.math.log(den[k])
            dst = cute.zipped_divide(part_o[chunk, g, i, hl, None], (r,))
            cute.autovec_copy(o, dst[None, lane])
            if lane == 0:
                part_lse[chunk, g, i, hl] = lse
