# SPDX-License-Identifier: Apache-2.0
"""The weight pipeline: a ring of shared-memory pages that the producer
warp keeps filled with the queue's weight rows (no reference: it moves
bytes; the GEMVs that read them are checked against theirs).

A ring of ``slots`` pages, each filled by one or more bulk copies
(``cp.async.bulk``, the copy engine; completion counted in bytes on the
page's ``pages_full`` mbarrier). Weights never depend on activations, so the
producer (``produce``, one lane of the producer warp) walks the CTA's whole
queue from its start, in queue order across instructions and layers, and
never waits on a dependency counter: it waits only for a slot to be free.
Each consumer thread arrives on the slot's ``pages_empty`` mbarrier once its
warp has read the page (``release_page``; count ``EMPTY_ARRIVALS``, so no
consumer barrier is needed per page: a warp done with a page moves on); the
producer refills a slot only once that phase has completed. Every thread
arrives, not one lane a warp: an arrive releases only its own thread's
reads (PTX memory model), and racecheck flagged the refill against lane 1's
reads when lane 0 arrived for its warp after ``__syncwarp`` (H200,
2026-12-04). While a slot is
not yet free, the producer hints the next ``L2_AHEAD_PAGES`` pages past the
ring into L2 (``cp.async.bulk.prefetch.L2``, the same rows its copies will
read), so the lookahead is the ring plus that much L2.

Page ``g`` of the launch (counted over the whole queue) lives in slot
``g % slots``; its ``g // slots``-th use completes ``pages_full``'s phase
of parity ``(g // slots) % 2``, and its release completes ``pages_empty``'s
phase of the same parity, which the refill of page ``g + slots`` waits for.
For the CUDA-core GEMV a page holds whole rows of one matrix (or the same
rows of gate and up): ``page_rows`` of them, a power of two, so pages
divide a head for QKV and split the warps evenly when a row is long; an
opcode whose row does not fit a page reads global memory (it has no pages).
For the tensor-core GEMV (``mma_gemv``, every batch above 1; a quantized
kernel's QKV, O_PROJ, GATE_UP and DOWN at every batch) a page is a row
group of 64 rows (32 of each of gate and up; QKV: at most a head part's
block) by a 512-byte k chunk (256 bf16 weights, 512 e4m3 codes; INT4: 128
rows by 512 codes), the group's k chunks in order, one copy per row and
matrix (``gemv_mma.py`` says why; ``Tile.bytes_of`` converts). Producer and consumers
(``gemv_paged.py``) derive the same page sequence from the instructions and
``geometry``; ``tests/megakernel/test_weight_pipe.py`` replays both
schedules in Python over the real programs.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8
from cutlass.experimental import primitives as prims

from vllm_ext.megakernel.isa import WORDS, Op
from vllm_ext.megakernel.kernel.ops.common import NUM_THREADS, NUM_WARPS
from vllm_ext.megakernel.kernel.ops.gemv_mma import (
    fp8_scale_floats,
    group_rows,
    k_chunk,
    page_index,
    scratch_floats,
)
from vllm_ext.megakernel.kernel.queue import Queue, fetch
from vllm_ext.megakernel.kernel.shape import (
    PAGE_BYTES,
    GlobalSlot,
    KernelShape,
    LayerSlot,
    page_rows,
)
from vllm_ext.megakernel.kernel.sync import prefetch_l2, wait_mbarrier

PAGE_ELEMS = PAGE_BYTES // 2
# One page being read and at least two in flight; at six, 8B shapes leave
# about 30 KiB of the SM's 256 KiB as L1 (activations re-read per row).
MIN_SLOTS = 3
MAX_SLOTS = 6
# The producer's L2 cursor in shared memory (written by the producer lane
# only): the instruction and page it hints next, and pages hinted.
L2_CURSOR, L2_CURSOR_PAGE, L2_HINTED = range(3)
STATE_WORDS = 4
# How far the L2 cursor runs past the ring: 6 pages of 32 KiB on each of 132
# SMs hold 25 MiB, half the H200's L2 (the cost model's share), beside the
# KV cache and activations that stream through it.
L2_AHEAD_PAGES = 6
# A slot's release: one arrival per consumer thread (``release_page``).
EMPTY_ARRIVALS = NUM_THREADS
# The opcodes whose weights a quantized kernel reads as codes (FP8, INT4).
QUANT_OPS = (Op.QKV, Op.O_PROJ, Op.GATE_UP, Op.DOWN)


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
    mma: bool = False  # the tensor-core GEMV's pages (k chunks), else rows
    fp8: bool = False  # e4m3 codes, a byte each (else bf16)
    int4: bool = False  # 4-bit codes, two a byte

    def bytes_of(self, elems):
        """Bytes of ``elems`` weights (bf16, e4m3 or 4-bit; even counts)."""
        if self.int4:
            return elems // 2
        return elems if self.fp8 else elems * 2

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


def _mma_tile(k: int, dual: bool, unit: int, cap: int | None = None,
              parts: int = 1, fp8: bool = False,
              int4: bool = False) -> Tile:  # fmt: skip
    """The tensor-core GEMV's pages: a row group of 64 rows (32 of each of
    gate and up; at most ``cap``) by a 512-byte k chunk (256 bf16 weights,
    512 e4m3 codes), or for INT4 128 rows (64 each) by 512 codes."""
    rows = group_rows(dual, int4)
    chunk = k_chunk(fp8, int4)
    return Tile(k, rows if cap is None else min(rows, cap), dual, unit,
                min(chunk, k), parts, True, fp8, int4)  # fmt: skip


def geometry(s: KernelShape) -> dict[Op, Tile]:
    """The pages of every opcode that reads its weights through the ring
    (the paged GEMVs' opcodes whose rows fit a page). QKV's args count heads
    (or head parts) and its consumer reads a head (or a part's block) at a
    time, so its pages divide a head (or a block)."""
    d, parts = s.head_dim, s.qkv_parts
    unit = d // parts
    rows = {
        Op.QKV: (s.hidden, False, unit, unit // 2 if parts > 1 else d, parts),
        Op.O_PROJ: (s.q_size, False, 1, None, 1),
        Op.GATE_UP: (s.hidden, True, 1, None, 1),
        Op.DOWN: (s.intermediate, False, 1, None, 1),
        Op.LM_HEAD: (s.hidden, False, 1, None, 1),
    }
    if s.mma_gemv:  # k chunks: every row fits
        geo = {op: _mma_tile(*t) for op, t in rows.items()}
    else:
        # A row (pair) wider than a page: that opcode reads global memory.
        geo = {op: _row_tile(*t) for op, t in rows.items() if fits_page(t[0], t[1])}
    if s.dense_quantized:  # tensor cores at every batch; the LM head bf16
        for op in QUANT_OPS:
            geo[op] = _mma_tile(*rows[op], fp8=s.fp8, int4=bool(s.int4_group))
    return geo


def fits_page(k: int, dual: bool) -> bool:
    return 2 * k * (2 if dual else 1) <= PAGE_BYTES


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
    """fp32 scratch where warps' partial sums meet: the tensor-core GEMV's
    (its staged activations too), or [2 page parities, warps, 2 matrices,
    batch] for split rows; an FP8 kernel's inputs' scales after it
    (``gemv_mma.fp8_scale_floats``)."""
    scratch = 2 * NUM_WARPS * 2 * shape.batch
    if shape.mma_gemv or shape.dense_quantized:
        int4 = shape.dense_quantized and shape.int4_group > 0
        scratch = max(scratch, scratch_floats(shape.batch, int4))
    fp8 = fp8_scale_floats(shape.batch, shape.fp8_groups) if shape.fp8 else 0
    return scratch + fp8


def pipe_bytes(slots: int, shape: KernelShape) -> list[int]:
    """The pipeline's shared buffers: pages, full and empty mbarriers, the
    producer's L2 cursor, scratch."""
    return [slots * PAGE_BYTES, 8 * slots, 8 * slots, 4 * STATE_WORDS,
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
    full: cute.Tensor  # [slots] int64: pages_full, the bytes have landed
    empty: cute.Tensor  # [slots] int64: pages_empty, every warp has read it
    state: cute.Tensor  # [STATE_WORDS] int32: the producer's L2 cursor
    red: cute.Tensor  # [red_elems(shape)] fp32
    q: Queue  # the CTA's instructions
    length: object
    ptrs: cute.Tensor
    glob: object
    max_spins: object
    # The consumers' first page of the instruction they execute (a register,
    # set per instruction with ``dataclasses.replace``).
    base: object = None

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
            smem.allocate_tensor(Int64, cute.make_layout(slots), 8),
            smem.allocate_tensor(Int32, cute.make_layout(STATE_WORDS), 16),
            smem.allocate_tensor(Float32, cute.make_layout(red_elems(shape)), 128),
            **kernel_args,
        )

    def page(self, slot, rows: int, k: int, second: bool = False,
             fp8: bool = False, int4: bool = False) -> cute.Tensor:  # fmt: skip
        """Slot ``slot`` as a [rows, k] matrix, bf16 or (``fp8``) e4m3 codes
        as bytes, or (``int4``) [rows, k / 2] bytes of two codes each;
        ``second``: the up half (``rows`` and ``k``: the tile's
        ``per_page`` and ``k_chunk``)."""
        at = page_index(int(second), 0, 0, rows, k)  # in the matrix's elements
        if int4:
            at, k = at // 4, k // 2  # (bf16 elements; a row's bytes)
        elif fp8:
            at = at // 2
        base = self.pages.iterator + slot * PAGE_ELEMS + at
        if fp8 or int4:
            base = cute.recast_ptr(base, dtype=Uint8)
        return cute.make_tensor(base, cute.make_layout((rows, k), stride=(k, 1)))


@cute.jit
def pipe_init(p: cutlass.Constexpr):
    """Thread 0: the mbarriers (full: one arrival, the producer's, plus the
    bytes; empty: one arrival per consumer thread) and an empty cursor; the
    caller's CTA barrier publishes them."""
    for i in cutlass.range_constexpr(p.slots):
        cute.arch.mbarrier_init(p.full.iterator + i, 1)
        cute.arch.mbarrier_init(p.empty.iterator + i, EMPTY_ARRIVALS)
    cute.arch.mbarrier_init_fence()
    for i in cutlass.range_constexpr(STATE_WORDS):
        p.state[i] = Int32(0)


@cute.jit
def instr_pages(s: cutlass.Constexpr, op, lo, hi) -> Int32:
    """Pages of weights instruction (op, lo, hi) reads (0: none, and for an
    opcode without pages: ``geometry``)."""
    geo = geometry(s)
    n = Int32(0)
    if op == Op.QKV:
        if cutlass.const_expr(Op.QKV in geo):
            n = _pages(geo[Op.QKV], lo, hi)
    elif op == Op.O_PROJ:
        if cutlass.const_expr(Op.O_PROJ in geo):
            n = _pages(geo[Op.O_PROJ], lo, hi)
    elif op == Op.GATE_UP:
        if cutlass.const_expr(Op.GATE_UP in geo):
            n = _pages(geo[Op.GATE_UP], lo, hi)
    elif op == Op.DOWN:
        if cutlass.const_expr(Op.DOWN in geo):
            n = _pages(geo[Op.DOWN], lo, hi)
    elif op == Op.LM_HEAD:
        if cutlass.const_expr(Op.LM_HEAD in geo):
            n = _pages(geo[Op.LM_HEAD], lo, hi)
    return n


def _pages(t: Tile, lo, hi):
    return tile_pages((hi - lo) * t.unit, t.per_page) * t.k_pages


@cute.jit
def _copy(p: cutlass.Constexpr, slot, offset, src: Int64, nbytes):
    """One bulk copy of ``nbytes`` from ``src`` to byte ``offset`` of slot
    ``slot``, counted on the slot's mbarrier."""
    dst = p.pages.iterator + slot * PAGE_ELEMS + offset // 2
    gptr = cute.make_ptr(BFloat16, src, cute.AddressSpace.gmem, assumed_align=16)
    prims.cp_async_bulk_shared_cluster_global(dst, gptr, p.full.iterator + slot,
                                              nbytes)  # fmt: skip


@cute.jit
def _issue_rows(p: cutlass.Constexpr, slot, t: cutlass.Constexpr, base: Int64, lo,
                hi, kp, second: Int64, hint: cutlass.Constexpr):  # fmt: skip
    """Page ``kp`` of units [lo, hi) of the matrix at ``base`` (and of the
    one at ``second``, when dual) into ``slot``: one copy when pages hold
    whole rows, else one per row (and matrix). ``hint``: the same rows
    prefetched into L2 instead (no slot, nothing to wait for)."""
    tile: Tile = t
    row_bytes = tile.bytes_of(tile.k)
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
            cute.arch.mbarrier_arrive_and_expect_tx(p.full.iterator + slot, total)
            _copy(p, slot, 0, base + Int64(row) * row_bytes, nbytes)
            if cutlass.const_expr(tile.dual):
                at = tile.bytes_of(page_index(1, 0, 0, tile.per_page, tile.k))
                _copy(p, slot, at, second + Int64(row) * row_bytes,
                      nbytes)  # fmt: skip
    else:
        block, kc = kp // tile.k_pages, kp % tile.k_pages
        first = lo * tile.unit + block * tile.per_page
        rows = cutlass.min(Int32(tile.per_page), hi * tile.unit - first)
        k0 = kc * tile.k_chunk
        nbytes = tile.bytes_of(cutlass.min(Int32(tile.k_chunk), tile.k - k0))
        if cutlass.const_expr(not hint):
            total = rows * nbytes * (2 if tile.dual else 1)
            cute.arch.mbarrier_arrive_and_expect_tx(p.full.iterator + slot, total)
        row = unit_row(tile, first)
        for r in cutlass.range(rows):
            src = Int64(row + r) * row_bytes + Int64(tile.bytes_of(k0))
            if cutlass.const_expr(hint):
                prefetch_l2(base + src, nbytes)
                if cutlass.const_expr(tile.dual):
                    prefetch_l2(second + src, nbytes)
            else:
                _copy(p, slot,
                      tile.bytes_of(page_index(0, r, 0, tile.per_page, tile.k_chunk)),
                      base + src, nbytes)  # fmt: skip
                if cutlass.const_expr(tile.dual):
                    _copy(p, slot,
                          tile.bytes_of(page_index(1, r, 0, tile.per_page,
                                                   tile.k_chunk)),
                          second + src, nbytes)  # fmt: skip


@cute.jit
def _issue(p: cutlass.Constexpr, op, layer, lo, hi, kp, slot,
           hint: cutlass.Constexpr = False):  # fmt: skip
    """Page ``kp`` of instruction (op, layer, lo, hi) into ``slot`` (or,
    ``hint``, into L2)."""
    shape: KernelShape = p.shape
    geo = geometry(shape)
    ptrs, none = p.ptrs, Int64(0)
    # (instr_pages is 0 for an opcode without pages: never issued.)
    if op == Op.QKV:
        if cutlass.const_expr(Op.QKV in geo):
            _issue_rows(p, slot, geo[Op.QKV], ptrs[layer, LayerSlot.QKV], lo, hi,
                        kp, none, hint)  # fmt: skip
    elif op == Op.O_PROJ:
        if cutlass.const_expr(Op.O_PROJ in geo):
            _issue_rows(p, slot, geo[Op.O_PROJ], ptrs[layer, LayerSlot.O_PROJ], lo,
                        hi, kp, none, hint)  # fmt: skip
    elif op == Op.GATE_UP:
        if cutlass.const_expr(Op.GATE_UP in geo):
            gate = ptrs[layer, LayerSlot.GATE_UP]
            up = gate + Int64(
                geo[Op.GATE_UP].bytes_of(shape.intermediate * shape.hidden)
            )
            _issue_rows(p, slot, geo[Op.GATE_UP], gate, lo, hi, kp, up, hint)
    elif op == Op.DOWN:
        if cutlass.const_expr(Op.DOWN in geo):
            _issue_rows(p, slot, geo[Op.DOWN], ptrs[layer, LayerSlot.DOWN], lo, hi,
                        kp, none, hint)  # fmt: skip
    elif op == Op.LM_HEAD:
        if cutlass.const_expr(Op.LM_HEAD in geo):
            _issue_rows(p, slot, geo[Op.LM_HEAD], ptrs[p.glob, GlobalSlot.LM_HEAD],
                        lo, hi, kp, none, hint)  # fmt: skip


@cute.jit
def produce(p: cutlass.Constexpr):
    """The producer (one lane): every page of the queue, in queue order,
    into slot ``g % slots`` once the consumers released its previous page;
    while a slot is still busy, the pages past the ring are hinted into L2
    first. Returns when the queue's last page is issued."""
    ins = cute.make_rmem_tensor((WORDS,), Int32)
    hint_ins = cute.make_rmem_tensor((WORDS,), Int32)
    base = Int32(0)  # the instruction's first page
    for pc in cutlass.range(p.length):
        fetch(p.q, pc, ins)
        n = instr_pages(p.shape, ins[0], ins[2], ins[3])
        for kp in cutlass.range(n):
            # (Derived from the loop index, not carried through the waits:
            # ptxas keeps it in a register.)
            g = base + kp
            slot = g % p.slots
            if g >= p.slots:
                # Page g - slots's release: the phase of its parity.
                parity = (g // p.slots + 1) % 2
                if not cute.arch.mbarrier_test_wait(p.empty.iterator + slot, parity):
                    _hint_ahead(p, pc, kp, g, hint_ins)
                    wait_mbarrier(p.empty.iterator + slot, parity, p.max_spins,
                                  True, "WEIGHT_SLOT", p.q.sm, g, p.ptrs,
                                  p.glob, p.shape.batch)  # fmt: skip
            # The consumers' generic-proxy reads of the slot (ordered before
            # this thread by the empty barrier) come before the async-proxy
            # writes that refill it.
            cute.arch.fence_proxy("async.shared", space="cta")
            _issue(p, ins[0], ins[1], ins[2], ins[3], kp, slot)
        base = base + n


@cute.jit
def _hint_ahead(p: cutlass.Constexpr, pc, kp, g, ins: cute.Tensor):
    """Hint pages [g, g + L2_AHEAD_PAGES) into L2 (g: the first page past
    the ring), each once: the L2 cursor resumes where it stopped, or jumps
    to page ``g`` (instruction ``pc``, its page ``kp``) when behind."""
    state = p.state
    if state[L2_HINTED] < g:
        state[L2_CURSOR] = pc
        state[L2_CURSOR_PAGE] = kp
        state[L2_HINTED] = g
    _walk(p, L2_CURSOR, g, L2_AHEAD_PAGES, ins, True)


@cute.jit
def _walk(p: cutlass.Constexpr, cursor: cutlass.Constexpr, base, limit,
          ins: cute.Tensor, hint: cutlass.Constexpr):  # fmt: skip
    """Advance the cursor in state words ``cursor`` .. ``cursor + 2``
    (instruction, page, pages issued) through the queue's pages, issuing
    each (a copy into its slot, or with ``hint`` into L2), until ``limit``
    pages past ``base`` are issued or the queue ends."""
    ipc, kp = p.state[cursor], p.state[cursor + 1]
    issued = p.state[cursor + 2]
    end = base + limit
    while (ipc < p.length) & (issued < end):
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
    """Every consumer thread: wait until page ``g`` has landed (bounded,
    ``sync.wait_mbarrier``)."""
    tidx, _, _ = cute.arch.thread_idx()
    wait_mbarrier(p.full.iterator + g % p.slots, (g // p.slots) % 2, p.max_spins,
                  tidx == 0, "WEIGHT_PAGE", p.q.sm, g, p.ptrs, p.glob,
                  p.shape.batch)  # fmt: skip


@cute.jit
def release_page(p: cutlass.Constexpr, g):
    """Every consumer thread, once it is done reading page ``g``: an arrive
    on the slot's empty barrier (release semantics at CTA scope for this
    thread's reads; the producer's wait acquires them all)."""
    cute.arch.mbarrier_arrive(p.empty.iterator + g % p.slots)


@cute.jit
def reads_pages(w_stage, op: Op) -> bool:
    """Whether opcode ``op`` reads its weights from the ring (trace time):
    the kernel has one (``w_stage`` is the ``Pipe``, not the legacy
    control's scratch) and the opcode's rows fit a page."""
    return isinstance(w_stage, Pipe) and op in geometry(w_stage.shape)
