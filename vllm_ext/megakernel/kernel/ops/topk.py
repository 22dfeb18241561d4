# SPDX-License-Identifier: Apache-2.0
"""TOPK (reference: ``ops/topk.py``, the rule ``moe.route``): each real
request's experts and weights from its bf16 router logits, in fp32, and
the batch's distinct experts in slots, ascending. One instruction, one CTA.

A warp per request, lane l holding experts l, l + 32, ...: scores (softmax
as max, exp(x - max), sum, divide; or sigmoid), plus the correction bias
for selection only; grouped top-k ranks each group by its max (by its best
two when biased) and keeps ``topk_groups`` groups; then ``top_k`` rounds
of a warp-wide argmax, the lower expert index winning ties (the
reference's stable sort), a chosen expert leaving the race. Weights are
the chosen unbiased scores, renormalised left to right, times
``routed_scaling``. Padding rows (sequence length 0) choose slot -1.

The distinct set: every choice sets its expert's flag in shared memory;
warp 0 turns the flags into slots with a ballot and a population count per
32 experts (a prefix count), writing each slot's expert; each choice then
reads its expert's slot.

Against the reference on the same logits: the choices are the same
wherever the scores are (ties included); the scores themselves may differ
in the last bits, since ``exp`` is the GPU's and the softmax sum runs in a
warp's order, not PyTorch's vectorized one (and the renormalising sum
left to right, which PyTorch does not promise).
"""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from vllm_ext.megakernel.kernel.ops.common import (
    NUM_THREADS,
    NUM_WARPS,
    consumer_sync,
    gmem,
    thread_ids,
)
from vllm_ext.megakernel.kernel.shape import (
    GlobalSlot,
    KernelShape,
    LayerSlot,
    route_layout,
)

NEG_INF = float("-inf")


def topk_words(s: KernelShape) -> int:
    """Int32 scratch: a flag (then a slot) per expert, each choice's expert."""
    return s.num_experts + s.batch * s.top_k


@cute.jit
def topk(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, glob, scratch: cute.Tensor):
    shape: KernelShape = s
    b, k = shape.batch, shape.top_k
    lay = route_layout(shape)
    words = ptrs[layer, LayerSlot.ROUTE]
    slots = gmem(Int32, words + lay.slots * 4, (b, k))
    experts = gmem(Int32, words + lay.experts * 4, (shape.num_slots,))
    used, chosen = route_batch(shape, ptrs, layer, glob, scratch, experts, True)
    tidx, _, _ = thread_ids()
    for idx in cutlass.range(tidx, b * k, NUM_THREADS):
        x = chosen[idx]
        slot = Int32(-1)
        if x >= 0:
            slot = used[x]
        slots[idx // k, idx % k] = slot


@cute.jit
def route_batch(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, glob,
                scratch: cute.Tensor, experts: cute.Tensor,
                with_weights: cutlass.Constexpr):  # fmt: skip
    """Every consumer thread: the batch's routing from the logits. Returns
    (used, chosen), views of ``scratch``: used[x] is expert x's slot where
    some request chose x, chosen[r * top_k + t] request r's t-th expert (-1
    for a padding row); each slot's expert goes to ``experts`` (-1 past the
    last). Each request's weights go to the layer's routing table only
    ``with_weights`` (TOPK: a routed EXPERT_UP runs this too, on the same
    logits in the same order, so it gets the same slots bit for bit).
    Every thread sees the outputs on return."""
    shape: KernelShape = s
    b, e, k = shape.batch, shape.num_experts, shape.top_k
    lay = route_layout(shape)
    weights = gmem(Float32, ptrs[layer, LayerSlot.ROUTE] + lay.weights * 4, (b, k))
    seq_lens = gmem(Int32, ptrs[glob, GlobalSlot.SEQ_LENS], (b,))
    used = cute.make_tensor(scratch.iterator, cute.make_layout(e))
    chosen = cute.make_tensor(scratch.iterator + e, cute.make_layout(b * k))
    tidx, warp, lane = thread_ids()
    for x in cutlass.range(tidx, e, NUM_THREADS):
        used[x] = Int32(0)
    consumer_sync()

    for r in cutlass.range(warp, b, NUM_WARPS):
        if seq_lens[r] > 0:  # (uniform in the warp)
            _route_request(shape, ptrs, layer, r, lane, weights, chosen, used,
                           with_weights)  # fmt: skip
        elif lane < k:
            chosen[r * k + lane] = Int32(-1)
    consumer_sync()

    if warp == 0:
        # Flags -> slots: the experts chosen, ascending (a prefix count).
        count = Int32(0)
        below = (Int32(1) << lane) - 1  # lanes under this one
        for c0 in cutlass.range_constexpr(0, e, 32):
            x = c0 + lane
            flag = Int32(0)
            if x < e:
                flag = used[x]
            ballot = cute.arch.vote_ballot_sync(flag != 0)
            if flag != 0:
                slot = count + cute.arch.popc(ballot & below)
                used[x] = slot
                experts[slot] = x
            count = count + cute.arch.popc(ballot)
        for slot in cutlass.range(count + lane, shape.num_slots, 32):
            experts[slot] = Int32(-1)
    consumer_sync()
    return used, chosen


@cute.jit
def _route_request(s: cutlass.Constexpr, ptrs, layer, r, lane, weights, chosen, used,
                   with_weights: cutlass.Constexpr):  # fmt: skip
    """A warp: request r's top_k experts (to ``chosen``, flagged in
    ``used``) and, ``with_weights``, weights (to ``weights``), moe.route's
    rule."""
    shape: KernelShape = s
    e, k = shape.num_experts, shape.top_k
    per_lane = (e + 31) // 32
    logits = gmem(BFloat16, ptrs[layer, LayerSlot.ROUTER_LOGITS],
                  (shape.batch, shape.router_stride))  # fmt: skip
    score = cute.make_rmem_tensor((per_lane,), Float32)  # unbiased
    pick = cute.make_rmem_tensor((per_lane,), Float32)  # what selects
    # Experts past the last (e not a multiple of 32) start out taken.
    taken = Int32(0)
    for j in cutlass.range_constexpr(per_lane):
        v = Float32(NEG_INF)
        if lane + 32 * j < e:
            v = logits[r, lane + 32 * j].to(Float32)
        else:
            taken = taken | Int32(1 << j)
        score[j] = v
    if cutlass.const_expr(shape.moe_sigmoid):
        for j in cutlass.range_constexpr(per_lane):
            score[j] = Float32(1.0) / (Float32(1.0) + cute.math.exp(-score[j]))
    else:
        m = Float32(NEG_INF)
        for j in cutlass.range_constexpr(per_lane):
            m = cute.arch.fmax(m, score[j])
        m = cute.arch.warp_reduction(m, cute.arch.fmax)
        total = Float32(0.0)
        for j in cutlass.range_constexpr(per_lane):
            score[j] = cute.math.exp(score[j] - m)
            total = total + score[j]
        total = cute.arch.warp_reduction(total, operator.add)
        for j in cutlass.range_constexpr(per_lane):
            score[j] = score[j] / total
    for j in cutlass.range_constexpr(per_lane):
        pick[j] = score[j]
        if cutlass.const_expr(shape.correction_bias):
            bias = gmem(Float32, ptrs[layer, LayerSlot.CORRECTION_BIAS], (e,))
            if lane + 32 * j < e:
                pick[j] = score[j] + bias[lane + 32 * j]
    if cutlass.const_expr(shape.grouped):
        _keep_groups(shape, pick, lane)

    chosen_w = cute.make_rmem_tensor((k,), Float32)
    for t in cutlass.range_constexpr(k):
        best, idx, w = _argmax(shape, pick, score, taken, lane)
        chosen_w[t] = w
        if lane == idx % 32:
            taken = taken | (Int32(1) << (idx // 32))
        if lane == 0:
            chosen[r * k + t] = idx
            used[idx] = Int32(1)
    if cutlass.const_expr(with_weights):
        _store_weights(shape, chosen_w, weights, r, lane)


@cute.jit
def _store_weights(s: cutlass.Constexpr, chosen_w, weights, r, lane):
    """Request r's chosen scores, renormalised and scaled, to its row."""
    shape: KernelShape = s
    k = shape.top_k
    if cutlass.const_expr(shape.renormalize):
        total = chosen_w[0]
        for t in cutlass.range_constexpr(1, k):
            total = total + chosen_w[t]
        for t in cutlass.range_constexpr(k):
            chosen_w[t] = chosen_w[t] / total
    if lane == 0:
        for t in cutlass.range_constexpr(k):
            w = chosen_w[t]
            if cutlass.const_expr(shape.routed_scaling != 1.0):
                w = w * Float32(shape.routed_scaling)
            weights[r, t] = w


@cute.jit
def _argmax(s: cutlass.Constexpr, pick, score, taken, lane):
    """The warp's best untaken expert: (its pick value, its index, its
    unbiased score), the lower index first among equal values; the same
    on every lane (a butterfly over a total order)."""
    shape: KernelShape = s
    e = shape.num_experts
    best = Float32(NEG_INF)
    idx = Int32(e)  # none yet
    w = Float32(0.0)
    for j in cutlass.range_constexpr(pick.shape[0]):
        if ((taken >> j) & 1) == 0:
            if idx == e or pick[j] > best:
                best, idx, w = pick[j], lane + 32 * j, score[j]
    for sh in cutlass.range_constexpr(5):
        o_best = cute.arch.shuffle_sync_bfly(best, 16 >> sh)
        o_idx = cute.arch.shuffle_sync_bfly(idx, 16 >> sh)
        o_w = cute.arch.shuffle_sync_bfly(w, 16 >> sh)
        if o_idx < e:
            if idx == e or o_best > best:
                best, idx, w = o_best, o_idx, o_w
            elif o_best == best:
                if o_idx < idx:
                    best, idx, w = o_best, o_idx, o_w
    return best, idx, w


@cute.jit
def _keep_groups(s: cutlass.Constexpr, pick, lane):
    """Grouped top-k: each group's rank (its max, or the sum of its best two
    when biased), the best ``topk_groups`` kept (lower group first among
    equals), every other expert's pick set to -inf."""
    shape: KernelShape = s
    e, groups = shape.num_experts, shape.num_groups
    size = e // groups
    per_lane = pick.shape[0]
    rank = cute.make_rmem_tensor((groups,), Float32)
    for g in cutlass.range_constexpr(groups):
        m1 = Float32(NEG_INF)
        for j in cutlass.range_constexpr(per_lane):
            if (lane + 32 * j) // size == g:
                m1 = cute.arch.fmax(m1, pick[j])
        m1 = cute.arch.warp_reduction(m1, cute.arch.fmax)
        if cutlass.const_expr(shape.correction_bias):
            # The second best: the best but for the max's first holder.
            first = Int32(e)
            for j in cutlass.range_constexpr(per_lane):
                x = lane + 32 * j
                if x // size == g:
                    if pick[j] == m1:
                        first = cutlass.min(first, x)
            first = cute.arch.warp_reduction(first, cutlass.min)
            m2 = Float32(NEG_INF)
            for j in cutlass.range_constexpr(per_lane):
                x = lane + 32 * j
                if x // size == g:
                    if x != first:
                        m2 = cute.arch.fmax(m2, pick[j])
            m2 = cute.arch.warp_reduction(m2, cute.arch.fmax)
            rank[g] = m1 + m2
        else:
            rank[g] = m1
    kept = Int32(0)
    for _ in cutlass.range_constexpr(shape.topk_groups):
        best = Float32(NEG_INF)
        bi = Int32(groups)
        for g in cutlass.range_constexpr(groups):
            if ((kept >> g) & 1) == 0:
                if bi == groups or rank[g] > best:
                    best, bi = rank[g], Int32(g)
        kept = kept | (Int32(1) << bi)
    for j in cutlass.range_constexpr(per_lane):
        if ((kept >> ((lane + 32 * j) // size)) & 1) == 0:
            pick[j] = Float32(NEG_INF)
