# SPDX-License-Identifier: Apache-2.0
"""EXPERT_DOWN (reference: ``ops/expert_down.py``): hidden columns
[lo, hi) of h_out = hmid + the weighted sum, over each request's routed
slots in ascending order, of xact[s, r] @ w2[expert(s)][lo:hi].T, then the
shared expert's (weight 1) if any: one fp32 accumulator per request,
rounded to bf16 once, then the residual added and rounded.

A warp owns an output column. For a group of requests it walks the slots
in order (they hold the batch's experts ascending, the empty ones last)
and reads slot s's expert's row once for every request of the group routed
to s; each request's choices, sorted by slot into shared memory first, are
consumed by a cursor, so a request's weights add in slot order as the
reference's do. Which rows exist is data (TOPK's output): the first
slots' tiles are hinted into L2 by the routed EXPERT_UP right before it in
the queue (ops/expert_up.py's ``hint_routed``), or else by the control
(``prefetch_routed``) as soon as this instruction's wait is met.

Against the reference: each dot product sums in the GEMV's order, not
PyTorch's, and the compiler may fuse a weight's product into its
accumulation (one rounding instead of two): within rounding of it, not
bit for bit (like every GEMV of the kernel).
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8

from vllm_ext.megakernel.isa import Point
from vllm_ext.megakernel.kernel.ops.all_reduce import own_partials
from vllm_ext.megakernel.kernel.ops.common import (
    BATCH_GROUP,
    NUM_THREADS,
    NUM_WARPS,
    VEC,
    consumer_sync,
    gmem,
    load_f32,
    round_bf16,
    thread_ids,
    vectors,
    warp_sum,
)
from vllm_ext.megakernel.kernel.ops.gemv_paged import weight_scales
from vllm_ext.megakernel.kernel.ops.gemv_quant import (
    code_bytes,
    code_vectors,
    lane_weights,
    row_bytes,
    scale_bytes,
)
from vllm_ext.megakernel.kernel.ops.prefetch import PREFETCH_BYTES, prefetch_rows
from vllm_ext.megakernel.kernel.shape import (
    FP8_GROUP,
    KernelShape,
    LayerSlot,
    route_layout,
)

# Slots whose tiles the control hints into L2 once the routing is visible (at
# most 2 x PREFETCH_BYTES in all, as a dense tile's two matrices).
PREFETCH_SLOTS = 8


@cute.jit
def prefetch_routed(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, lo, hi,
                    experts: cute.Tensor):  # fmt: skip
    """One thread that sees this step's slots' experts (``experts``: TOPK's
    table after the acquire that met this instruction's wait, which TOPK's
    signal happens before; or a routed EXPERT_UP's own routing in shared
    memory): columns [lo, hi)'s rows of the first slots' experts, into L2
    (at most what two matrices' prefetch of a dense tile would be)."""
    shape: KernelShape = s
    h, inter = shape.hidden, shape.expert_intermediate
    w2 = ptrs[layer, LayerSlot.W2]
    row = row_bytes(shape, inter)
    tile = (hi - lo) * row
    budget = Int32(2 * PREFETCH_BYTES)
    for slot in cutlass.range_constexpr(min(shape.num_slots, PREFETCH_SLOTS)):
        ex = experts[slot]
        if ex >= 0:
            if budget > 0:
                prefetch_rows(w2 + Int64(ex) * (h * row), row, lo, hi)
                budget = budget - tile


@cute.jit
def routing_table_experts(s: cutlass.Constexpr, ptrs: cute.Tensor, layer):
    """TOPK's table of each slot's expert (global memory)."""
    shape: KernelShape = s
    words = ptrs[layer, LayerSlot.ROUTE]
    return gmem(Int32, words + route_layout(shape).experts * 4, (shape.num_slots,))


@cute.jit
def expert_down(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, glob, lo, hi,
                scratch: cute.Tensor, choice_w: cute.Tensor):  # fmt: skip
    shape: KernelShape = s
    b, h, k, inter = shape.batch, shape.hidden, shape.top_k, shape.expert_intermediate
    lay = route_layout(shape)
    words = ptrs[layer, LayerSlot.ROUTE]
    weights = gmem(Float32, words + lay.weights * 4, (b, k))
    slots = gmem(Int32, words + lay.slots * 4, (b, k))
    experts = gmem(Int32, words + lay.experts * 4, (shape.num_slots,))
    w2 = ptrs[layer, LayerSlot.W2]
    tidx, warp, lane = thread_ids()
    # (The first slots' tiles were hinted into L2 by the control:
    # prefetch_routed.)
    # Each request's choices in ascending slot order (padding: all -1).
    choice = cute.make_tensor(scratch.iterator, cute.make_layout(b * k))
    for r in cutlass.range(tidx, b, NUM_THREADS):
        sl = cute.make_rmem_tensor((k,), Int32)
        wt = cute.make_rmem_tensor((k,), Float32)
        for c in cutlass.range_constexpr(k):
            sl[c] = slots[r, c]
            wt[c] = weights[r, c]
        for a in cutlass.range_constexpr(k):
            for c in cutlass.range_constexpr(k - 1 - a):
                if sl[c + 1] < sl[c]:
                    ts, tw = sl[c], wt[c]
                    sl[c], wt[c] = sl[c + 1], wt[c + 1]
                    sl[c + 1], wt[c + 1] = ts, tw
        for c in cutlass.range_constexpr(k):
            choice[r * k + c] = sl[c]
            choice_w[r * k + c] = wt[c]
    consumer_sync()

    hmid = gmem(BFloat16, ptrs[layer, LayerSlot.HMID], (b, h))
    dst = gmem(BFloat16, ptrs[layer, LayerSlot.H_OUT], (b, h))
    if cutlass.const_expr(shape.tp_size > 1):
        # The rank's partial sum, no residual (ALL_REDUCE adds both).
        dst = own_partials(shape, ptrs, glob, Int32(Point.MLP), layer)
    xact = ptrs[layer, LayerSlot.XACT]
    width = shape.xact_width
    group = min(b, BATCH_GROUP)
    unroll = 8 if group == 1 else 4 if group <= 2 else 2
    for col in cutlass.range(lo + warp, hi, NUM_WARPS):
        for b0 in cutlass.range(0, b, group):
            acc = cute.make_rmem_tensor((group,), Float32)
            cur = cute.make_rmem_tensor((group,), Int32)
            acc.fill(0.0)
            cur.fill(0)
            for slot in cutlass.range(shape.num_slots):
                ex = experts[slot]
                if ex >= 0:
                    hit = cute.make_rmem_tensor((group,), Int32)
                    any_hit = Int32(0)
                    for i in cutlass.range_constexpr(group):
                        hit[i] = Int32(0)
                        if cur[i] < k:
                            if choice[(b0 + i) * k + cur[i]] == slot:
                                hit[i] = Int32(1)
                                any_hit = Int32(1)
                    if any_hit != 0:
                        dot = cute.make_rmem_tensor((group,), Float32)
                        dot.fill(0.0)
                        if cutlass.const_expr(shape.quantized):
                            _quant_dots(shape, ptrs, layer, ex, col, slot, b0, hit,
                                        dot, lane, unroll)  # fmt: skip
                        else:
                            row = w2 + (Int64(ex) * h + col) * (inter * 2)
                            wv = vectors(gmem(BFloat16, row, (inter,)))
                            xs = xact + Int64(slot) * (b * width * 2)
                            for v in cutlass.range(lane, inter // VEC, 32,
                                                   unroll=unroll):  # fmt: skip
                                wf = load_f32(wv, v)
                                # (Elements taken out before the branches: an
                                # element extracted inside one is not visible
                                # to the next.)
                                we = [wf[e] for e in range(VEC)]
                                _dots(dot, hit, we, xs, b0, width, inter, v)
                        for i in cutlass.range_constexpr(group):
                            s1 = warp_sum(dot[i])
                            if hit[i] != 0:
                                w = choice_w[(b0 + i) * k + cur[i]]
                                acc[i] = acc[i] + w * s1
                                cur[i] = cur[i] + 1
            if cutlass.const_expr(shape.shared_intermediate > 0):
                _shared(shape, ptrs, layer, col, b0, acc, lane, unroll)
            if lane == 0:
                for i in cutlass.range_constexpr(group):
                    if cutlass.const_expr(shape.tp_size > 1):
                        dst[b0 + i, col] = acc[i].to(BFloat16)
                    else:
                        y = round_bf16(acc[i]) + hmid[b0 + i, col].to(Float32)
                        dst[b0 + i, col] = y.to(BFloat16)


@cute.jit
def _dots(dot: cute.Tensor, hit: cute.Tensor, we, xs, b0, width: cutlass.Constexpr,
          inter: cutlass.Constexpr, v):  # fmt: skip
    """Each routed request's ``dot[i] += xact row b0 + i . we`` (vector v)."""
    for i in cutlass.range_constexpr(dot.shape[0]):
        if cutlass.const_expr(dot.shape[0] == 1):
            # (The one request is routed here.)
            _dot(dot, i, we, xs, b0 + i, width, inter, v)
        elif hit[i] != 0:
            _dot(dot, i, we, xs, b0 + i, width, inter, v)


@cute.jit
def _quant_dots(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, ex, col, slot, b0,
                hit: cute.Tensor, dot: cute.Tensor, lane,
                unroll: cutlass.Constexpr):  # fmt: skip
    """``_dots`` over a quantized expert's row ``col`` of w2 (``_qdots``)."""
    shape: KernelShape = s
    h, inter = shape.hidden, shape.expert_intermediate
    codes = ptrs[layer, LayerSlot.W2] + Int64(ex) * code_bytes(shape, h, inter)
    at = ptrs[layer, LayerSlot.W2_SCALE] + Int64(ex) * scale_bytes(shape, h, inter)
    _qdots(shape, ptrs, layer, codes, at, inter, col, slot, b0, hit, dot, lane, unroll)


@cute.jit
def _qdots(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, codes, scales,
           inter: cutlass.Constexpr, col, slot, b0, hit: cute.Tensor,
           dot: cute.Tensor, lane, unroll: cutlass.Constexpr):  # fmt: skip
    """Row ``col`` of a quantized [hidden, inter] matrix (``codes`` and
    ``scales`` its addresses, ``gemv_quant``) against slot ``slot``'s
    inputs of requests b0 .. (those ``hit``; all where hit is None): FP8
    against XQ (the slot's inputs quantized by its last EXPERT_UP tile)
    with their scales XSCALE, each 8-k sum scaled by the input group's and
    the weight block's scales (blocks) or the sum by the request's and the
    row's (per channel); INT4 against XACT. Each ``dot[i]`` is the warp's
    share of the scaled sum."""
    shape: KernelShape = s
    b, h, width = shape.batch, shape.hidden, shape.xact_width
    int4 = shape.int4_group > 0
    cv = code_vectors(gmem(Uint8, codes + Int64(col) * row_bytes(shape, inter),
                           (row_bytes(shape, inter),)), int4)  # fmt: skip
    ws = weight_scales(shape, scales, h, inter)
    inputs = LayerSlot.XACT if int4 else LayerSlot.XQ
    xs = gmem(BFloat16, ptrs[layer, inputs] + Int64(slot) * (b * width * 2), (b, width))
    groups = max(shape.xact_groups, 1)
    xsc = gmem(Float32, ptrs[layer, LayerSlot.XSCALE] + Int64(slot) * (b * groups * 4),
               (b, groups))  # fmt: skip
    group = dot.shape[0]
    for v in cutlass.range(lane, inter // VEC, 32, unroll=unroll):
        scale2 = Int32(0)
        if cutlass.const_expr(int4):
            t = Int32(ws[col, (v * VEC) // shape.int4_group])
            scale2 = t | (t << 16)
        we = lane_weights(cv, v, int4, scale2)
        g = (v * VEC) // FP8_GROUP
        for i in cutlass.range_constexpr(group):
            if cutlass.const_expr(group == 1 or hit is None) or hit[i] != 0:
                _qdot(shape, dot, i, we, xs, xsc, ws, b0, col, g, v)
    if cutlass.const_expr(shape.fp8 and not shape.fp8_block):
        # (Per channel: the warp's shares add up to the sum, so each share
        # is scaled: a * (w * share), summed by the caller's warp_sum.)
        for i in cutlass.range_constexpr(group):
            dot[i] = xsc[b0 + i, 0] * (ws[col] * dot[i])


@cute.jit
def _qdot(s: cutlass.Constexpr, dot: cute.Tensor, i, we, xs: cute.Tensor,
          xsc: cute.Tensor, ws: cute.Tensor, b0, col, g, v):  # fmt: skip
    """dot[i] += vector v of request b0 + i's input . the weights ``we``
    (FP8 blocks: scaled by its group's and the block's scales)."""
    shape: KernelShape = s
    xf = load_f32(vectors(xs[b0 + i, None]), v)
    part = Float32(0.0)
    for e in cutlass.range_constexpr(VEC):
        part = part + we[e] * xf[e]
    if cutlass.const_expr(shape.fp8_block):
        part = (part * xsc[b0 + i, g]) * ws[col // FP8_GROUP, g]
    dot[i] = dot[i] + part


@cute.jit
def _dot(dot, i, we, xs, r, width: cutlass.Constexpr, inter: cutlass.Constexpr, v):
    """dot[i] += vector v of xact row r (slot base ``xs``) . the weights."""
    xr = xs + Int64(r) * (width * 2)
    xf = load_f32(vectors(gmem(BFloat16, xr, (inter,))), v)
    for e in cutlass.range_constexpr(VEC):
        dot[i] = dot[i] + we[e] * xf[e]


@cute.jit
def _shared(s: cutlass.Constexpr, ptrs, layer, col, b0, acc, lane,
            unroll: cutlass.Constexpr):  # fmt: skip
    """acc[i] += xact[shared, b0 + i] @ shared_down[col] (weight 1; a
    quantized one by ``_qdots``)."""
    shape: KernelShape = s
    si = shape.shared_intermediate
    group = acc.shape[0]
    if cutlass.const_expr(shape.dense_quantized):
        dot = cute.make_rmem_tensor((group,), Float32)
        dot.fill(0.0)
        _qdots(shape, ptrs, layer, ptrs[layer, LayerSlot.SHARED_DOWN],
               ptrs[layer, LayerSlot.SHARED_DOWN_SCALE], si, col, shape.num_slots,
               b0, None, dot, lane, unroll)  # fmt: skip
        for i in cutlass.range_constexpr(group):
            acc[i] = acc[i] + warp_sum(dot[i])
    else:
        _shared_bf16(shape, ptrs, layer, col, b0, acc, lane, unroll)


@cute.jit
def _shared_bf16(s: cutlass.Constexpr, ptrs, layer, col, b0, acc, lane,
                 unroll: cutlass.Constexpr):  # fmt: skip
    shape: KernelShape = s
    b, width, si = shape.batch, shape.xact_width, shape.shared_intermediate
    group = acc.shape[0]
    row = ptrs[layer, LayerSlot.SHARED_DOWN] + Int64(col) * (si * 2)
    wv = vectors(gmem(BFloat16, row, (si,)))
    xs = gmem(BFloat16, ptrs[layer, LayerSlot.XACT]
              + Int64(shape.num_slots) * (b * width * 2), (b, width))  # fmt: skip
    dot = cute.make_rmem_tensor((group,), Float32)
    dot.fill(0.0)
    for v in cutlass.range(lane, si // VEC, 32, unroll=unroll):
        wf = load_f32(wv, v)
        for i in cutlass.range_constexpr(group):
            xf = load_f32(vectors(xs[b0 + i, None]), v)
            for e in cutlass.range_constexpr(VEC):
                dot[i] = dot[i] + wf[e] * xf[e]
    for i in cutlass.range_constexpr(group):
        acc[i] = acc[i] + warp_sum(dot[i])
