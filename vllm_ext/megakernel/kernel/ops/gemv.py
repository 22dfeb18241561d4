# SPDX-License-Identifier: Apache-2.0
"""The GEMV core of every projection: rows [lo, hi) of ``W @ x[b]`` for
every request b, bf16 in, fp32 accumulation, 128-bit loads.

A warp owns a row: its lanes stride the row in 16-byte vectors and the
warp's partial sums meet in a shuffle reduction, so each weight byte is
read once per ``BATCH_GROUP`` requests. Optionally the input is RMS-normed
on the fly (``x * rstd[b] * norm``, rounded to bf16 as the reference hands
it on) and a second matrix shares the row index (gate and up). The caller's
``epilogue(row, b, s1, s2)`` runs on lane 0 with the warp's sums.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from vllm_ext.megakernel.kernel.ops.common import (
    BATCH_GROUP,
    NUM_WARPS,
    VEC,
    load_f32,
    round_bf16,
    thread_ids,
    vectors,
    warp_sum,
)


@cute.jit
def gemv(
    w: cute.Tensor,  # [M, K] bf16 row-major
    w2: cute.Tensor,  # a second [M, K] matrix, or w itself when not dual
    x: cute.Tensor,  # [B, K] bf16
    norm: cute.Tensor,  # [K] bf16 RMSNorm weight (read only when normed)
    rstd: cute.Tensor,  # [B] fp32 in shared memory (read only when normed)
    lo: cutlass.Int32,
    hi: cutlass.Int32,
    epilogue: cutlass.Constexpr,
    normed: cutlass.Constexpr,
    dual: cutlass.Constexpr,
):
    """From global memory (the legacy control, or rows wider than a page):
    a warp per row."""
    _, warp, lane = thread_ids()
    for row in cutlass.range(lo + warp, hi, NUM_WARPS):
        gemv_row(row, vectors(w[row, None]), vectors(w2[row, None]), x, norm, rstd,
                 lane, epilogue, normed, dual)  # fmt: skip


@cute.jit
def gemv_row(
    row, wv: cute.Tensor, wv2: cute.Tensor, x: cute.Tensor, norm: cute.Tensor,
    rstd: cute.Tensor, lane, epilogue: cutlass.Constexpr,
    normed: cutlass.Constexpr, dual: cutlass.Constexpr, sl=0,
    slices: cutlass.Constexpr = 1, partial: cute.Tensor = None,
):  # fmt: skip
    """One weight row (``wv``, and ``wv2`` when dual, as 128-bit vectors)
    against every request's input; the warp's sums go to the epilogue. With
    ``slices`` > 1 the warp takes slice ``sl`` of the row's vectors and its
    sums go to ``partial`` [2, B] instead (gemv_paged.py adds them up)."""
    batch, k_dim = x.shape
    group = min(batch, BATCH_GROUP)
    # Loads in flight per lane: few requests leave registers for deeper
    # unrolling, which is what keeps a batch-1 weight stream busy.
    unroll = 8 if group == 1 else 4 if group <= 2 else 2
    n_vec = k_dim // VEC
    nv = vectors(norm)
    for b0 in cutlass.range(0, batch, group):  # runtime: one copy of the code
        acc = cute.make_rmem_tensor((group,), Float32)
        acc2 = cute.make_rmem_tensor((group,), Float32)
        acc.fill(0.0)
        acc2.fill(0.0)
        for j in cutlass.range(lane + 32 * sl, n_vec, 32 * slices, unroll=unroll):
            wf = load_f32(wv, j)
            wf2 = wf
            if cutlass.const_expr(dual):
                wf2 = load_f32(wv2, j)
            nf = wf
            if cutlass.const_expr(normed):
                nf = load_f32(nv, j)
            for i in cutlass.range_constexpr(group):
                xf = load_f32(vectors(x[b0 + i, None]), j)
                if cutlass.const_expr(normed):
                    xf = round_bf16(xf * rstd[b0 + i] * nf)
                for e in cutlass.range_constexpr(VEC):
                    acc[i] = acc[i] + wf[e] * xf[e]
                    if cutlass.const_expr(dual):
                        acc2[i] = acc2[i] + wf2[e] * xf[e]
        for i in cutlass.range_constexpr(group):
            s1 = warp_sum(acc[i])
            s2 = s1
            if cutlass.const_expr(dual):
                s2 = warp_sum(acc2[i])
            if lane == 0:
                if cutlass.const_expr(slices > 1):
                    partial[0, b0 + i] = s1
                    partial[1, b0 + i] = s2
                else:
                    epilogue(row, b0 + i, s1, s2)
