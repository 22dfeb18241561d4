# SPDX-License-Identifier: Apache-2.0
"""QKV (reference: ``ops/qkv.py``): for each fused head of [lo, hi), the
RMS-normed projection (+ bias), then for q and k heads the QK-norm and
NeoX RoPE (ATTN's with QK-norm over head parts: ``shape.qk_in_attn``); q
heads go to the layer's q buffer, k and v heads into vLLM's paged cache at
the slot mapping (a padded row, slot -1, writes nothing).

The head's outputs meet in shared memory: RoPE pairs dimension j with
j + d/2 and QK-norm needs the whole head, both produced by other warps."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.kernel.ops.common import (
    MAX_POSITIONS,
    NUM_THREADS,
    NUM_WARPS,
    consumer_sync,
    gmem,
    round_bf16,
    row_rstd,
    stage_normed,
    stages_input,
    thread_ids,
    warp_sum,
)
from vllm_ext.megakernel.kernel.ops.gemv import gemv
from vllm_ext.megakernel.kernel.ops.gemv_paged import (
    fp8_input_scales,
    paged_gemv,
    weight_scales,
)
from vllm_ext.megakernel.kernel.ops.kv import kv_slot_entry
from vllm_ext.megakernel.kernel.ops.weight_pipe import head_pages, reads_pages
from vllm_ext.megakernel.kernel.shape import GlobalSlot, KernelShape, LayerSlot


def _store_head(head_buf: cute.Tensor, first_row, bias):
    """Epilogue: the head's row in fp32 (+ bias), rounded to bf16 as the
    reference's projection output is."""

    def epilogue(row, i, s, _):
        v = s if bias is None else s + bias[row].to(Float32)
        head_buf[i, row - first_row] = round_bf16(v)

    return epilogue


@cute.jit
def _rope_store(
    s: cutlass.Constexpr, i, head, j, x1, x2, q, positions, cos_sin, slots, cache,
    kv_block_stride,
):  # fmt: skip
    """Request i's dims j and j + d/2 of q or k head ``head`` (fused index):
    NeoX RoPE of (x1, x2) (as projected where ATTN finishes the heads:
    ``shape.qk_in_attn``), then to q or to the paged cache at the request's
    slot (none for a padded row)."""
    shape: KernelShape = s
    nq, half = shape.q_heads, shape.head_dim // 2
    y1, y2 = x1.to(BFloat16), x2.to(BFloat16)
    if cutlass.const_expr(not shape.qk_in_attn):
        p = positions[i]
        c, sn = cos_sin[p, j], cos_sin[p, j + half]
        y1 = (x1 * c - x2 * sn).to(BFloat16)
        y2 = (x2 * c + x1 * sn).to(BFloat16)
    if head < nq:
        q[i, head, j] = y1
        q[i, head, j + half] = y2
    else:
        slot = slots[i]
        if slot >= 0:
            entry = kv_slot_entry(shape, cache, slot, head - nq, kv_block_stride)
            entry[j] = y1
            entry[j + half] = y2


@cute.jit
def _store_v(s: cutlass.Constexpr, i, g, j, head_buf, col, slots, cache,
             kv_block_stride):  # fmt: skip
    """Request i's dim j of kv head g's new V (head_buf column ``col``), to
    the paged cache at the request's slot (none for a padded row)."""
    shape: KernelShape = s
    slot = slots[i]
    if slot >= 0:
        entry = kv_slot_entry(shape, cache, slot, g, kv_block_stride)
        entry[shape.head_dim + j] = head_buf[i, col].to(BFloat16)


@cute.jit
def qkv(
    s: cutlass.Constexpr,
    ptrs: cute.Tensor,
    layer,
    glob,
    lo,
    hi,
    kv_block_stride,
    rstd: cute.Tensor,  # smem [B]
    head_buf: cute.Tensor,  # smem [B, head_dim] fp32
    head_rstd: cute.Tensor,  # smem [B]
    x_stage: cute.Tensor,  # smem [B, hidden] bf16 when stages_input(shape)
    w_stage,  # the weight pipeline, or (legacy control) the GEMV's scratch
):
    shape: KernelShape = s
    b, h, d = shape.batch, shape.hidden, shape.head_dim
    nq, nkv = shape.q_heads, shape.kv_heads
    rows = (nq + 2 * nkv) * d
    x = gmem(BFloat16, ptrs[layer, LayerSlot.H_IN], (b, h))
    w = gmem(BFloat16, ptrs[layer, LayerSlot.QKV], (rows, h))
    norm = gmem(BFloat16, ptrs[layer, LayerSlot.INPUT_NORM], (h,))
    q = gmem(BFloat16, ptrs[layer, LayerSlot.Q], (b, nq, d))
    positions = gmem(Int32, ptrs[glob, GlobalSlot.POSITIONS], (b,))
    slots = gmem(Int32, ptrs[glob, GlobalSlot.SLOT_MAPPING], (b,))
    cos_sin = gmem(Float32, ptrs[glob, GlobalSlot.COS_SIN], (MAX_POSITIONS, d))
    cache = ptrs[layer, LayerSlot.KV_CACHE]
    bias = None
    if cutlass.const_expr(shape.qkv_bias):
        bias = gmem(BFloat16, ptrs[layer, LayerSlot.QKV_BIAS], (rows,))

    row_rstd(x, rstd, shape.rms_norm_eps)
    if cutlass.const_expr(stages_input(shape)):
        stage_normed(x, norm, rstd, x_stage)
    wscale = None
    if cutlass.const_expr(shape.dense_quantized):
        wscale = weight_scales(shape, ptrs[layer, LayerSlot.QKV_SCALE], rows, h)
    if cutlass.const_expr(shape.fp8):
        if cutlass.const_expr(stages_input(shape)):
            fp8_input_scales(w_stage, x_stage, norm, rstd, False)
        else:
            fp8_input_scales(w_stage, x, norm, rstd, True)
    if cutlass.const_expr(shape.qkv_parts > 1):
        _head_parts(shape, w, x, x_stage, norm, rstd, bias, q, positions, slots,
                    cos_sin, cache, kv_block_stride, head_buf, w_stage, lo,
                    hi, wscale)  # fmt: skip
    else:
        _whole_heads(shape, ptrs, layer, lo, hi, kv_block_stride, rstd, head_buf,
                     head_rstd, x_stage, w_stage, w, x, norm, bias, q, positions,
                     slots, cos_sin, cache, wscale)  # fmt: skip


@cute.jit
def _whole_heads(
    s: cutlass.Constexpr, ptrs, layer, lo, hi, kv_block_stride, rstd, head_buf,
    head_rstd, x_stage, w_stage, w, x, norm, bias, q, positions, slots, cos_sin,
    cache, wscale,
):  # fmt: skip
    """Units [lo, hi) that are whole fused heads (the default)."""
    shape: KernelShape = s
    b, d = shape.batch, shape.head_dim
    nq, nkv, half = shape.q_heads, shape.kv_heads, shape.head_dim // 2
    tidx, warp, lane = thread_ids()
    for head in cutlass.range(lo, hi):
        first = head * d
        epilogue = _store_head(head_buf, first, bias)
        if cutlass.const_expr(reads_pages(w_stage, Op.QKV)):
            # The head's first page within the instruction's.
            page0 = (head - lo) * head_pages(shape)
            if cutlass.const_expr(stages_input(shape)):
                paged_gemv(w_stage, Op.QKV, page0, first, first + d, x_stage, norm,
                           rstd, epilogue, False, wscale)  # fmt: skip
            else:
                paged_gemv(w_stage, Op.QKV, page0, first, first + d, x, norm, rstd,
                           epilogue, True, wscale)  # fmt: skip
        elif cutlass.const_expr(stages_input(shape)):
            gemv(w, w, x_stage, norm, rstd, first, first + d, epilogue, False, False)
        else:
            gemv(w, w, x, norm, rstd, first, first + d, epilogue, True, False)
        consumer_sync()
        if head < nq + nkv:
            if cutlass.const_expr(shape.qk_norm):
                norm_addr = ptrs[layer, LayerSlot.Q_NORM]
                if head >= nq:
                    norm_addr = ptrs[layer, LayerSlot.K_NORM]
                head_norm = gmem(BFloat16, norm_addr, (d,))
                for i in cutlass.range(warp, b, NUM_WARPS):
                    ss = Float32(0.0)
                    for j in cutlass.range(lane, d, 32):
                        ss = ss + head_buf[i, j] * head_buf[i, j]
                    ss = warp_sum(ss)
                    if lane == 0:
                        head_rstd[i] = cute.math.rsqrt(
                            ss / Float32(d) + Float32(shape.rms_norm_eps)
                        )
                consumer_sync()
            for idx in cutlass.range(tidx, b * half, NUM_THREADS):
                i, j = idx // half, idx % half
                x1, x2 = head_buf[i, j], head_buf[i, j + half]
                if cutlass.const_expr(shape.qk_norm):
                    r = head_rstd[i]
                    x1 = round_bf16(x1 * r * head_norm[j].to(Float32))
                    x2 = round_bf16(x2 * r * head_norm[j + half].to(Float32))
                _rope_store(shape, i, head, j, x1, x2, q, positions, cos_sin, slots,
                            cache, kv_block_stride)  # fmt: skip
        else:
            for idx in cutlass.range(tidx, b * d, NUM_THREADS):
                i, j = idx // d, idx % d
                _store_v(shape, i, head - nq - nkv, j, head_buf, j, slots, cache,
                         kv_block_stride)  # fmt: skip
        consumer_sync()  # head_buf is reused by the next head


@cute.jit
def _head_parts(
    s: cutlass.Constexpr, w, x, x_stage, norm, rstd, bias, q, positions, slots,
    cos_sin, cache, kv_block_stride, head_buf, w_stage, lo, hi, wscale,
):  # fmt: skip
    """Units [lo, hi) that are parts of heads (isa.py; shape.qkv_parts > 1):
    part p of a head is rows ``[p*n, (p+1)*n)`` of each RoPE half (n = d /
    2P), gathered in head_buf as ``[first half's n | second half's n]``, so
    each column pair RoPE rotates is in one part. With QK-norm, q and k go
    out as projected (ATTN finishes them: ``shape.qk_in_attn``)."""
    shape: KernelShape = s
    b, d, parts = shape.batch, shape.head_dim, shape.qkv_parts
    nq, nkv, half = shape.q_heads, shape.kv_heads, shape.head_dim // 2
    n = d // (2 * parts)
    tidx, _, _ = thread_ids()
    for unit in cutlass.range(lo, hi):
        head, part = unit // parts, unit % parts
        for blk in cutlass.range_constexpr(2):
            first = head * d + blk * half + part * n
            # Row r of this block lands in head_buf column blk * n + r - first.
            epilogue = _store_head(head_buf, first - blk * n, bias)
            if cutlass.const_expr(reads_pages(w_stage, Op.QKV)):
                # The block's first page within the instruction's (a unit's
                # pages: its first block's, then its second's).
                page0 = (unit - lo) * head_pages(shape) + blk * (head_pages(shape) // 2)
                if cutlass.const_expr(stages_input(shape)):
                    paged_gemv(w_stage, Op.QKV, page0, first, first + n, x_stage,
                               norm, rstd, epilogue, False, wscale)  # fmt: skip
                else:
                    paged_gemv(w_stage, Op.QKV, page0, first, first + n, x, norm,
                               rstd, epilogue, True, wscale)  # fmt: skip
            elif cutlass.const_expr(stages_input(shape)):
                gemv(w, w, x_stage, norm, rstd, first, first + n, epilogue, False,
                     False)  # fmt: skip
            else:
                gemv(w, w, x, norm, rstd, first, first + n, epilogue, True, False)
        consumer_sync()
        if head < nq + nkv:
            for idx in cutlass.range(tidx, b * n, NUM_THREADS):
                i, j = idx // n, idx % n
                dim = part * n + j  # in the first RoPE half
                _rope_store(shape, i, head, dim, head_buf[i, j], head_buf[i, n + j],
                            q, positions, cos_sin, slots, cache,
                            kv_block_stride)  # fmt: skip
        else:
            for idx in cutlass.range(tidx, b * 2 * n, NUM_THREADS):
                i, col = idx // (2 * n), idx % (2 * n)
                dim = (col // n) * half + part * n + col % n
                _store_v(shape, i, head - nq - nkv, dim, head_buf, col, slots,
                         cache, kv_block_stride)  # fmt: skip
        consumer_sync()  # head_buf is reused by the next unit
