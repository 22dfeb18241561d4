# SPDX-License-Identifier: Apache-2.0
"""The GEMV core on tensor cores (experimental, ``KernelShape.mma_gemv``):
the same contract as ``gemv.gemv`` (rows [lo, hi) of ``W @ x[b]`` for every
request, fp32 accumulation, the caller's ``epilogue(row, b, s1, s2)``),
computed with ``mma.sync.m16n8k16`` (bf16 in, fp32 accumulators) instead
of one FMA per weight and request.

On the H200 (2026-11-30) the CUDA-core GEMV fell from 3.5-4.0 TB/s at batch
1 to 0.25-0.8 TB/s at batch 16: instruction issue, not bandwidth. Here a
warp's 16 x 32 block of weights costs two 128-bit loads per lane and, per 8
requests, one 128-bit input load and two MMAs.

A sum over k does not depend on the order of k, so each lane loads 8
consecutive weights of its row (the quad of lanes t % 4 covers 32 k) and
feeds them to two MMAs whose k slots it maps to those weights; the input
fragment uses the same mapping, so no shuffle or shared-memory copy of the
weights is needed. Warps split K; their partial 16 x B tiles meet in shared
memory (``red``), and each (row, request) sum goes to the epilogue."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from vllm_ext.megakernel.kernel.ops.common import (
    NUM_THREADS,
    NUM_WARPS,
    VEC,
    consumer_sync,
    thread_ids,
    vectors,
)

ROWS = 16  # an MMA's M
K_BLOCK = 32  # k per lane quad and step: 4 lanes x 8 weights
N_BLOCK = 8  # an MMA's N: requests per fragment


def red_floats(batch: int) -> int:
    """fp32 elements of the cross-warp reduction scratch (room for two
    matrices, gate and up)."""
    n_pad = (batch + N_BLOCK - 1) // N_BLOCK * N_BLOCK
    return NUM_WARPS * 2 * ROWS * n_pad


@dsl_user_op
def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, *, loc=None, ip=None):
    """``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``: A as four
    packed bf16 pairs, B as two, C and D as four fp32 per lane."""
    args = [Int32(v).ir_value(loc=loc, ip=ip) for v in (a0, a1, a2, a3, b0, b1)]
    args += [Float32(v).ir_value(loc=loc, ip=ip) for v in (c0, c1, c2, c3)]
    out = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4), args,
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )  # fmt: skip
    return tuple(
        Float32(llvm.extractvalue(T.f32(), out, [i], loc=loc, ip=ip)) for i in range(4)
    )


@cute.jit
def row_frag(w: cute.Tensor, row, hi, j, frag: cute.Tensor):
    """Weights k = 8 j .. 8 j + 7 of ``row`` as four packed pairs (zero past
    the tile)."""
    r = cute.make_rmem_tensor((VEC,), BFloat16)
    r.fill(0.0)
    if row < hi:
        cute.autovec_copy(vectors(w[row, None])[None, j], r)
    frag.store(cute.recast_tensor(r, Int32).load())


@cute.jit
def input_frag(
    x: cute.Tensor, norm: cute.Tensor, rstd: cute.Tensor, n, j,
    frag: cute.Tensor, normed: cutlass.Constexpr,
):  # fmt: skip
    """Request ``n``'s inputs k = 8 j .. 8 j + 7 as four packed pairs, normed
    (``bf16(x * rstd * norm)``, as the reference rounds it) when asked; zero
    for a padding column."""
    batch = x.shape[0]
    r = cute.make_rmem_tensor((VEC,), BFloat16)
    r.fill(0.0)
    if n < batch:
        if cutlass.const_expr(normed):
            xr = cute.make_rmem_tensor((VEC,), BFloat16)
            cute.autovec_copy(vectors(x[n, None])[None, j], xr)
            nr = cute.make_rmem_tensor((VEC,), BFloat16)
            cute.autovec_copy(vectors(norm)[None, j], nr)
            y = xr.load().to(Float32) * rstd[n] * nr.load().to(Float32)
            r.store(y.to(BFloat16))
        else:
            cute.autovec_copy(vectors(x[n, None])[None, j], r)
    frag.store(cute.recast_tensor(r, Int32).load())


@cute.jit
def mma_step(
    w: cute.Tensor, w2: cute.Tensor, dual: cutlass.Constexpr, row, hi, j,
    x: cute.Tensor, norm: cute.Tensor, rstd: cute.Tensor, xj,
    normed: cutlass.Constexpr, acc: cute.Tensor,
):  # fmt: skip
    """One block of 32 k: this lane's weight vector ``j`` of rows ``row`` and
    ``row + 8`` of ``w`` (and ``w2``; zero at or past row ``hi``) against
    input vector ``xj`` of every request, accumulated into ``acc``
    [matrices, request blocks, 4]."""
    _, _, lane = thread_ids()
    g = lane // 4
    n_blocks = (x.shape[0] + N_BLOCK - 1) // N_BLOCK
    for m in cutlass.range_constexpr(2 if dual else 1):
        mat = w if m == 0 else w2
        a_lo = cute.make_rmem_tensor((4,), Int32)
        a_hi = cute.make_rmem_tensor((4,), Int32)
        row_frag(mat, row, hi, j, a_lo)
        row_frag(mat, row + 8, hi, j, a_hi)
        for nb in cutlass.range_constexpr(n_blocks):
            b = cute.make_rmem_tensor((4,), Int32)
            input_frag(x, norm, rstd, nb * N_BLOCK + g, xj, b, normed)
            for half in cutlass.range_constexpr(2):
                e = 2 * half
                d = mma_bf16(
                    a_lo[e], a_hi[e], a_lo[e + 1], a_hi[e + 1], b[e], b[e + 1],
                    acc[m, nb, 0], acc[m, nb, 1], acc[m, nb, 2], acc[m, nb, 3],
                )  # fmt: skip
                for c in cutlass.range_constexpr(4):
                    acc[m, nb, c] = d[c]


def partials(red: cute.Tensor, batch: int, dual: bool) -> cute.Tensor:
    """``red`` as [warp, matrix, row, request] partial tiles."""
    n_pad = (batch + N_BLOCK - 1) // N_BLOCK * N_BLOCK
    n_mats = 2 if dual else 1
    return cute.make_tensor(
        red.iterator,
        cute.make_layout(
            (NUM_WARPS, n_mats, ROWS, n_pad),
            stride=(n_mats * ROWS * n_pad, ROWS * n_pad, n_pad, 1),
        ),
    )


@cute.jit
def mma_finish(
    part: cute.Tensor, acc: cute.Tensor, rb, n_valid, batch: cutlass.Constexpr,
    epilogue: cutlass.Constexpr, dual: cutlass.Constexpr,
):  # fmt: skip
    """The warps' accumulators of row block ``rb`` meet in ``part``; the sum
    of each of its first ``n_valid`` rows and each request goes to the
    epilogue. CTA barriers before and after (``part`` is reused)."""
    tidx, warp, lane = thread_ids()
    g, q = lane // 4, lane % 4
    n_blocks = (batch + N_BLOCK - 1) // N_BLOCK
    # C fragment: (row g, requests 2q, 2q + 1), then row g + 8.
    for m in cutlass.range_constexpr(2 if dual else 1):
        for nb in cutlass.range_constexpr(n_blocks):
            col = nb * N_BLOCK + 2 * q
            part[warp, m, g, col] = acc[m, nb, 0]
            part[warp, m, g, col + 1] = acc[m, nb, 1]
            part[warp, m, g + 8, col] = acc[m, nb, 2]
            part[warp, m, g + 8, col + 1] = acc[m, nb, 3]
    consumer_sync()
    for idx in cutlass.range(tidx, ROWS * batch, NUM_THREADS):
        i, n = idx // batch, idx % batch
        s1 = Float32(0.0)
        s2 = Float32(0.0)
        for v in cutlass.range_constexpr(NUM_WARPS):
            s1 = s1 + part[v, 0, i, n]
            if cutlass.const_expr(dual):
                s2 = s2 + part[v, 1, i, n]
        if cutlass.const_expr(not dual):
            s2 = s1
        if i < n_valid:
            epilogue(rb + i, n, s1, s2)
    consumer_sync()


@cute.jit
def gemv_mma(
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
    red: cute.Tensor,  # smem fp32, at least red_floats(batch) elements
):
    _, warp, lane = thread_ids()
    batch, k_dim = x.shape
    n_blocks = (batch + N_BLOCK - 1) // N_BLOCK
    part = partials(red, batch, dual)
    g, q = lane // 4, lane % 4
    for rb in cutlass.range(lo, hi, ROWS):
        acc = cute.make_rmem_tensor((2 if dual else 1, n_blocks, 4), Float32)
        acc.fill(0.0)
        for kb in cutlass.range(warp, k_dim // K_BLOCK, NUM_WARPS, unroll=4):
            j = kb * (K_BLOCK // VEC) + q  # this lane's 128-bit vector
            mma_step(w, w2, dual, rb + g, hi, j, x, norm, rstd, j, normed, acc)
        mma_finish(part, acc, rb, hi - rb, batch, epilogue, dual)
