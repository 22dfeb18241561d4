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
from cutlass import BFloat16, Float32

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
    xcache: cute.Tensor = None,
):  # fmt: skip
    """One weight row (``wv``, and ``wv2`` when dual, as 128-bit vectors)
    against every request's input; the warp's sums go to the epilogue. With
    ``slices`` > 1 the warp takes slice ``sl`` of the row's vectors and its
    sums go to ``partial`` [2, B] instead (gemv_paged.py adds them up).
    ``xcache``: batch 1's input vectors this lane reads, in registers
    (``cache_input``), in the order the loop reads them."""
    batch, k_dim = x.shape
    group = min(batch, BATCH_GROUP)
    # Loads in flight per lane: few requests leave registers for deeper
    # unrolling, which is what keeps a batch-1 weight stream busy.
    unroll = 8 if group == 1 else 4 if group <= 2 else 2
    n_vec = k_dim // VEC
    nv = vectors(norm)
    if cutlass.const_expr(xcache is not None):
        _row_cached(row, wv, wv2, xcache, n_vec, lane, epilogue, dual, sl, slices,
                    partial)  # fmt: skip
    else:
        _row(row, wv, wv2, x, nv, rstd, n_vec, lane, epilogue, normed, dual, sl,
             slices, partial, group, unroll)  # fmt: skip


@cute.jit
def _row(row, wv: cute.Tensor, wv2: cute.Tensor, x: cute.Tensor, nv: cute.Tensor,
         rstd: cute.Tensor, n_vec, lane, epilogue: cutlass.Constexpr,
         normed: cutlass.Constexpr, dual: cutlass.Constexpr, sl,
         slices: cutlass.Constexpr, partial: cute.Tensor, group: cutlass.Constexpr,
         unroll: cutlass.Constexpr):  # fmt: skip
    batch = x.shape[0]
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


@cute.jit
def _row_cached(row, wv: cute.Tensor, wv2: cute.Tensor, xcache: cute.Tensor, n_vec,
                lane, epilogue: cutlass.Constexpr, dual: cutlass.Constexpr, sl,
                slices: cutlass.Constexpr, partial: cute.Tensor):  # fmt: skip
    """``gemv_row`` at batch 1 from the input in registers."""
    acc = cute.make_rmem_tensor((2,), Float32)
    acc.fill(0.0)
    for t in cutlass.range_constexpr(xcache.shape[0]):
        j = lane + 32 * sl + t * 32 * slices
        if j < n_vec:
            wf = load_f32(wv, j)
            wf2 = wf
            if cutlass.const_expr(dual):
                wf2 = load_f32(wv2, j)
            xf = xcache[t, None].load().to(Float32)
            for e in cutlass.range_constexpr(VEC):
                acc[0] = acc[0] + wf[e] * xf[e]
                if cutlass.const_expr(dual):
                    acc[1] = acc[1] + wf2[e] * xf[e]
    s1 = warp_sum(acc[0])
    s2 = s1
    if cutlass.const_expr(dual):
        s2 = warp_sum(acc[1])
    if lane == 0:
        if cutlass.const_expr(slices > 1):
            partial[0, 0] = s1
            partial[1, 0] = s2
        else:
            epilogue(row, 0, s1, s2)


# Input vectors a lane may keep in registers (bf16: 4 registers each).
MAX_CACHED_VECTORS = 8


def cached_vectors(k: int, slices: int) -> int:
    """Input vectors each lane reads of a row of ``k`` (its warp one of
    ``slices`` on the row); 0 where they do not fit ``MAX_CACHED_VECTORS``."""
    n = -(-(k // VEC) // (32 * slices))
    return n if n <= MAX_CACHED_VECTORS else 0


@cute.jit
def cache_input(x: cute.Tensor, k: cutlass.Constexpr, slices: cutlass.Constexpr,
                sl, lane) -> cute.Tensor:  # fmt: skip
    """Batch 1's input vectors this lane reads of every row (the warp's
    slice ``sl`` of ``slices``), into registers once an instruction: an
    un-normed projection's input (DOWN's 28 KiB on an 8B model) would
    otherwise be re-read from L1, or L2 where it does not fit beside the
    weight ring, for every weight row."""
    n_vec = k // VEC
    cache = cute.make_rmem_tensor((cached_vectors(k, slices), VEC), BFloat16)
    cache.fill(0.0)
    xv = vectors(x[0, None])
    for t in cutlass.range_constexpr(cached_vectors(k, slices)):
        j = lane + 32 * sl + t * 32 * slices
        if j < n_vec:
            cute.autovec_copy(xv[None, j], cache[t, None])
    return cache
