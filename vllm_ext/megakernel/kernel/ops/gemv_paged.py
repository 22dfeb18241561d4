# SPDX-License-Identifier: Apache-2.0
"""The GEMVs that read the weight pipeline's pages (``weight_pipe.py``'s
producer fills them): the same contract as ``gemv.gemv`` (rows [lo, hi)
of ``W @ x[b]`` for every request, fp32 accumulation, the caller's
``epilogue(row, b, s1, s2)``), checked on the GPU against the same
references. Each warp releases a page once it has read it
(``release_page``); only split rows meet at a consumer barrier, for their
partial sums."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from vllm_ext.megakernel.kernel.ops.common import (
    NUM_THREADS,
    NUM_WARPS,
    VEC,
    consumer_sync,
    thread_ids,
    vectors,
)
from vllm_ext.megakernel.kernel.ops.gemv import gemv_row
from vllm_ext.megakernel.kernel.ops.gemv_mma import (
    K_BLOCK,
    N_BLOCK,
    mma_finish,
    mma_step,
    partials,
)
from vllm_ext.megakernel.kernel.ops.gemv_mma import ROWS as MMA_ROWS
from vllm_ext.megakernel.kernel.ops.weight_pipe import (
    geometry,
    release_page,
    wait_page,
    warps_per_row,
)


@cute.jit
def paged_gemv(
    p: cutlass.Constexpr,
    op: cutlass.Constexpr,  # whose pages (geometry)
    page0,  # the instruction's page that holds row0
    row0,
    row_end,
    x: cute.Tensor,
    norm: cute.Tensor,
    rstd: cute.Tensor,
    epilogue: cutlass.Constexpr,
    normed: cutlass.Constexpr,
):
    """Rows [row0, row_end) of ``W @ x[b]`` from the pages that hold them
    (the same contract as ``gemv.gemv``). Short rows: a warp per row. Long
    rows (fewer than ``NUM_WARPS`` per page): warps split each row's k, and
    their sums meet in ``p.red``."""
    tile = geometry(p.shape)[op]
    if cutlass.const_expr(p.shape.mma_gemv):
        _paged_mma(p, tile, page0, row0, row_end, x, norm, rstd, epilogue, normed)
    else:
        _paged_rows(p, tile, page0, row0, row_end, x, norm, rstd, epilogue, normed)


@cute.jit
def _paged_rows(p: cutlass.Constexpr, tile: cutlass.Constexpr, page0, row0, row_end,
                x, norm, rstd, epilogue: cutlass.Constexpr,
                normed: cutlass.Constexpr):  # fmt: skip
    """The CUDA-core GEMV over pages of whole rows."""
    k, per_page, dual = tile.k, tile.per_page, tile.dual
    tidx, warp, lane = thread_ids()
    slices = warps_per_row(per_page)
    batch = x.shape[0]
    base = p.base + page0
    for kk in cutlass.range((row_end - row0 + per_page - 1) // per_page):
        g = base + kk
        wait_page(p, g)
        first = row0 + kk * per_page
        n = cutlass.min(Int32(per_page), row_end - first)
        w1 = p.page(g % p.slots, per_page, k)
        w2 = w1
        if cutlass.const_expr(dual):
            w2 = p.page(g % p.slots, per_page, k, second=True)
        if cutlass.const_expr(slices == 1):
            for r in cutlass.range(warp, n, NUM_WARPS):
                gemv_row(first + r, vectors(w1[r, None]), vectors(w2[r, None]), x,
                       norm, rstd, lane, epilogue, normed, dual)  # fmt: skip
            release_page(p, g)
        else:
            r = warp // slices
            red = cute.make_tensor(
                p.red.iterator + (g % 2) * (NUM_WARPS * 2 * batch),
                cute.make_layout((NUM_WARPS, 2, batch), stride=(2 * batch, batch, 1)),
            )
            if r < n:
                gemv_row(first + r, vectors(w1[r, None]), vectors(w2[r, None]), x,
                       norm, rstd, lane, epilogue, normed, dual, warp % slices,
                       slices, red[warp, None, None])  # fmt: skip
            release_page(p, g)
            # (red alternates by page parity: the next page's barrier orders
            # these reads before the page after writes this half again.)
            consumer_sync()
            for idx in cutlass.range(tidx, n * batch, NUM_THREADS):
                rr, i = idx // batch, idx % batch
                s1, s2 = Float32(0.0), Float32(0.0)
                for sl in cutlass.range_constexpr(slices):
                    s1 = s1 + red[rr * slices + sl, 0, i]
                    s2 = s2 + red[rr * slices + sl, 1, i]
                epilogue(first + rr, i, s1, s2)


@cute.jit
def _paged_mma(p: cutlass.Constexpr, tile: cutlass.Constexpr, page0, row0, row_end,
               x, norm, rstd, epilogue: cutlass.Constexpr,
               normed: cutlass.Constexpr):  # fmt: skip
    """The tensor-core GEMV (``gemv_mma``'s step and reduction) over pages
    of 16 rows by ``k_chunk`` columns: a row block's accumulators carry
    across its k pages."""
    tidx, warp, lane = thread_ids()
    batch = x.shape[0]
    n_blocks = (batch + N_BLOCK - 1) // N_BLOCK
    part = partials(p.red, batch, tile.dual)
    g, q = lane // 4, lane % 4
    base = p.base + page0
    for rb in cutlass.range(row0, row_end, MMA_ROWS):
        n_valid = cutlass.min(Int32(MMA_ROWS), row_end - rb)
        acc = cute.make_rmem_tensor((2 if tile.dual else 1, n_blocks, 4), Float32)
        acc.fill(0.0)
        first_page = base + ((rb - row0) // MMA_ROWS) * tile.k_pages
        for kc in cutlass.range(tile.k_pages):
            pg = first_page + kc
            wait_page(p, pg)
            w1 = p.page(pg % p.slots, MMA_ROWS, tile.k_chunk)
            w2 = w1
            if cutlass.const_expr(tile.dual):
                w2 = p.page(pg % p.slots, MMA_ROWS, tile.k_chunk, second=True)
            k_len = cutlass.min(Int32(tile.k_chunk), tile.k - kc * tile.k_chunk)
            v0 = kc * (tile.k_chunk // VEC)  # the page's first input vector
            for kb in cutlass.range(warp, k_len // K_BLOCK, NUM_WARPS, unroll=2):
                j = kb * (K_BLOCK // VEC) + q  # this lane's vector in the page
                mma_step(w1, w2, tile.dual, g, n_valid, j, x, norm, rstd, v0 + j,
                         normed, acc)  # fmt: skip
            release_page(p, pg)
        mma_finish(part, acc, rb, n_valid, batch, epilogue, tile.dual)
