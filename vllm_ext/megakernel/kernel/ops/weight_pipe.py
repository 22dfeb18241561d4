# SPDX-License-Identifier: Apache-2.0
"""The weight pipeline (experimental, ``KernelShape.weight_pipe``; no
reference: it moves bytes, the GEMVs that read them are checked against
theirs).

A ring of ``slots`` shared-memory pages, each filled by one or two bulk
copies (``cp.async.bulk``, the copy engine; completion counted in bytes on
the page's mbarrier). Weights never depend on activations, so thread 0 keeps
the ring full with the weight rows the CTA's queue will read, in queue
order, running ahead of the compute: before and during each wait for
inputs, and each time the CTA releases a page. Bytes stream through the
waits between phases instead of starting after them. On the H200
(2026-11-30) the waits cost 45% of a 1B batch-1 step, 7-11 us per phase
boundary; a full ring holds 4-6 pages of 32 KiB, 4-6 us of an SM's share
of HBM bandwidth.

With ``l2_ahead``, a second cursor walks the same pages up to
``L2_AHEAD_PAGES`` past the ring's and hints each into L2
(``cp.async.bulk.prefetch.L2``, the same rows the ring's copy will read),
so the CTA's lookahead is the ring plus that much L2: the shared-memory
ring alone holds 4-6 pages, where the cost model's lookahead (ring and a
share of half the L2, which the pipeline's figures assumed) is twice that.

Page ``g`` of the launch (counted over the whole queue) lives in slot
``g % slots``; its ``g // slots``-th use completes the slot's mbarrier phase
of that parity. For the CUDA-core GEMV a page holds whole rows of one
matrix (or the same rows of gate and up): ``page_rows`` of them, a power of
two, so pages divide a head for QKV and split the warps evenly when a row
is long. For the tensor-core GEMV (``mma_gemv``) a page is an MMA's 16 rows
by ``k_chunk`` columns, one copy per row. Producer (``top_up``) and
consumers (``paged_gemv``) derive the same page sequence from the
instructions and ``geometry``; ``tests/megakernel/test_weight_pipe.py``
replays both schedules in Python. The consumers are in ``gemv_paged.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.experimental import primitives as prims

from vllm_ext.megakernel.isa import WORDS, Op
from vllm_ext.megakernel.kernel.ops.common import NUM_WARPS, thread_ids
from vllm_ext.megakernel.kernel.ops.gemv_mma import ROWS as MMA_ROWS
from vllm_ext.megakernel.kernel.ops.gemv_mma import red_floats
from vllm_ext.megakernel.kernel.queue import Queue, fetch
from vllm_ext.megakernel.kernel.shape import (
    PAGE_BYTES,
    GlobalSlot,
    KernelShape,
    LayerSlot,
    page_rows,
)
from vllm_ext.megakernel.kernel.sync import nanosleep, prefetch_l2, trap

PAGE_ELEMS = PAGE_BYTES // 2
POLL_NS = 32  # between tests of a page's mbarrier (as between counter polls)
# One page being read and at least two in flight; at six, 8B shapes leave
# about 30 KiB of the SM's 256 KiB as L1 (activations re-read per row).
MIN_SLOTS = 3
MAX_SLOTS = 6
# The producer's state in shared memory (written by thread 0 only): the
# ring's cursor (the instruction and page it issues next, pages issued), the
# first page of the instruction being executed, and with l2_ahead the L2
# cursor (the same three words for its hints; _walk advances either).
CURSOR, CURSOR_PAGE, ISSUED, BASE, L2_CURSOR, L2_CURSOR_PAGE, L2_HINTED = range(7)
# How far the L2 cursor runs ahead of the ring (l2_ahead): 6 pages of 32 KiB
# on each of 132 SMs hold 25 MiB, half the H200's L2 (the cost model's
# share), beside the KV cache and activations that stream through it.
L2_AHEAD_PAGES = 6


def state_words(shape: KernelShape) -> int:
    """Words of the producer's state (the L2 cursor's only with l2_ahead)."""
    return 8 if shape.l2_ahead else 4


@dataclass(frozen=True)
class Tile:
    """How one opcode's weight tile maps onto pages: ``per_page`` rows by
    ``k_chunk`` columns (of each of gate and up when dual), row block after
    row block, each row block's k chunks in order."""

    k: int  # row width (elements)
    per_page: int  # rows per page (per matrix when dual)
    dual: bool  # gate and up: the same rows of two matrices per page
    unit: int  # matrix rows per unit of the instruction's [lo, hi)
    k_chunk: int  # columns per page: k (whole rows: one copy) or less
    # Units made of two equal blocks of rows (QKV head parts, isa.py) when
    # above 1: how many units a head has. Pages never straddle a block.
    parts: int = 1

    @property
    def k_pages(self) -> int:
        return (self.k + self.k_chunk - 1) // self.k_chunk


def unit_row(t: Tile, idx):
    """The matrix row that row ``idx`` of the instruction's units is (its
    units' rows laid end to end): itself, or for QKV head parts the row of
    the part's block (isa.py)."""
    if t.parts == 1:
        return idx
    n, head_rows = t.unit // 2, t.unit * t.parts
    u, r = idx // t.unit, idx % t.unit
    return (u // t.parts) * head_rows + (r // n) * (head_rows // 2) + (
        u % t.parts) * n + r % n  # fmt: skip


def _row_tile(k: int, dual: bool, unit: int, cap: int | None = None,
              parts: int = 1) -> Tile:  # fmt: skip
    rows = page_rows(k, dual)
    return Tile(k, rows if cap is None else min(rows, cap), dual, unit, k, parts)


def _mma_tile(k: int, dual: bool, unit: int, parts: int = 1) -> Tile:
    """The tensor-core GEMV's pages: an MMA's 16 rows by as many columns as
    fit (1024, or 512 each of gate and up), one bulk copy per row."""
    k_chunk = PAGE_ELEMS // (MMA_ROWS * (2 if dual else 1))
    return Tile(k, MMA_ROWS, dual, unit, min(k_chunk, k), parts)


def geometry(s: KernelShape) -> dict[Op, Tile]:
    """The pages of every opcode that reads weights. QKV's args count heads
    (or head parts) and its consumer reads a head (or a part's block) at a
    time, so its pages divide a head (or a block)."""
    d, parts = s.head_dim, s.qkv_parts
    unit = d // parts
    if s.mma_gemv:
        return {
            Op.QKV: _mma_tile(s.hidden, False, unit, parts),
            Op.O_PROJ: _mma_tile(s.q_size, False, 1),
            Op.GATE_UP: _mma_tile(s.hidden, True, 1),
            Op.DOWN: _mma_tile(s.intermediate, False, 1),
            Op.LM_HEAD: _mma_tile(s.hidden, False, 1),
        }
    return {
        Op.QKV: _row_tile(
            s.hidden, False, unit, cap=unit // 2 if parts > 1 else d, parts=parts
        ),  # fmt: skip
        Op.O_PROJ: _row_tile(s.q_size, False, 1),
        Op.GATE_UP: _row_tile(s.hidden, True, 1),
        Op.DOWN: _row_tile(s.intermediate, False, 1),
        Op.LM_HEAD: _row_tile(s.hidden, False, 1),
    }


def head_pages(s: KernelShape) -> int:
    """Pages of one QKV unit, a head or a head part (its pages never
    straddle two units, nor a part's two blocks)."""
    t = geometry(s)[Op.QKV]
    return tile_pages(t.unit, t.per_page) * t.k_pages


def warps_per_row(rows: int) -> int:
    """Warps that share one row of a page (each takes a slice of k)."""
    return max(1, NUM_WARPS // rows)


def pipe_slots(free_bytes: int) -> int:
    """Ring slots that fit ``free_bytes`` of shared memory (0: too few)."""
    slots = min(MAX_SLOTS, free_bytes // PAGE_BYTES)
    return slots if slots >= MIN_SLOTS else 0


def red_elems(shape: KernelShape) -> int:
    """fp32 scratch where warps' partial sums meet: the tensor-core GEMV's,
    or [2 page parities, warps, 2 matrices, batch] for split rows."""
    if shape.mma_gemv:
        return red_floats(shape.batch)
    return 2 * NUM_WARPS * 2 * shape.batch


def pipe_bytes(slots: int, shape: KernelShape) -> list[int]:
    """The pipeline's shared buffers: pages, mbarriers, state, scratch."""
    return [slots * PAGE_BYTES, 8 * slots, 4 * state_words(shape),
            4 * red_elems(shape)]  # fmt: skip


def tile_pages(rows: int, per_page: int) -> int:
    return (rows + per_page - 1) // per_page


@dataclass(frozen=True)
class Pipe:
    """What the pipeline's producer and consumers share: its shared
    buffers and the kernel arguments that locate the queue and weights. A
    trace-time bundle, passed to the ops as a compile-time argument (frozen:
    the DSL then treats it as read-only inside runtime loops)."""

    shape: KernelShape
    slots: int
    pages: cute.Tensor  # [slots, PAGE_ELEMS] bf16
    mbar: cute.Tensor  # [slots] int64
    state: cute.Tensor  # [state_words] int32: CURSOR, ..., L2_HINTED
    red: cute.Tensor  # [red_elems(shape)] fp32
    q: Queue  # the CTA's instructions
    length: object
    ptrs: cute.Tensor
    glob: object
    max_spins: object

    @classmethod
    def allocate(cls, shape: KernelShape, slots: int, smem, **kernel_args) -> Pipe:
        return cls(
            shape,
            slots,
            smem.allocate_tensor(
                BFloat16,
                cute.make_layout((slots, PAGE_ELEMS), stride=(PAGE_ELEMS, 1)),
                128,
            ),
            smem.allocate_tensor(Int64, cute.make_layout(slots), 8),
            smem.allocate_tensor(Int32, cute.make_layout(state_words(shape)), 16),
            smem.allocate_tensor(Float32, cute.make_layout(red_elems(shape)), 16),
            **kernel_args,
        )

    def page(self, slot, rows: int, k: int, second: bool = False) -> cute.Tensor:
        """Slot ``slot`` as a [rows, k] matrix; ``second``: the up half
        (``rows`` and ``k``: the tile's ``per_page`` and ``k_chunk``)."""
        offset = slot * PAGE_ELEMS + (rows * k if second else 0)
        return cute.make_tensor(
            self.pages.iterator + offset, cute.make_layout((rows, k), stride=(k, 1))
        )


@cute.jit
def pipe_init(p: cutlass.Constexpr):
    """Thread 0: the mbarriers (one arrival: the producer's, plus the
    bytes) and an empty cursor; the caller's CTA barrier publishes them."""
    for i in cutlass.range_constexpr(p.slots):
        cute.arch.mbarrier_init(p.mbar.iterator + i, 1)
    cute.arch.mbarrier_init_fence()
    for i in cutlass.range_constexpr(state_words(p.shape)):
        p.state[i] = Int32(0)


@cute.jit
def instr_pages(s: cutlass.Constexpr, op, lo, hi) -> Int32:
    """Pages of weights instruction (op, lo, hi) reads (0: none)."""
    geo = geometry(s)
    n = Int32(0)
    if op == Op.QKV:
        n = _pages(geo[Op.QKV], lo, hi)
    elif op == Op.O_PROJ:
        n = _pages(geo[Op.O_PROJ], lo, hi)
    elif op == Op.GATE_UP:
        n = _pages(geo[Op.GATE_UP], lo, hi)
    elif op == Op.DOWN:
        n = _pages(geo[Op.DOWN], lo, hi)
    elif op == Op.LM_HEAD:
        n = _pages(geo[Op.LM_HEAD], lo, hi)
    return n


def _pages(t: Tile, lo, hi):
    return tile_pages((hi - lo) * t.unit, t.per_page) * t.k_pages


@cute.jit
def _copy(p: cutlass.Constexpr, slot, offset, src: Int64, nbytes):
    """One bulk copy of ``nbytes`` from ``src`` to element ``offset`` of
    slot ``slot``, counted on the slot's mbarrier."""
    dst = p.pages.iterator + slot * PAGE_ELEMS + offset
    gptr = cute.make_ptr(BFloat16, src, cute.AddressSpace.gmem, assumed_align=16)
    prims.cp_async_bulk_shared_cluster_global(dst, gptr, p.mbar.iterator + slot,
                                              nbytes)  # fmt: skip


@cute.jit
def _issue_rows(p: cutlass.Constexpr, slot, t: cutlass.Constexpr, base: Int64, lo,
                hi, kp, second: Int64, hint: cutlass.Constexpr):  # fmt: skip
    """Page ``kp`` of units [lo, hi) of the matrix at ``base`` (and of the
    one at ``second``, when dual) into ``slot``: one copy when pages hold
    whole rows, else one per row (and matrix). ``hint``: the same rows
    prefetched into L2 instead (no slot, nothing to wait for)."""
    tile: Tile = t
    row_bytes = 2 * tile.k
    if cutlass.const_expr(tile.k_chunk == tile.k):
        first = lo * tile.unit + kp * tile.per_page
        rows = cutlass.min(Int32(tile.per_page), hi * tile.unit - first)
        nbytes = rows * row_bytes
        row = unit_row(tile, first)
        if cutlass.const_expr(hint):
            prefetch_l2(base + Int64(row) * row_bytes, nbytes)
            if cutlass.const_expr(tile.dual):
                prefetch_l2(second + Int64(row) * row_bytes, nbytes)
        else:
            total = nbytes * 2 if tile.dual else nbytes
            cute.arch.mbarrier_arrive_and_expect_tx(p.mbar.iterator + slot, total)
            _copy(p, slot, 0, base + Int64(row) * row_bytes, nbytes)
            if cutlass.const_expr(tile.dual):
                _copy(p, slot, tile.per_page * tile.k,
                      second + Int64(row) * row_bytes, nbytes)  # fmt: skip
    else:
        block, kc = kp // tile.k_pages, kp % tile.k_pages
        first = lo * tile.unit + block * tile.per_page
        rows = cutlass.min(Int32(tile.per_page), hi * tile.unit - first)
        k0 = kc * tile.k_chunk
        nbytes = cutlass.min(Int32(tile.k_chunk), tile.k - k0) * 2
        if cutlass.const_expr(not hint):
            total = rows * nbytes * (2 if tile.dual else 1)
            cute.arch.mbarrier_arrive_and_expect_tx(p.mbar.iterator + slot, total)
        row = unit_row(tile, first)
        for r in cutlass.range(rows):
            src = Int64(row + r) * row_bytes + Int64(k0) * 2
            if cutlass.const_expr(hint):
                prefetch_l2(base + src, nbytes)
                if cutlass.const_expr(tile.dual):
                    prefetch_l2(second + src, nbytes)
            else:
                _copy(p, slot, r * tile.k_chunk, base + src, nbytes)
                if cutlass.const_expr(tile.dual):
                    _copy(p, slot, (tile.per_page + r) * tile.k_chunk, second + src,
                          nbytes)  # fmt: skip


@cute.jit
def _issue(p: cutlass.Constexpr, op, layer, lo, hi, kp, slot,
           hint: cutlass.Constexpr = False):  # fmt: skip
    """Page ``kp`` of instruction (op, layer, lo, hi) into ``slot`` (or,
    ``hint``, into L2)."""
    shape: KernelShape = p.shape
    geo = geometry(shape)
    ptrs, none = p.ptrs, Int64(0)
    if op == Op.QKV:
        _issue_rows(p, slot, geo[Op.QKV], ptrs[layer, LayerSlot.QKV], lo, hi, kp,
                    none, hint)  # fmt: skip
    elif op == Op.O_PROJ:
        _issue_rows(p, slot, geo[Op.O_PROJ], ptrs[layer, LayerSlot.O_PROJ], lo, hi,
                    kp, none, hint)  # fmt: skip
    elif op == Op.GATE_UP:
        gate = ptrs[layer, LayerSlot.GATE_UP]
        up = gate + Int64(shape.intermediate * shape.hidden * 2)
        _issue_rows(p, slot, geo[Op.GATE_UP], gate, lo, hi, kp, up, hint)
    elif op == Op.DOWN:
        _issue_rows(p, slot, geo[Op.DOWN], ptrs[layer, LayerSlot.DOWN], lo, hi, kp,
                    none, hint)  # fmt: skip
    elif op == Op.LM_HEAD:
        _issue_rows(p, slot, geo[Op.LM_HEAD], ptrs[p.glob, GlobalSlot.LM_HEAD], lo,
                    hi, kp, none, hint)  # fmt: skip


@cute.jit
def top_up(p: cutlass.Constexpr, released):
    """Thread 0: issue pages in queue order until ``slots`` pages past the
    ``released`` ones are in flight or the queue ends; with ``l2_ahead``,
    then hint the ``L2_AHEAD_PAGES`` after those into L2. Never blocks."""
    ins = cute.make_rmem_tensor((WORDS,), Int32)
    # Generic-proxy reads of a released slot come before the async-proxy
    # writes that refill it.
    cute.arch.fence_proxy("async.shared", space="cta")
    _walk(p, CURSOR, released, p.slots, ins, False)
    if cutlass.const_expr(p.shape.l2_ahead):
        # (Written through an alias: a store through p inside the dynamic if
        # would read as rebinding p, a trace-time object.)
        state = p.state
        issued = state[ISSUED]
        if state[L2_HINTED] < issued:
            # Behind the ring, which copies those pages itself: go on from
            # its next page.
            for i in cutlass.range_constexpr(3):
                state[L2_CURSOR + i] = state[CURSOR + i]
        _walk(p, L2_CURSOR, issued, L2_AHEAD_PAGES, ins, True)


@cute.jit
def _walk(p: cutlass.Constexpr, cursor: cutlass.Constexpr, base, limit,
          ins: cute.Tensor, hint: cutlass.Constexpr):  # fmt: skip
    """Advance the cursor in state words ``cursor`` .. ``cursor + 2``
    (instruction, page, pages issued) through the queue's pages, issuing
    each (a copy into its slot, or with ``hint`` into L2), until ``limit``
    pages past ``base`` are issued or the queue ends."""
    ipc, kp = p.state[cursor], p.state[cursor + 1]
    issued = p.state[cursor + 2]
    while (ipc < p.length) & (issued - base < limit):
        fetch(p.q, ipc, ins)
        if kp < instr_pages(p.shape, ins[0], ins[2], ins[3]):
            _issue(p, ins[0], ins[1], ins[2], ins[3], kp, issued % p.slots, hint)
            issued = issued + 1
            kp = kp + 1
        else:
            ipc = ipc + 1
            kp = Int32(0)
    p.state[cursor] = ipc
    p.state[cursor + 1] = kp
    p.state[cursor + 2] = issued


@cute.jit
def wait_page(p: cutlass.Constexpr, g):
    """Every thread: wait until page ``g`` has landed. Bounded like the
    counter waits: non-blocking tests ``POLL_NS`` apart (``try_wait`` may
    suspend for a system-dependent time, which would leave the bound
    unknown); past ``max_spins`` it prints the SM and page, then traps."""
    slot = g % p.slots
    phase = (g // p.slots) % 2
    spins = Int32(0)
    while not cute.arch.mbarrier_test_wait(p.mbar.iterator + slot, phase):
        spins = spins + 1
        if spins > p.max_spins:
            tidx, _, _ = thread_ids()
            if tidx == 0:
                cute.printf("megakernel: weight page timeout: sm %d page %d\n",
                            p.q.sm, g)  # fmt: skip
            trap()
        nanosleep(Int32(POLL_NS))
