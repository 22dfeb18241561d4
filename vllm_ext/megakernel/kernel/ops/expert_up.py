# SPDX-License-Identifier: Apache-2.0
"""EXPERT_UP (reference: ``ops/expert_up.py``): for the requests routed to
slot s, xact[s, r, lo:hi] = SiLU(x @ Wg.T) * (x @ Wu.T), x = RMSNorm(hmid[r]),
on the rows of s's expert in w13 (gate rows [lo, hi), up rows I + [lo, hi)):
GATE_UP's arithmetic on weights the routing chooses. Slot ``num_slots`` is
the shared expert (if the model has one): every request, its own weights,
no routing read.

The expert's address is data. A routed tile waits for ROUTE, not TOPK:
its consumers compute the batch's routing from the logits themselves
(``topk.route_batch``, TOPK's own code on the same logits: the same
slots) into shared memory, once per layer on an SM (``routing_of``); then
thread 0 hints routed rows into L2 ``ROUTED_AHEAD`` instructions ahead
(``hint_routed``) and the tile runs. So no routed row waits for TOPK's
signal: TOPK runs beside the tiles and writes the routing table that
EXPERT_DOWN reads (it waits for TOPK too). The shared expert's tile is
static: the controller's L2 prefetch before the wait covers it
(ops/prefetch.py).
The routed requests are gathered into a compact list in shared memory, so
the GEMV's passes over a weight row cover only them (at batch 1, the one).
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8

from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.kernel.ops.common import (
    BATCH_GROUP,
    NUM_THREADS,
    VEC,
    consumer_sync,
    gmem,
    round_bf16,
    row_rstd,
    stage_normed,
    stages_input,
    thread_ids,
)
from vllm_ext.megakernel.kernel.ops.expert_down import prefetch_routed as hint_down
from vllm_ext.megakernel.kernel.ops.gemv import gemv
from vllm_ext.megakernel.kernel.ops.gemv_paged import weight_scales
from vllm_ext.megakernel.kernel.ops.gemv_quant import (
    code_bytes,
    gathered_rstd,
    qgemv,
    quantize_rows,
    row_bytes,
    scale_bytes,
    stage_gathered,
    staged_passes,
)
from vllm_ext.megakernel.kernel.ops.prefetch import prefetch_rows
from vllm_ext.megakernel.kernel.ops.topk import route_batch, topk_words
from vllm_ext.megakernel.kernel.queue import downs_end
from vllm_ext.megakernel.kernel.shape import KernelShape, LayerSlot


@cute.jit
def hint_routed(s: cutlass.Constexpr, q: cutlass.Constexpr, ptrs: cute.Tensor, layer,
                computed, experts: cute.Tensor, pc, length):  # fmt: skip
    """Consumer thread 0 of a routed tile (instruction ``pc``), its layer's
    routing in shared memory: rows into L2, ``ROUTED_AHEAD`` instructions
    ahead. The tile that ``computed`` the routing (the SM's first of the
    layer) hints its own and the next ``ROUTED_AHEAD``; each later one the
    instruction ``ROUTED_AHEAD`` after it (``_hint_at``). So the SM's
    routed rows stream ahead of its consumers as far as the controller
    runs ahead, and its down rows right behind its up rows."""
    first = pc + ROUTED_AHEAD
    if computed != 0:
        first = pc
    for p in cutlass.range(first, pc + ROUTED_AHEAD + 1):
        if p < length:
            _hint_at(s, q, ptrs, layer, experts, p, length)


@cute.jit
def _hint_at(s: cutlass.Constexpr, q: cutlass.Constexpr, ptrs: cute.Tensor, layer,
             experts: cute.Tensor, p, length):  # fmt: skip
    """Instruction ``p``'s rows if it is a routed tile of ``layer``; then,
    if the layer's EXPERT_DOWN tiles follow it (the planner puts them
    there), theirs (the controller leaves them to this)."""
    shape: KernelShape = s
    if q.queue[q.sm, p, 0] == Int32(Op.EXPERT_UP):
        if q.queue[q.sm, p, 1] == layer:
            slot = q.queue[q.sm, p, 2]
            if slot < shape.num_slots:
                _hint_up(shape, ptrs, layer, experts[slot], q.queue[q.sm, p, 3])
                _hint_downs(shape, q, ptrs, layer, experts, p + 1, length)


@cute.jit
def _hint_downs(s: cutlass.Constexpr, q: cutlass.Constexpr, ptrs: cute.Tensor, layer,
                experts: cute.Tensor, p, length):  # fmt: skip
    """The rows of the EXPERT_DOWN tiles of ``layer`` from instruction p on."""
    for j in cutlass.range(p, downs_end(q, layer, p, length)):
        hint_down(s, ptrs, layer, q.queue[q.sm, j, 2], q.queue[q.sm, j, 3], experts)


@cute.jit
def _hint_up(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, expert, cols):
    """A routed tile's gate and up rows of ``expert`` into L2 (none for -1)."""
    shape: KernelShape = s
    h, inter = shape.hidden, shape.expert_intermediate
    lo, hi = cols >> 16, cols & 0xFFFF
    if expert >= 0:
        row = row_bytes(shape, h)
        base = ptrs[layer, LayerSlot.W13] + Int64(expert) * (2 * inter * row)
        prefetch_rows(base, row, lo, hi)
        prefetch_rows(base, row, lo + inter, hi + inter)


# Instructions a routed tile hints ahead of itself (control.py's
# QUEUE_SLOTS - 1: as far as the controller runs ahead; cost.py mirrors it).
ROUTED_AHEAD = 3


def routed_words(s: KernelShape) -> int:
    """Int32 scratch of a routed tile: the routing (``topk_words``), each
    slot's expert, the gather, then the layer whose routing it holds
    (``routing_of``)."""
    return topk_words(s) + s.num_slots + gather_words(s.batch) + 1


def routing_of(s: KernelShape) -> int:
    """The scratch word naming the layer whose routing the scratch holds
    (-1 at start-up): the SM's first routed tile of a layer computes it,
    the next ones of that layer (they follow each other in the queue:
    nothing else writes the scratch between them) reuse it."""
    return routed_words(s) - 1


def quant_words(s: KernelShape) -> int:
    """Words of a quantized mixture's scratch past the routing
    (``routed_words``): EXPERT_UP's flag for its slot's last tile
    (``quantize_slot``)."""
    return 1 if s.quantized else 0


def shared_w13(s: KernelShape, ptrs: cute.Tensor, layer):
    """A quantized mixture's shared expert's gate and up codes and their
    scales (SHARED_GATE_UP, SHARED_GATE_UP_SCALE)."""
    return _gate_up(s, ptrs[layer, LayerSlot.SHARED_GATE_UP],
                    ptrs[layer, LayerSlot.SHARED_GATE_UP_SCALE],
                    s.shared_intermediate)  # fmt: skip


def expert_w13(s: KernelShape, ptrs: cute.Tensor, layer, expert):
    """A quantized mixture's ``expert``: its gate and up codes (bytes, gate
    rows then up rows in W13) and their scales (W13_SCALE)."""
    h, inter = s.hidden, s.expert_intermediate
    codes = ptrs[layer, LayerSlot.W13] + Int64(expert) * code_bytes(s, 2 * inter, h)
    scales = ptrs[layer, LayerSlot.W13_SCALE] + Int64(expert) * (
        2 * scale_bytes(s, inter, h)
    )
    return _gate_up(s, codes, scales, inter)


def _gate_up(s: KernelShape, codes, scales, inter: int):
    """Gate and up codes (gate rows, then up rows, at ``codes``) and their
    scales (at ``scales``, alike), ``inter`` rows each."""
    h = s.hidden
    k = h // 2 if s.int4_group else h
    gate = gmem(Uint8, codes, (inter, k))
    up = gmem(Uint8, codes + code_bytes(s, inter, h), (inter, k))
    gate_s = weight_scales(s, scales, inter, h)
    up_s = weight_scales(s, scales + scale_bytes(s, inter, h), inter, h)
    return gate, up, gate_s, up_s


@cute.jit
def quantize_slot(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, slot, expert,
                  rows: cute.Tensor, count: cute.Tensor, lo, hi,
                  scratch: cute.Tensor):  # fmt: skip
    """FP8: the slot's outputs quantized for EXPERT_DOWN, by the slot's last
    tile. Each tile adds its columns to the slot's ARRIVE word (a GPU-scope
    acquire-release add after the consumers' barrier: its xact stores
    before it, as ``control.signal_done`` publishes them); the tile that
    completes the row quantizes the gathered requests' rows of XACT into
    XQ and XSCALE (vLLM quantizes the SiLU-mul output per token, or per
    group of 128, before its down GEMM) and resets the word for the next
    step. EXPERT_DOWN waits for every tile's signal, so for this tile's
    quantization too."""
    shape: KernelShape = s
    b, width, inter = shape.batch, shape.xact_width, shape.expert_intermediate
    n = b  # (the shared expert: rows and count None, every request)
    if cutlass.const_expr(rows is not None):
        n = count[0]
    else:
        inter = shape.shared_intermediate
    tidx, _, _ = thread_ids()
    flag = routed_words(shape)
    consumer_sync()
    if tidx == 0:
        arrive = gmem(Int32, ptrs[layer, LayerSlot.ARRIVE], (shape.xact_slots,))
        old = cute.arch.atomic_add(arrive.iterator + slot, hi - lo, sem="acq_rel",
                                   scope="gpu")  # fmt: skip
        last = Int32(0)
        if old + (hi - lo) == inter:
            last = Int32(1)
            arrive[slot] = Int32(0)  # (every tile of this step has arrived)
        scratch[flag] = last
    consumer_sync()
    if scratch[flag] != 0:
        if expert >= 0:
            groups = shape.xact_groups
            xq = gmem(BFloat16, ptrs[layer, LayerSlot.XQ]
                      + Int64(slot) * (b * width * 2), (b, width))  # fmt: skip
            xsc = gmem(Float32, ptrs[layer, LayerSlot.XSCALE]
                       + Int64(slot) * (b * groups * 4), (b, groups))  # fmt: skip
            quantize_rows(_xact(shape, ptrs, layer, slot), xq, xsc, n,
                          shape.fp8_block, rows)  # fmt: skip


def gather_words(batch: int) -> int:
    """Int32 scratch of the gather: a flag per request, the compact list of
    routed requests, their count."""
    return 2 * batch + 1


@cute.jit
def expert_up(s: cutlass.Constexpr, q: cutlass.Constexpr, ptrs: cute.Tensor, layer,
              glob, slot, cols, rstd, x_stage, x_scales, scratch, pc,
              length):  # fmt: skip
    shape: KernelShape = s
    if cutlass.const_expr(shape.shared_intermediate > 0):
        if slot == shape.num_slots:
            _shared(shape, ptrs, layer, slot, cols >> 16, cols & 0xFFFF, rstd, x_stage,
                    x_scales, scratch)  # fmt: skip
        else:
            _routed(shape, q, ptrs, layer, glob, slot, cols, rstd, x_stage, x_scales,
                    scratch, pc, length)  # fmt: skip
    else:
        _routed(shape, q, ptrs, layer, glob, slot, cols, rstd, x_stage, x_scales,
                scratch, pc, length)  # fmt: skip


@cute.jit
def _shared(s: cutlass.Constexpr, ptrs, layer, slot, lo, hi, rstd, x_stage, x_scales,
            scratch):  # fmt: skip
    """The shared expert: GATE_UP on its own weights, every request (a
    quantized one as a routed expert, ``_quant_up``; FP8 then quantizes its
    outputs for EXPERT_DOWN, ``quantize_slot``)."""
    shape: KernelShape = s
    b = shape.batch
    if cutlass.const_expr(shape.dense_quantized):
        gate, up, gate_s, up_s = shared_w13(shape, ptrs, layer)
        _quant_up(shape, ptrs, layer, slot, gate, up, gate_s, up_s, None, b, lo, hi,
                  rstd, x_stage, x_scales)  # fmt: skip
        if cutlass.const_expr(shape.fp8):
            quantize_slot(shape, ptrs, layer, slot, Int32(0), None, None, lo, hi,
                          scratch)  # fmt: skip
    else:
        _shared_bf16(shape, ptrs, layer, slot, lo, hi, rstd, x_stage)


@cute.jit
def _shared_bf16(s: cutlass.Constexpr, ptrs, layer, slot, lo, hi, rstd, x_stage):
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
def _routed(s: cutlass.Constexpr, q: cutlass.Constexpr, ptrs, layer, glob, slot, cols,
            rstd, x_stage, x_scales, scratch, pc, length):  # fmt: skip
    shape: KernelShape = s
    b, k = shape.batch, shape.top_k
    lo, hi = cols >> 16, cols & 0xFFFF
    off = topk_words(shape)
    experts = cute.make_tensor(scratch.iterator + off,
                               cute.make_layout(shape.num_slots))  # fmt: skip
    # (route_batch's view of each request's choices)
    chosen = cute.make_tensor(scratch.iterator + shape.num_experts,
                              cute.make_layout(b * k))  # fmt: skip
    tidx, warp, lane = thread_ids()
    computed = Int32(0)
    if scratch[routing_of(shape)] != layer:  # (uniform: the last barrier)
        route_batch(shape, ptrs, layer, glob, scratch, experts, False)
        computed = Int32(1)
        if tidx == 0:
            scratch[routing_of(shape)] = layer
    expert = experts[slot]
    if tidx == 0:
        hint_routed(shape, q, ptrs, layer, computed, experts, pc, length)
    # (Every thread read the same expert: the branch is uniform, and its
    # barriers are met by the whole CTA.)
    gather = cute.make_tensor(scratch.iterator + off + shape.num_slots,
                              cute.make_layout(gather_words(b)))  # fmt: skip
    rows = cute.make_tensor(gather.iterator + b, cute.make_layout(b))
    count = cute.make_tensor(gather.iterator + 2 * b, cute.make_layout(1))
    if expert >= 0:
        _gather(shape, chosen, expert, gather)
        n = count[0]
        if cutlass.const_expr(shape.quantized):
            _routed_quant(shape, ptrs, layer, slot, expert, rows, n, lo, hi, rstd,
                          x_stage, x_scales)  # fmt: skip
        else:
            _routed_bf16(shape, ptrs, layer, slot, expert, rows, n, lo, hi, rstd,
                         x_stage)  # fmt: skip
    if cutlass.const_expr(shape.fp8):
        # (Every tile of a slot arrives, a slot without an expert too.)
        quantize_slot(shape, ptrs, layer, slot, expert, rows, count, lo, hi, scratch)


@cute.jit
def _gather(s: cutlass.Constexpr, chosen: cute.Tensor, expert, gather: cute.Tensor):
    """The requests routed to ``expert``, ascending, into the gather
    (``gather_words``: flags, then the compact list, then its count)."""
    shape: KernelShape = s
    b, k = shape.batch, shape.top_k
    tidx, _, _ = thread_ids()
    flags = cute.make_tensor(gather.iterator, cute.make_layout(b))
    rows = cute.make_tensor(gather.iterator + b, cute.make_layout(b))
    count = cute.make_tensor(gather.iterator + 2 * b, cute.make_layout(1))
    for r in cutlass.range(tidx, b, NUM_THREADS):
        hit = Int32(0)
        for c in cutlass.range_constexpr(k):
            if chosen[r * k + c] == expert:
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


@cute.jit
def _routed_bf16(s: cutlass.Constexpr, ptrs, layer, slot, expert, rows, n, lo, hi,
                 rstd, x_stage):  # fmt: skip
    """A routed tile's bf16 expert: GATE_UP's GEMV over the gathered
    requests ``rows[0 .. n)``."""
    shape: KernelShape = s
    b, h, inter = shape.batch, shape.hidden, shape.expert_intermediate
    base = ptrs[layer, LayerSlot.W13] + Int64(expert) * (2 * inter * h * 2)
    gate = gmem(BFloat16, base, (inter, h))
    up = gmem(BFloat16, base + inter * h * 2, (inter, h))  # bytes
    hmid = ptrs[layer, LayerSlot.HMID]
    norm = gmem(BFloat16, ptrs[layer, LayerSlot.POST_NORM], (h,))
    xact = _xact(shape, ptrs, layer, slot)
    gathered_rstd(shape, hmid, rows, n, rstd)
    group = min(b, BATCH_GROUP)
    if cutlass.const_expr(stages_input(shape)):
        # The gathered requests' normed rows, compact, in x_stage.
        stage_gathered(shape, hmid, norm, rows, 0, n, rstd, x_stage)
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
def _routed_quant(s: cutlass.Constexpr, ptrs, layer, slot, expert, rows, n, lo, hi,
                  rstd, x_stage, x_scales):  # fmt: skip
    """A routed tile's quantized expert (FP8, INT4): GATE_UP's arithmetic
    over the gathered requests, their inputs staged and quantized in
    passes (``gemv_quant.staged_passes``), the rows by ``qgemv``."""
    shape: KernelShape = s
    gate, up, gate_s, up_s = expert_w13(shape, ptrs, layer, expert)
    _quant_up(shape, ptrs, layer, slot, gate, up, gate_s, up_s, rows, n, lo, hi,
              rstd, x_stage, x_scales)  # fmt: skip


@cute.jit
def _quant_up(s: cutlass.Constexpr, ptrs, layer, slot, gate, up, gate_s, up_s, rows,
              n, lo, hi, rstd, x_stage, x_scales):  # fmt: skip
    """Rows [lo, hi) of a quantized expert's gate and up (a routed one on
    its gathered ``rows[0 .. n)``, the shared one on every request: rows
    None) into the slot's xact."""
    shape: KernelShape = s
    h = shape.hidden
    norm = gmem(BFloat16, ptrs[layer, LayerSlot.POST_NORM], (h,))
    xact = _xact(shape, ptrs, layer, slot)

    def body(xg, sg, j):
        def epilogue(row, i, s1, s2):
            _store_gathered(xact, rows, j, n, row, i, s1, s2)

        qgemv(shape, gate, up, xg, sg, gate_s, up_s, lo, hi, epilogue, True)

    staged_passes(shape, ptrs[layer, LayerSlot.HMID], norm, rows, n, rstd, x_stage,
                  x_scales, body)  # fmt: skip


@cute.jit
def _store_gathered(xact: cute.Tensor, rows: cute.Tensor, j0, n, row, i, sg, su):
    """Gathered request ``j0 + i``'s output (if it is one: ``< n``; rows
    None: request ``j0 + i``)."""
    if j0 + i < n:
        r = j0 + i
        if cutlass.const_expr(rows is not None):
            r = rows[j0 + i]
        xact[r, row] = silu_mul(sg, su)


def silu_mul(sg, su):
    """GATE_UP's epilogue: SiLU of the bf16 gate times the bf16 up."""
    g = round_bf16(sg)
    return (g / (Float32(1.0) + cute.math.exp(-g)) * round_bf16(su)).to(BFloat16)
