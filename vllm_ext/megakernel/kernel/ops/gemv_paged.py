# SPDX-License-Identifier: Apache-2.0
"""The GEMVs that read the weight pipeline's pages (``weight_pipe.py``'s
producer fills them): the same contract as ``gemv.gemv`` (rows [lo, hi)
of ``W @ x[b]`` for every request, fp32 accumulation, the caller's
``epilogue(row, b, s1, s2)``), checked on the GPU against the same
references. Each warp releases a page once it has read it
(``release_page``); only split rows meet at a consumer barrier, for their
partial sums. Batch 1 runs the CUDA-core GEMV over pages of whole rows;
every larger batch the tensor-core one (``KernelShape.mma_gemv``), and
quantized weights (FP8, INT4) the tensor-core one at every batch
(``Tile.mma``)."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint16

from vllm_ext.megakernel.kernel.ops.common import (
    NUM_THREADS,
    NUM_WARPS,
    consumer_sync,
    gmem,
    thread_ids,
    vectors,
)
from vllm_ext.megakernel.kernel.ops.gemv import cache_input, cached_vectors, gemv_row
from vllm_ext.megakernel.kernel.ops.gemv_int4 import int4_chunk, stage_chunk_int4
from vllm_ext.megakernel.kernel.ops.gemv_mma import (
    FP8_GROUP,
    N_BLOCK,
    fp8_scales,
    input_group_scales,
    input_scales,
    k_block,
    mma_chunk,
    mma_finish,
    n_pad,
    partials,
    row_blocks,
    stage_chunk,
    stage_chunk_fp8,
    staged,
    warp_task,
)
from vllm_ext.megakernel.kernel.ops.weight_pipe import (
    geometry,
    release_page,
    wait_page,
    warps_per_row,
)
from vllm_ext.megakernel.kernel.shape import KernelShape


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
    wscale: cute.Tensor = None,
    wscale2: cute.Tensor = None,
):
    """Rows [row0, row_end) of ``W @ x[b]`` from the pages that hold them
    (the same contract as ``gemv.gemv``). Above batch 1, and quantized
    weights at every batch, on tensor cores (``_paged_mma``). At batch 1,
    short rows: a warp per row; long rows (fewer than ``NUM_WARPS`` per
    page): warps split each row's k, and their sums meet in ``p.red``.
    Quantized: ``wscale`` (and ``wscale2`` when dual) the weights' scales
    (``weight_scales``), row-indexed as the epilogue's rows; FP8: the
    caller took the instruction's input scales first
    (``fp8_input_scales``)."""
    tile = geometry(p.shape)[op]
    if cutlass.const_expr(tile.mma):
        _paged_mma(p, tile, page0, row0, row_end, x, norm, rstd, epilogue, normed,
                   wscale, wscale2)  # fmt: skip
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
    xcache = None
    if cutlass.const_expr(batch == 1 and not normed and cached_vectors(k, slices)):
        xcache = cache_input(x, k, slices, warp % slices, lane)
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
                       norm, rstd, lane, epilogue, normed, dual,
                       xcache=xcache)  # fmt: skip
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
                       slices, red[warp, None, None], xcache)  # fmt: skip
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


def weight_scales(s: KernelShape, addr, rows: int, k: int) -> cute.Tensor:
    """A quantized matrix's scales at ``addr``: FP8's one a row ``[rows]``
    fp32, or with ``fp8_block`` one a 128 x 128 block ``[ceil(rows / 128),
    k / 128]``; INT4's one a row and group ``[rows, k / group]``, bf16 read
    as its bits (``gemv_int4.unpack`` multiplies by them in bf16)."""
    if s.int4_group:
        return gmem(Uint16, addr, (rows, k // s.int4_group))
    if s.fp8_block:
        return gmem(Float32, addr, (-(-rows // FP8_GROUP), k // FP8_GROUP))
    return gmem(Float32, addr, (rows,))


@cute.jit
def fp8_input_scales(p: cutlass.Constexpr, x: cute.Tensor, norm: cute.Tensor,
                     rstd: cute.Tensor, normed: cutlass.Constexpr):  # fmt: skip
    """An FP8 projection's per-request input scales, once an instruction
    before its ``paged_gemv`` calls (``gemv_mma.input_scales``; block FP8:
    a scale per k group, ``input_group_scales``)."""
    shape: KernelShape = p.shape
    sc = fp8_scales(p.red, x.shape[0], shape.fp8_groups)
    if cutlass.const_expr(shape.fp8_block):
        input_group_scales(x, norm, rstd, sc, normed)
    else:
        input_scales(x, norm, rstd, sc, normed)


@cute.jit
def _paged_mma(p: cutlass.Constexpr, tile: cutlass.Constexpr, page0, row0, row_end,
               x, norm, rstd, epilogue: cutlass.Constexpr,
               normed: cutlass.Constexpr, wscale, wscale2):  # fmt: skip
    """The tensor-core GEMV (``gemv_mma.py``) over pages of ``per_page``
    rows by ``k_chunk`` columns, row group after row group: per page, the
    requests' k-chunk staged once (buffer by page parity; FP8: quantized),
    then each warp's row block and k slice; a warp's accumulators carry
    across its group's k pages; the slices meet in ``mma_finish``, FP8's
    sums times the input's and the row's scales (vLLM's scaled GEMM
    epilogue: ``a * (w * sum)``, ``ScaledEpilogue`` in the sdist's
    ``csrc/cutlass_extensions/epilogue/scaled_mm_epilogues_c3x.hpp``),
    block FP8's scaled per k block as they are added (``mma_chunk``)."""
    _, warp, _ = thread_ids()
    batch = x.shape[0]
    rows, k_chunk, dual, fp8 = tile.per_page, tile.k_chunk, tile.dual, tile.fp8
    int4 = tile.int4
    part = partials(p.red, batch, dual)
    finish = epilogue
    block = fp8 and p.shape.fp8_block
    sc = None
    if cutlass.const_expr(fp8):
        sc = fp8_scales(p.red, batch, p.shape.fp8_groups)
    if cutlass.const_expr(fp8 and not block):

        def scaled(row, n, s1, s2):
            a = sc[NUM_WARPS, n]
            t2 = s2
            if cutlass.const_expr(dual):
                t2 = a * (wscale2[row] * s2)
            epilogue(row, n, a * (wscale[row] * s1), t2)

        finish = scaled
    base = p.base + page0
    for grp in cutlass.range((row_end - row0 + rows - 1) // rows):
        first = row0 + grp * rows
        n_valid = cutlass.min(Int32(rows), row_end - first)
        rb, sl, ks = warp_task(warp, n_valid)
        acc = cute.make_rmem_tensor((2 if dual else 1, n_pad(batch) // N_BLOCK, 4),
                                    Float32)  # fmt: skip
        acc.fill(0.0)
        for kc in cutlass.range(tile.k_pages):
            pg = base + grp * tile.k_pages + kc
            k0 = kc * k_chunk
            k_len = cutlass.min(Int32(k_chunk), tile.k - k0)
            stage = staged(p.red, batch, pg % 2, fp8, int4)
            if cutlass.const_expr(int4):
                stage_chunk_int4(x, norm, rstd, k0, k_len, stage, normed)
            elif cutlass.const_expr(fp8):
                stage_chunk_fp8(x, norm, rstd, sc, k0, k_len, stage, normed, block)
            else:
                stage_chunk(x, norm, rstd, k0, k_len, stage, normed)
            # The chunk is staged; every warp is past page pg - 1, so its
            # buffer is free for page pg + 1.
            consumer_sync()
            wait_page(p, pg)
            w1 = p.page(pg % p.slots, rows, k_chunk, fp8=fp8, int4=int4)
            w2 = w1
            if cutlass.const_expr(dual):
                w2 = p.page(pg % p.slots, rows, k_chunk, second=True, fp8=fp8,
                            int4=int4)  # fmt: skip
            if sl < ks:
                if cutlass.const_expr(int4):
                    int4_chunk(w1, w2, dual, stage, rb, sl, ks,
                               k_len // k_block(False, True), batch, acc, wscale,
                               wscale2, first, k0, p.shape.int4_group)  # fmt: skip
                else:  # (block FP8 scales each k block: mma_chunk)
                    mma_chunk(w1, w2, dual, stage, rb, sl, ks, k_len // k_block(fp8),
                              batch, acc, fp8, wscale if block else None,
                              wscale2 if block else None, sc, first, k0)  # fmt: skip
            release_page(p, pg)
        mma_finish(part, acc, first, n_valid, sl, ks, row_blocks(n_valid), batch,
                   finish, dual)  # fmt: skip
