# SPDX-License-Identifier: Apache-2.0
"""EXPERT_UP (reference: ``ops/expert_up.py``): for the requests routed to
slot s, xact[s, r, lo:hi] = SiLU(x @ Wg.T) * (x @ Wu.T), x = RMSNorm(hmid[r]),
on the rows of s's expert in w13 (gate rows [lo, hi), up rows I + [lo, hi)):
GATE_UP's arithmetic on weights the routing chooses. Slot ``num_slots`` is
the shared expert (if the model has one): every request, its own weights,
no routing read.

The expert's address is data: it is read from TOPK's output after this
instruction's wait, and only then does its tile start streaming: the
controller lane (control.py; the mixture runs under the warp roles only)
runs ``prefetch_routed`` once the wait is met, before it publishes the
instruction, so the rows stream while the consumers finish earlier
instructions (the L2 prefetch before the wait covers the shared expert
alone; ops/prefetch.py).
The routed requests are gathered into a compact list in shared memory, so
the GEMV's passes over a weight row cover only them (at batch 1, the one).
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from vllm_ext.megakernel.kernel.ops.common import (
    BATCH_GROUP,
    NUM_THREADS,
    NUM_WARPS,
    VEC,
    consumer_sync,
    gmem,
    load_f32,
    round_bf16,
    row_rstd,
    stage_normed,
    stages_input,
    thread_ids,
    vectors,
    warp_sum,
)
from vllm_ext.megakernel.kernel.ops.gemv import gemv
from vllm_ext.megakernel.kernel.ops.prefetch import prefetch_rows
from vllm_ext.megakernel.kernel.shape import KernelShape, LayerSlot, route_layout


@cute.jit
def prefetch_routed(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, slot, cols):
    """One thread whose view of TOPK's routing is current (after the acquire
    that met this instruction's wait, on TOPK's counter): slot ``slot``'s
    expert's rows of this tile (gate and up), into L2. Nothing for an empty
    slot, nor for the shared expert (static: ops/prefetch.py)."""
    shape: KernelShape = s
    h, inter = shape.hidden, shape.expert_intermediate
    if slot < shape.num_slots:
        lay = route_layout(shape)
        words = ptrs[layer, LayerSlot.ROUTE]
        expert = gmem(Int32, words + lay.experts * 4, (shape.num_slots,))[slot]
        if expert >= 0:
            lo, hi = cols >> 16, cols & 0xFFFF
            base = ptrs[layer, LayerSlot.W13] + Int64(expert) * (2 * inter * h * 2)
            prefetch_rows(base, h * 2, lo, hi)
            prefetch_rows(base, h * 2, lo + inter, hi + inter)


def gather_words(batch: int) -> int:
    """Int32 scratch of the gather: a flag per request, the compact list of
    routed requests, their count."""
    return 2 * batch + 1


@cute.jit
def expert_up(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, slot, cols, rstd,
              x_stage, gather):  # fmt: skip
    shape: KernelShape = s
    lo, hi = cols >> 16, cols & 0xFFFF
    if cutlass.const_expr(shape.shared_intermediate > 0):
        if slot == shape.num_slots:
            _shared(shape, ptrs, layer, slot, lo, hi, rstd, x_stage)
        else:
            _routed(shape, ptrs, layer, slot, lo, hi, rstd, x_stage, gather)
    else:
        _routed(shape, ptrs, layer, slot, lo, hi, rstd, x_stage, gather)


@cute.jit
def _shared(s: cutlass.Constexpr, ptrs, layer, slot, lo, hi, rstd, x_stage):
    """The shared expert: GATE_UP on its own weights, every request."""
    shape: KernelShape = s
    b, h, inter = shape.batch, shape.hidden, shape.shared_intermediate
    base = ptrs[layer, LayerSlot.SHARED_GATE_UP]
    gate = gmem(BFloat16, base, (inter, h))
    up = gmem(BFloat16, base + inter * h * 2, (inter, h))  # bytes
    x = gmem(BFloat16, ptrs[layer, LayerSlot.HMID], (b, h))
    norm = gmem(BFloat16, ptrs[layer, LayerSlot.POST_NORM], (h,))
    xact = _xact(shape, ptrs, layer, slot)
    row_rstd(x, rstd, shape.rms_norm_eps)

    def epilogue(row, i, sg, su):
        xact[i, row] = silu_mul(sg, su)

    if cutlass.const_expr(stages_input(shape)):
        stage_normed(x, norm, rstd, x_stage)
        gemv(gate, up, x_stage, norm, rstd, lo, hi, epilogue, False, True)
    else:
        gemv(gate, up, x, norm, rstd, lo, hi, epilogue, True, True)


@cute.jit
def _xact(s: cutlass.Constexpr, ptrs, layer, slot) -> cute.Tensor:
    shape: KernelShape = s
    b, width = shape.batch, shape.xact_width
    base = ptrs[layer, LayerSlot.XACT] + Int64(slot) * (b * width * 2)  # bytes
    return gmem(BFloat16, base, (b, width))


@cute.jit
def _routed(s: cutlass.Constexpr, ptrs, layer, slot, lo, hi, rstd, x_stage, gather):
    shape: KernelShape = s
    b, h, k, inter = shape.batch, shape.hidden, shape.top_k, shape.expert_intermediate
    lay = route_layout(shape)
    words = ptrs[layer, LayerSlot.ROUTE]
    slots = gmem(Int32, words + lay.slots * 4, (b, k))
    expert = gmem(Int32, words + lay.experts * 4, (shape.num_slots,))[slot]
    tidx, warp, lane = thread_ids()
    # (Every thread read the same expert: the branch is uniform, and its
    # barriers are met by the whole CTA.)
    if expert >= 0:
        # (Its tile was hinted into L2 by the control: prefetch_routed.)
        base = ptrs[layer, LayerSlot.W13] + Int64(expert) * (2 * inter * h * 2)
        flags = cute.make_tensor(gather.iterator, cute.make_layout(b))
        rows = cute.make_tensor(gather.iterator + b, cute.make_layout(b))
        count = cute.make_tensor(gather.iterator + 2 * b, cute.make_layout(1))
        for r in cutlass.range(tidx, b, NUM_THREADS):
            hit = Int32(0)
            for c in cutlass.range_constexpr(k):
                if slots[r, c] == slot:
                    hit = Int32(1)
            flags[r] = hit
        consumer_sync()
        if tidx == 0:
            n = Int32(0)
            for r in cutlass.range(b):
                if flags[r] != 0:
                    rows[n] = r
                    n = n + 1
            count[0] = n
        consumer_sync()
        n = count[0]
        gate = gmem(BFloat16, base, (inter, h))
        up = gmem(BFloat16, base + inter * h * 2, (inter, h))  # bytes
        hmid = ptrs[layer, LayerSlot.HMID]
        norm = gmem(BFloat16, ptrs[layer, LayerSlot.POST_NORM], (h,))
        xact = _xact(shape, ptrs, layer, slot)
        # rstd of the gathered requests, rstd[j] for rows[j] (row_rstd's sum).
        for j in cutlass.range(warp, n, NUM_WARPS):
            xv = vectors(gmem(BFloat16, hmid + Int64(rows[j]) * (h * 2), (h,)))
            ss = Float32(0.0)
            for v in cutlass.range(lane, h // VEC, 32):
                xf = load_f32(xv, v)
                for e in cutlass.range_constexpr(VEC):
                    ss = ss + xf[e] * xf[e]
            ss = warp_sum(ss)
            if lane == 0:
                rstd[j] = cute.math.rsqrt(ss / Float32(h) + Float32(shape.rms_norm_eps))
        consumer_sync()
        group = min(b, BATCH_GROUP)
        if cutlass.const_expr(stages_input(shape)):
            # The gathered requests' normed rows, compact, in x_stage.
            n_vec = h // VEC
            nv = vectors(norm)
            for idx in cutlass.range(tidx, n * n_vec, NUM_THREADS):
                j, v = idx // n_vec, idx % n_vec
                src = vectors(gmem(BFloat16, hmid + Int64(rows[j]) * (h * 2), (h,)))
                y = load_f32(src, v) * rstd[j] * load_f32(nv, v)
                r = cute.make_rmem_tensor((VEC,), BFloat16)
                r.store(y.to(BFloat16))
                cute.autovec_copy(r, vectors(x_stage[j, None])[None, v])
            consumer_sync()
            # Groups of gathered requests; past n, a group's last rows are
            # computed on stale rows and not stored.
            for j0 in cutlass.range(0, n, group):
                off = cute.assume(j0 * h, divby=VEC)
                rows_g = cute.make_layout((group, h), stride=(h, 1))
                xg = cute.make_tensor(x_stage.iterator + off, rows_g)

                def epilogue(row, i, sg, su, j0=j0):
                    _store_gathered(xact, rows, j0, n, row, i, sg, su)

                gemv(gate, up, xg, norm, rstd, lo, hi, epilogue, False, True)
        else:
            # One request at a time, normed on the fly (its rstd at j).
            for j in cutlass.range(n):
                x1 = gmem(BFloat16, hmid + Int64(rows[j]) * (h * 2), (1, h))
                r1 = cute.make_tensor(rstd.iterator + j, cute.make_layout(1))

                def epilogue(row, i, sg, su, j=j):
                    _store_gathered(xact, rows, j, n, row, i, sg, su)

                gemv(gate, up, x1, norm, r1, lo, hi, epilogue, True, True)


@cute.jit
def _store_gathered(xact: cute.Tensor, rows: cute.Tensor, j0, n, row, i, sg, su):
    """Gathered request ``j0 + i``'s output (if it is one: ``< n``)."""
    if j0 + i < n:
        xact[rows[j0 + i], row] = silu_mul(sg, su)


def silu_mul(sg, su):
    """GATE_UP's epilogue: SiLU of the bf16 gate times the bf16 up."""
    g = round_bf16(sg)
    return (g / (Float32(1.0) + cute.math.exp(-g)) * round_bf16(su)).to(BFloat16)
