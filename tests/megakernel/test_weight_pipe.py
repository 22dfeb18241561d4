# SPDX-License-Identifier: Apache-2.0
"""The weight pipeline's page schedule (kernel/ops/weight_pipe.py), replayed
in Python for real programs: the kernel cannot run on this machine, so the
schedule it follows is checked here the way it is written there.

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
"""

import pytest

from vllm_ext.megakernel.build import spec_or_exit
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.kernel.ops.weight_pipe import (
    PAGE_ELEMS,
    geometry,
    tile_pages,
    warps_per_row,
)
from vllm_ext.megakernel.kernel.persistent import ring_slots
from vllm_ext.megakernel.kernel.shape import PAGE_BYTES, KernelShape
from vllm_ext.megakernel.planner import plan


def weight_rows(s: KernelShape, op: Op, lo: int, hi: int) -> range:
    """The rows of its weight matrix (each of gate and up) an instruction
    reads, from the ISA's definition of its args."""
    if op == Op.QKV:
        return range(lo * s.head_dim, hi * s.head_dim)
    return range(lo, hi)


def producer_pages(s: KernelShape, op: Op, lo: int, hi: int) -> list[tuple]:
    """(first row, rows) of each page, as ``_issue_rows`` copies them."""
    t = geometry(s)[op]
    n = tile_pages((hi - lo) * t.unit, t.per_page)  # instr_pages
    out = []
    for kp in range(n):
        first = lo * t.unit + kp * t.per_page
        out.append((first, min(t.per_page, hi * t.unit - first)))
    return out


def consumer_pages(s: KernelShape, op: Op, lo: int, hi: int) -> list[tuple]:
    """(page within the instruction, first row, rows), as the ops call
    ``paged_gemv`` and it walks its pages."""
    t = geometry(s)[op]
    calls = [(0, lo, hi)]  # (page0, row0, row_end)
    if op == Op.QKV:
        d = s.head_dim
        per_head = d // t.per_page
        calls = [((h - lo) * per_head, h * d, h * d + d) for h in range(lo, hi)]
    out = []
    for page0, row0, row_end in calls:
        for kk in range(tile_pages(row_end - row0, t.per_page)):
            first = row0 + kk * t.per_page
            out.append((page0 + kk, first, min(t.per_page, row_end - first)))
    return out


def real_shape(config: str, batch: int) -> tuple:
    spec = spec_or_exit("test", config, "bfloat16", batch)
    program = plan(spec, batch, DEVICES["h200"], with_lm_head=True)
    shape = KernelShape.from_program(program, 16, stage_queue=True, weight_pipe=True)
    return program, shape


CASES = [(c, b) for c in ("llama-3.2-1b", "llama-3.1-8b", "qwen3-8b")
         for b in (1, 16, 64)]  # fmt: skip


@pytest.mark.parametrize("config, batch", CASES)
def test_pages_cover_each_instruction_once_and_fit(config, batch):
    program, s = real_shape(config, batch)
    geo = geometry(s)
    for op, t in geo.items():
        # Pages split a CTA's 8 warps evenly, and QKV's divide a head.
        assert t.per_page & (t.per_page - 1) == 0
        assert t.per_page * warps_per_row(t.per_page) in (t.per_page, 8)
        if op == Op.QKV:
            assert s.head_dim % t.per_page == 0
        matrices = 2 if t.dual else 1
        assert matrices * t.per_page * t.k <= PAGE_ELEMS
        assert (t.per_page * t.k * 2) % 16 == 0  # the up half's offset
        assert (t.k * 2) % 16 == 0  # every copy's size and source address
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
            rows = [r for first, n in made for r in range(first, first + n)]
            assert rows == list(weight_rows(s, ins.op, ins.arg0, ins.arg1))
            assert all(0 < n <= geo[ins.op].per_page for _, n in made)


class Ring:
    """One SM's producer (thread 0's cursor and the slots' state)."""

    def __init__(self, counts: list[int], slots: int) -> None:
        self.counts, self.slots = counts, slots
        self.cursor = self.cursor_page = self.issued = 0
        self.slot_page: list = [None] * slots  # the page last copied into it
        self.completed = [0] * slots  # mbarrier phases completed per slot

    def top_up(self, released: int) -> None:
        while self.cursor < len(self.counts) and self.issued - released < self.slots:
            if self.cursor_page < self.counts[self.cursor]:
                slot = self.issued % self.slots
                # The slot's previous page was released before the refill.
                last = self.slot_page[slot]
                assert last is None or last < released
                assert self.completed[slot] == self.issued // self.slots
                self.slot_page[slot] = self.issued
                self.issued += 1
                self.cursor_page += 1
            else:
                self.cursor += 1
                self.cursor_page = 0

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
        ring, base = Ring(counts, slots), 0
        for n in counts:
            ring.top_up(base)  # before (and while) the instruction waits
            for g in range(base, base + n):
                ring.consume(g)
                if refill:
                    ring.top_up(g + 1)  # thread 0, after the page's CTA barrier
            base += n
        assert ring.issued == base, "pages issued but never read"


@pytest.mark.parametrize("config, batch", CASES)
def test_ring_schedule_never_waits_on_an_unissued_or_reused_page(config, batch):
    program, s = real_shape(config, batch)
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
    assert ring_slots(small) * PAGE_BYTES <= 6 * 32 * 1024
    assert not ring_slots(KernelShape(**{**small.as_dict(), "weight_pipe": False}))
