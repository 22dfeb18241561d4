# SPDX-License-Identifier: Apache-2.0
"""The weight pipeline's page schedule (kernel/ops/weight_pipe.py and its
readers in gemv_paged.py), replayed in Python for real programs: the kernel
cannot run on this machine, so the schedule it follows is checked here the
way it is written there.

- The producer's pages (``instr_pages``, ``_issue_rows``) and the
  consumers' (``paged_gemv`` as QKV calls it per head and the projections
  per tile) are the same sequence, and cover the weight rows each
  instruction reads (as ``isa.py`` defines them) exactly once.
- Every page fits its slot and obeys the bulk-copy rules (16-byte sizes
  and addresses).
- A ring of ``ring_slots`` pages, topped up where the kernel tops it up,
  never has a consumer wait on a page not yet issued, never refills a slot
  before its page is released, and waits on each page with the mbarrier
  parity its copy completes.
- With ``l2_ahead``, the L2 cursor hints every page once, in order, before
  the ring copies it (all but the ring's first fill), and never more than
  ``L2_AHEAD_PAGES`` past the ring. (Hints and copies of a page are one
  code path in the kernel, ``_issue_rows``, so they name the same rows.)
"""

import dataclasses

import pytest

from vllm_ext.megakernel.build import spec_or_exit
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.interpret import head_part_dims
from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.kernel.ops.weight_pipe import (
    L2_AHEAD_PAGES,
    PAGE_ELEMS,
    geometry,
    head_pages,
    tile_pages,
    unit_row,
    warps_per_row,
)
from vllm_ext.megakernel.kernel.persistent import SMEM_LIMIT, ring_slots, shared_bytes
from vllm_ext.megakernel.kernel.shape import KernelShape
from vllm_ext.megakernel.planner import plan, qkv_parts_to_fill


def weight_rows(s: KernelShape, op: Op, lo: int, hi: int) -> list[int]:
    """The rows of its weight matrix (each of gate and up) an instruction
    reads, from the ISA's definition of its args (QKV: head parts)."""
    if op == Op.QKV:
        d, parts = s.head_dim, s.qkv_parts
        return sorted(
            (u // parts) * d + dim
            for u in range(lo, hi)
            for dims in head_part_dims(d, parts, u % parts)
            for dim in range(dims.start, dims.stop)
        )
    return list(range(lo, hi))


def producer_pages(s: KernelShape, op: Op, lo: int, hi: int) -> list[tuple]:
    """(first row, rows, first column, columns) of each page, as
    ``_issue_rows`` copies them (``instr_pages`` of them)."""
    t = geometry(s)[op]
    n = tile_pages((hi - lo) * t.unit, t.per_page) * t.k_pages
    out = []
    for kp in range(n):
        block, kc = divmod(kp, t.k_pages)
        first = lo * t.unit + block * t.per_page
        k0 = kc * t.k_chunk
        out.append((unit_row(t, first), min(t.per_page, hi * t.unit - first), k0,
                    min(t.k_chunk, t.k - k0)))  # fmt: skip
    return out


def consumer_pages(s: KernelShape, op: Op, lo: int, hi: int) -> list[tuple]:
    """(page within the instruction, first row, rows, first column,
    columns), as the ops call ``paged_gemv`` (QKV: once per head) and its
    two consumers walk their pages."""
    t = geometry(s)[op]
    calls = [(0, lo, hi)]  # (page0, row0, row_end)
    if op == Op.QKV and s.qkv_parts == 1:
        d = s.head_dim
        calls = [((h - lo) * head_pages(s), h * d, h * d + d) for h in range(lo, hi)]
    elif op == Op.QKV:  # once per block of each head part
        d, parts, hp = s.head_dim, s.qkv_parts, head_pages(s)
        n = d // (2 * parts)
        calls = [((u - lo) * hp + blk * (hp // 2), first, first + n)
                 for u in range(lo, hi) for blk in (0, 1)
                 for first in [(u // parts) * d + blk * (d // 2)
                               + (u % parts) * n]]  # fmt: skip
    out = []
    for page0, row0, row_end in calls:
        if s.mma_gemv:  # _paged_mma: row blocks of 16, their k pages in order
            for rb in range(row0, row_end, t.per_page):
                first_page = page0 + (rb - row0) // t.per_page * t.k_pages
                for kc in range(t.k_pages):
                    k0 = kc * t.k_chunk
                    out.append((first_page + kc, rb, min(t.per_page, row_end - rb),
                                k0, min(t.k_chunk, t.k - k0)))  # fmt: skip
        else:  # _paged_rows: whole rows
            for kk in range(tile_pages(row_end - row0, t.per_page)):
                first = row0 + kk * t.per_page
                out.append((page0 + kk, first, min(t.per_page, row_end - first),
                            0, t.k))  # fmt: skip
    return out


def real_shape(config: str, batch: int, mma: bool = False, split: bool = False):
    spec = spec_or_exit("test", config, "bfloat16", batch)
    parts = qkv_parts_to_fill(spec, DEVICES["h200"].num_sms) if split else 1
    program = plan(spec, batch, DEVICES["h200"], with_lm_head=True, qkv_parts=parts)
    shape = KernelShape.from_program(program, 16, stage_queue=True, weight_pipe=True,
                                     mma_gemv=mma)  # fmt: skip
    assert shape.qkv_parts == (2 if split else 1)
    return program, shape


# (QKV head parts: the Llama shapes, whose heads have no QK-norm.)
CASES = [(c, b, mma, False) for c in ("llama-3.2-1b", "llama-3.1-8b", "qwen3-8b")
         for b in (1, 16, 64) for mma in (False, True)] + [
        (c, b, mma, True) for c in ("llama-3.2-1b", "llama-3.1-8b")
         for b in (1, 16) for mma in (False, True)]  # fmt: skip


# Tiles and pages do not depend on the batch (only the ring's size does).
@pytest.mark.parametrize("config, mma, split",
                         sorted({(c, m, sp) for c, _, m, sp in CASES}))  # fmt: skip
def test_pages_cover_each_instruction_once_and_fit(config, mma, split):
    program, s = real_shape(config, 1, mma, split)
    geo = geometry(s)
    for op, t in geo.items():
        # Pages split a CTA's 8 warps evenly (whole rows) or are one MMA's
        # 16 rows, and QKV's divide a head.
        assert t.per_page & (t.per_page - 1) == 0
        if mma:
            assert t.per_page == 16 and t.k_chunk % 32 == 0
        else:
            assert t.per_page * warps_per_row(t.per_page) in (t.per_page, 8)
            assert t.k_chunk == t.k
        if op == Op.QKV:  # pages divide a part's blocks of rows
            assert s.head_dim // (2 * s.qkv_parts) % t.per_page == 0
        matrices = 2 if t.dual else 1
        assert matrices * t.per_page * t.k_chunk <= PAGE_ELEMS
        assert (t.per_page * t.k_chunk * 2) % 16 == 0  # the up half's offset
        assert (t.k_chunk * 2) % 16 == 0 and (t.k * 2) % 16 == 0  # copy rules
    seen = set()
    for queue in program.queues:
        for ins in queue:
            if ins.op not in geo:
                continue
            key = (ins.op, ins.layer, ins.arg0, ins.arg1)
            assert key not in seen
            seen.add(key)
            made = producer_pages(s, ins.op, ins.arg0, ins.arg1)
            used = consumer_pages(s, ins.op, ins.arg0, ins.arg1)
            assert [u[0] for u in used] == list(range(len(made)))
            assert [u[1:] for u in used] == made
            t = geo[ins.op]
            cells = sorted(
                (r, k0 // t.k_chunk)
                for first, n, k0, cols in made
                for r in range(first, first + n)
            )
            rows = weight_rows(s, ins.op, ins.arg0, ins.arg1)
            assert cells == [(r, c) for r in rows for c in range(t.k_pages)]
            # Each page's rows are contiguous rows of the matrix, all read.
            wanted = set(rows)
            assert all(f in wanted and f + n - 1 in wanted for f, n, _, _ in made)
            assert all(0 < n <= t.per_page and 0 < c <= t.k_chunk
                       for _, n, _, c in made)  # fmt: skip
            assert all(k0 + c <= t.k and (c * 2) % 16 == 0 for _, _, k0, c in made)


class Ring:
    """One SM's producer (thread 0's cursors and the slots' state)."""

    def __init__(self, counts: list[int], slots: int, l2_ahead: bool = False) -> None:
        self.counts, self.slots, self.l2_ahead = counts, slots, l2_ahead
        self.cursor = self.cursor_page = self.issued = 0
        self.slot_page: list = [None] * slots  # the page last copied into it
        self.completed = [0] * slots  # mbarrier phases completed per slot
        self.l2 = [0, 0, 0]  # the L2 cursor: instruction, page, pages hinted
        self.hints: list[int] = []  # pages hinted, in order
        self.hinted: set[int] = set()
        self.copied_unhinted: list[int] = []

    def top_up(self, released: int) -> None:
        while self.cursor < len(self.counts) and self.issued - released < self.slots:
            if self.cursor_page < self.counts[self.cursor]:
                slot = self.issued % self.slots
                # The slot's previous page was released before the refill.
                last = self.slot_page[slot]
                assert last is None or last < released
                assert self.completed[slot] == self.issued // self.slots
                if self.l2_ahead and self.issued not in self.hinted:
                    self.copied_unhinted.append(self.issued)
                self.slot_page[slot] = self.issued
                self.issued += 1
                self.cursor_page += 1
            else:
                self.cursor += 1
                self.cursor_page = 0
        if self.l2_ahead:
            self.hint_ahead()

    def hint_ahead(self) -> None:
        """As ``_hint_ahead``: from the ring's cursor if behind it, up to
        ``L2_AHEAD_PAGES`` pages past the ring's."""
        pc, kp, hinted = self.l2
        if hinted < self.issued:
            pc, kp, hinted = self.cursor, self.cursor_page, self.issued
        while pc < len(self.counts) and hinted - self.issued < L2_AHEAD_PAGES:
            if kp < self.counts[pc]:
                assert not self.hints or hinted > self.hints[-1]
                self.hints.append(hinted)
                self.hinted.add(hinted)
                hinted += 1
                kp += 1
            else:
                pc += 1
                kp = 0
        self.l2 = [pc, kp, hinted]
        assert hinted - self.issued <= L2_AHEAD_PAGES

    def consume(self, g: int) -> None:
        slot = g % self.slots
        assert g < self.issued, "a consumer waits on a page never issued"
        assert self.slot_page[slot] == g, "the slot holds another page"
        # The copy completes the slot's (g // slots)-th phase, the parity
        # the consumer waits with.
        assert self.completed[slot] == g // self.slots
        self.completed[slot] += 1


def replay_ring(program, s: KernelShape, slots: int, refill: bool = True) -> None:
    """Every SM's queue through a ring of ``slots`` pages, topped up where
    the kernel tops it up (``refill``: also after each page's release)."""
    geo = geometry(s)
    for queue in program.queues:
        counts = [
            len(producer_pages(s, i.op, i.arg0, i.arg1)) if i.op in geo else 0
            for i in queue
        ]
        ring, base = Ring(counts, slots, s.l2_ahead), 0
        for n in counts:
            ring.top_up(base)  # before (and while) the instruction waits
            for g in range(base, base + n):
                ring.consume(g)
                if refill:
                    ring.top_up(g + 1)  # thread 0, after the page's CTA barrier
            base += n
        assert ring.issued == base, "pages issued but never read"
        if s.l2_ahead:
            # Every page past the ring's first fill was hinted, once, before
            # its copy.
            assert ring.hints == list(range(min(slots, base), base))
            assert ring.copied_unhinted == list(range(min(slots, base)))


@pytest.mark.parametrize("l2_ahead", [False, True], ids=["ring", "l2_ahead"])
@pytest.mark.parametrize("config, batch, mma, split", CASES)
def test_ring_schedule_never_waits_on_an_unissued_or_reused_page(
    config, batch, mma, split, l2_ahead
):
    program, s = real_shape(config, batch, mma, split)
    s = dataclasses.replace(s, l2_ahead=l2_ahead)
    assert ring_slots(s) >= 3
    replay_ring(program, s, ring_slots(s))


def test_the_replay_catches_a_ring_never_refilled_mid_instruction():
    # Without the refill after each page, a tile longer than the ring
    # (1B's GATE_UP: 16 pages) would wait forever: the replay must say so.
    program, s = real_shape("llama-3.2-1b", 1)
    with pytest.raises(AssertionError, match="never issued"):
        replay_ring(program, s, ring_slots(s), refill=False)


def test_ring_fits_beside_the_rest_of_shared_memory():
    # 1B at batch 16 stages its normed input (64 KiB): fewer slots than at
    # batch 1, still at least three.
    _, small = real_shape("llama-3.2-1b", 1)
    _, staged = real_shape("llama-3.2-1b", 16)
    assert ring_slots(small) > ring_slots(staged) >= 3
    assert shared_bytes(small) <= SMEM_LIMIT and shared_bytes(staged) <= SMEM_LIMIT
    assert not ring_slots(KernelShape(**{**small.as_dict(), "weight_pipe": False}))
