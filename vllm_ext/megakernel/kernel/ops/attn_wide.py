# SPDX-License-Identifier: Apache-2.0
"""ATTN with 128-bit K/V loads and requests side by side (experimental,
``KernelShape.wide_attn``; reference: ``ops/attn.py``, the same contract as
``kernel/ops/attn.py``).

On the H200 (2026-11-30) ATTN read KV at 0.1 TB/s and its time grew
linearly with the batch (1B: 0.17 ms at batch 1, 1.6 ms at 16): the default
walks the batch one request at a time with two CTA barriers each, and a
lane loads 4 bytes of a token's K and of its V. Here:

- a lane loads 8 dims (16 bytes) of K and of V, so ``d / 8`` lanes cover a
  token and a warp reads ``256 / d`` tokens per load (4 at d=64, 2 at 128);
  the q.k partial sums meet in a shuffle within those lanes;
- the CTA works on ``min(B, 8)`` requests at once, ``8 // that`` warps on
  each (at batch >= 8, one warp per request and no split of its tokens);
- each token group keeps its own online softmax; the groups of a warp merge
  by shuffles, the warps of a request in shared memory, then one write of
  the partial (o, lse) per (request, q head).

QK-norm and RoPE where QKV left them (``shape.qk_in_attn``) as in attn.py.
"""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from vllm_ext.megakernel.kernel.ops.attn import (
    attn_views,
    chunk_span,
    finish_new_k,
    qk_views,
)
from vllm_ext.megakernel.kernel.ops.common import (
    NUM_THREADS,
    NUM_WARPS,
    VEC,
    consumer_sync,
    load_f32,
    thread_ids,
    vectors,
)
from vllm_ext.megakernel.kernel.ops.kv import kv_entry
from vllm_ext.megakernel.kernel.ops.qk_finish import norm_rope
from vllm_ext.megakernel.kernel.shape import KernelShape

NEG_INF = float("-inf")


def merge_rounds(d: int) -> int:
    """Shuffle rounds that merge a warp's token groups: log2(256 / d)."""
    return (32 // (d // VEC)).bit_length() - 1


@cute.jit
def _merge(m: cute.Tensor, den: cute.Tensor, acc: cute.Tensor, gi, m_o, l_o,
           acc_o: cute.Tensor):  # fmt: skip
    """Fold the softmax state (m_o, l_o, acc_o) into row gi of (m, den, acc);
    an empty state (m = -inf) contributes nothing."""
    m_new = cute.math.max(m[gi], m_o)
    if m_new > Float32(NEG_INF):
        a = cute.math.exp(m[gi] - m_new)
        c = cute.math.exp(m_o - m_new)
        den[gi] = den[gi] * a + l_o * c
        for e in cutlass.range_constexpr(VEC):
            acc[gi, e] = acc[gi, e] * a + acc_o[e] * c
        m[gi] = m_new


@cute.jit
def attn_wide(
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
    lanes = d // VEC  # lanes per token
    per_load = 32 // lanes  # tokens per warp load
    reqs = min(b, NUM_WARPS)  # requests in flight
    warps = NUM_WARPS // reqs  # warps per request
    q, seq_lens, table, part_o, part_lse, cache = attn_views(
        shape, ptrs, layer, glob, block_table_stride
    )
    tidx, warp, lane = thread_ids()
    sub, part = lane // lanes, lane % lanes  # token group, 8-dim slice
    slot, rank = warp // warps, warp % warps  # request slot, warp within it
    if cutlass.const_expr(shape.qk_in_attn):
        finish_new_k(shape, ptrs, layer, glob, g, chunk, kv_block_stride)
        q_norm, _, positions, cos_sin, _ = qk_views(shape, ptrs, layer, glob)

    for i0 in cutlass.range(0, b, reqs):
        i = i0 + slot
        m = cute.make_rmem_tensor((group,), Float32)
        den = cute.make_rmem_tensor((group,), Float32)
        acc = cute.make_rmem_tensor((group, VEC), Float32)
        m.fill(NEG_INF)
        den.fill(0.0)
        acc.fill(0.0)
        # Warps past reqs * warps (8 % reqs != 0) and rows past the batch
        # idle; whole warps, so the shuffles below stay uniform.
        if (slot < reqs) & (i < b):
            t_lo, t_hi = chunk_span(seq_lens[i], chunk, chunks)
            qf = cute.make_rmem_tensor((group, VEC), Float32)
            for gi in cutlass.range_constexpr(group):
                head = cute.make_rmem_tensor((VEC,), Float32)
                head.store(load_f32(vectors(q[i, g * group + gi, None]), part))
                if cutlass.const_expr(shape.qk_in_attn):
                    # (Each token group of the warp holds the whole head.)
                    norm_rope(shape, head, VEC, part * VEC, lanes, q_norm,
                              positions[i], cos_sin)  # fmt: skip
                for e in cutlass.range_constexpr(VEC):
                    qf[gi, e] = head[e]
            # Every lane runs every step (the shuffles need the whole warp);
            # a lane past the chunk's end reads the step's first token and
            # keeps its state.
            step = warps * per_load
            for t0 in cutlass.range(t_lo + rank * per_load, t_hi, step, unroll=4):
                t = t0 + sub
                valid = t < t_hi
                if t >= t_hi:
                    t = t0
                entry = vectors(kv_entry(shape, cache, table[i, t // bs], t % bs, g,
                                         kv_block_stride))  # fmt: skip
                kf = load_f32(entry, part)
                # In registers, not as an SSA vector: its elements are read
                # inside the branch below, once per q head.
                vf = cute.make_rmem_tensor((VEC,), Float32)
                vf.store(load_f32(entry, lanes + part))
                for gi in cutlass.range_constexpr(group):
                    dot = Float32(0.0)
                    for e in cutlass.range_constexpr(VEC):
                        dot = dot + qf[gi, e] * kf[e]
                    dot = cute.arch.warp_reduction(dot, operator.add,
                                                   threads_in_group=lanes)  # fmt: skip
                    if valid:
                        score = dot * scale
                        m_new = cute.math.max(m[gi], score)
                        corr = cute.math.exp(m[gi] - m_new)
                        p = cute.math.exp(score - m_new)
                        den[gi] = den[gi] * corr + p
                        for e in cutlass.range_constexpr(VEC):
                            acc[gi, e] = acc[gi, e] * corr + p * vf[e]
                        m[gi] = m_new
            # The warp's token groups merge (lanes with the same slice).
            for k in cutlass.range_constexpr(merge_rounds(shape.head_dim)):
                off = (shape.head_dim // VEC) << k
                for gi in cutlass.range_constexpr(group):
                    m_o = cute.arch.shuffle_sync_bfly(m[gi], offset=off)
                    l_o = cute.arch.shuffle_sync_bfly(den[gi], offset=off)
                    acc_o = cute.make_rmem_tensor((VEC,), Float32)
                    for e in cutlass.range_constexpr(VEC):
                        acc_o[e] = cute.arch.shuffle_sync_bfly(acc[gi, e], offset=off)
                    _merge(m, den, acc, gi, m_o, l_o, acc_o)
        # The request's warps meet in shared memory (all threads reach the
        # barriers; idle warps publish empty states).
        for gi in cutlass.range_constexpr(group):
            if lane == 0:
                warp_m[warp, gi] = m[gi]
                warp_l[warp, gi] = den[gi]
            if sub == 0:
                for e in cutlass.range_constexpr(VEC):
                    warp_o[warp, gi, part * VEC + e] = acc[gi, e]
        consumer_sync()
        for idx in cutlass.range(tidx, reqs * group * d, NUM_THREADS):
            r, rest = idx // (group * d), idx % (group * d)
            gi, dim = rest // d, rest % d
            if i0 + r < b:
                top = Float32(NEG_INF)
                for w in cutlass.range_constexpr(warps):
                    top = cute.math.max(top, warp_m[r * warps + w, gi])
                o, lse = Float32(0.0), Float32(NEG_INF)
                if top > Float32(NEG_INF):  # else: no tokens (an empty chunk)
                    total, num = Float32(0.0), Float32(0.0)
                    for w in cutlass.range_constexpr(warps):
                        scale_w = cute.math.exp(warp_m[r * warps + w, gi] - top)
                        total = total + warp_l[r * warps + w, gi] * scale_w
                        num = num + warp_o[r * warps + w, gi, dim] * scale_w
                    o = num / total
                    lse = top + cute.math.log(total)
                part_o[chunk, g, i0 + r, gi, dim] = o
                if dim == 0:
                    part_lse[chunk, g, i0 + r, gi] = lse
        consumer_sync()  # the warp states are reused next round
