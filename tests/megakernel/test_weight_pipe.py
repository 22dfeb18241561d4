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
- The producer warp (``produce``) and the eight consumer warps run
  concurrently over a model of the ring's mbarriers (phases, parities,
  arrival counts, transaction bytes), under random interleavings: every
  page is issued once, in queue order across instructions and layers; a
  slot is refilled only once every consumer warp released its page
  (``pages_empty``); a consumer's wait passes only on its own page, landed
  (``pages_full``'s parity); nothing deadlocks; the L2 hints are each page
  once, in order, past the ring and at most ``L2_AHEAD_PAGES`` ahead.
  Mutations of the protocol (no empty wait, wrong parities, an empty
  barrier that counts one warp) must fail the replay. The instruction
  ring (control.py) replays through the same model.
"""

import dataclasses
import functools
import random

import pytest

from vllm_ext.megakernel.build import spec_or_exit
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.interpret import head_part_dims
from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.kernel.control import QUEUE_SLOTS
from vllm_ext.megakernel.kernel.ops.common import NUM_WARPS, VEC, stages_input
from vllm_ext.megakernel.kernel.ops.gemv_mma import (
    ROWS,
    group_rows,
    k_chunk,
    page_index,
)
from vllm_ext.megakernel.kernel.ops.weight_pipe import (
    EMPTY_ARRIVALS,
    L2_AHEAD_PAGES,
    MIN_SLOTS,
    QUANT_OPS,
    geometry,
    head_pages,
    tile_pages,
    unit_row,
    warps_per_row,
)
from vllm_ext.megakernel.kernel.persistent import SMEM_LIMIT, ring_slots, shared_bytes
from vllm_ext.megakernel.kernel.shape import PAGE_BYTES, KernelShape
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
        if t.mma:  # _paged_mma: row groups, each group's k pages in order
            for grp in range(tile_pages(row_end - row0, t.per_page)):
                first = row0 + grp * t.per_page
                for kc in range(t.k_pages):
                    k0 = kc * t.k_chunk
                    out.append((page0 + grp * t.k_pages + kc, first,
                                min(t.per_page, row_end - first), k0,
                                min(t.k_chunk, t.k - k0)))  # fmt: skip
        else:  # _paged_rows: whole rows
            for kk in range(tile_pages(row_end - row0, t.per_page)):
                first = row0 + kk * t.per_page
                out.append((page0 + kk, first, min(t.per_page, row_end - first),
                            0, t.k))  # fmt: skip
    return out


@functools.cache
def real_shape(config: str, batch: int, split: bool = False):
    """(Cached: the page and replay tests share the real programs.)"""
    spec = spec_or_exit("test", config, "bfloat16", batch)
    parts = qkv_parts_to_fill(spec, DEVICES["h200"].num_sms) if split else 1
    program = plan(spec, batch, DEVICES["h200"], with_lm_head=True, qkv_parts=parts)
    shape = KernelShape.from_program(program, 16)
    assert shape.qkv_parts == (2 if split else 1)
    # Batch 1 and mixtures: the CUDA-core GEMV's pages of whole rows; above
    # (dense): the tensor cores' row groups by k chunks.
    assert shape.mma_gemv == (batch > 1 and not shape.moe)
    return program, shape


# Tiles and pages depend on the batch only through the GEMV it selects (the
# ring's size aside): batch 1 for the rows, 16 for the tensor cores. (QKV
# head parts: the 1B shape; QK-norm changes no page. Qwen3-8B's pages
# are Llama-3.1-8B's: the same widths; CI time.)
CASES = [(c, b, False) for c in ("llama-3.2-1b", "llama-3.1-8b")
         for b in (1, 16)] + [("llama-3.2-1b", b, True) for b in (1, 16)] + [
    # Quantized (tensor-core pages at every batch: e4m3's 512-code chunks,
    # INT4's 128-row groups; FP8 blocks page as FP8 per channel).
    ("llama-3.1-8b-fp8", 1, False), ("llama-3.1-8b-w4a16", 1, False),
    # A quantized mixture: its attention's pages (the experts read global
    # memory), INT4's at 16 requests beside the halved stage (stage_bytes).
    ("qwen3-30b-a3b-gptq-int4", 16, False)]  # fmt: skip


@pytest.mark.parametrize("config, batch, split", CASES)
def test_pages_cover_each_instruction_once_and_fit(config, batch, split):
    program, s = real_shape(config, batch, split)
    geo = geometry(s)
    for op, t in geo.items():
        mma = t.mma  # (quantized ops: at every batch)
        assert mma == (s.mma_gemv or (s.quantized and op in QUANT_OPS))
        # Pages split a CTA's 8 warps evenly (whole rows) or are row groups
        # of whole MMA row blocks (64 rows, 32 of each of gate and up) by
        # 256-column k chunks, and QKV's divide a head.
        assert t.per_page & (t.per_page - 1) == 0
        if mma:
            chunk = k_chunk(t.fp8, t.int4)
            assert t.per_page % ROWS == 0 and t.k_chunk == min(chunk, t.k)
        else:
            assert t.per_page * warps_per_row(t.per_page) in (t.per_page, 8)
            assert t.k_chunk == t.k
        # QKV's pages divide a head (or a part's blocks of rows); the
        # tensor cores' are as large as that allows.
        block = s.head_dim // (2 * s.qkv_parts) if split else s.head_dim
        if op == Op.QKV:
            assert block % t.per_page == 0
        if mma:
            full = group_rows(t.dual, t.int4)
            assert t.per_page == (min(full, block) if op == Op.QKV else full)
            assert full * (2 if t.dual else 1) == group_rows(False, t.int4)
        matrices = 2 if t.dual else 1
        assert t.bytes_of(matrices * t.per_page * t.k_chunk) <= PAGE_BYTES
        # Each row's copy lands where the consumers' page view reads it
        # (both use page_index): disjoint, in the slot, 16-byte aligned.
        starts = sorted(page_index(m, r, 0, t.per_page, t.k_chunk)
                        for m in range(matrices)
                        for r in range(t.per_page))  # fmt: skip
        assert starts == list(range(0, len(starts) * t.k_chunk, t.k_chunk))
        assert t.bytes_of(starts[-1] + t.k_chunk) <= PAGE_BYTES
        assert all(t.bytes_of(o) % 16 == 0 for o in starts)
        assert t.bytes_of(t.per_page * t.k_chunk) % 16 == 0  # the up half's offset
        assert t.bytes_of(t.k_chunk) % 16 == 0 and t.bytes_of(t.k) % 16 == 0
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
            assert all(k0 + c <= t.k and t.bytes_of(c) % 16 == 0
                       for _, _, k0, c in made)  # fmt: skip


class MBarrier:
    """An mbarrier as PTX defines it: a phase completes when its pending
    arrivals reach 0 and its transaction count is 0; ``test_wait(parity)``
    is true once the phase of that parity before the current one has
    completed (a fresh barrier: parity 1 passes, parity 0 does not)."""

    def __init__(self, count: int) -> None:
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def arrive(self, expect_tx: int = 0) -> None:
        assert self.pending > 0
        self.tx += expect_tx
        self.pending -= 1
        self._complete()

    def complete_tx(self, n: int) -> None:
        self.tx -= n
        assert self.tx >= 0
        self._complete()

    def _complete(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def test_wait(self, parity: int) -> bool:
        return self.phase % 2 != parity


# Protocol mutations the replay must reject.
MUTATIONS = ("no_empty_wait", "empty_parity", "full_parity", "empty_counts_one")


class PipeReplay:
    """One SM: the producer lane, a copy engine that lands copies in any
    order, and ``NUM_WARPS`` consumer warps, stepped in a random order."""

    def __init__(self, counts: list[int], slots: int, seed: int,
                 mutation: str = "", consumer_counts: list[int] | None = None,
                 consumers: int = NUM_WARPS) -> None:  # fmt: skip
        self.counts, self.slots, self.mutation = counts, slots, mutation
        self.consumers = consumers
        # (The consumers' view of the queue: the producer's unless a test
        # makes them disagree.)
        self.consumer_counts = consumer_counts or counts
        self.rng = random.Random(seed)
        # Every consumer thread arrives: a warp's lanes, in one step.
        self.lanes = EMPTY_ARRIVALS // NUM_WARPS
        empty_count = 1 if mutation == "empty_counts_one" else consumers * self.lanes
        self.full = [MBarrier(1) for _ in range(slots)]
        self.empty = [MBarrier(empty_count) for _ in range(slots)]
        self.content: list = [None] * slots  # (page, landed)
        self.unread: list[set] = [set() for _ in range(slots)]
        self.in_flight: list[tuple[int, int]] = []  # (slot, page)
        self.issued: list[int] = []
        self.hints: list[int] = []
        self.l2 = [0, 0, 0]  # the L2 cursor: instruction, page, pages hinted

    def producer(self):
        """As ``produce``: page g into slot g % slots once page g - slots
        was released; the pages past the ring hinted while blocked."""
        g = 0
        for pc, n in enumerate(self.counts):
            for kp in range(n):
                slot = g % self.slots
                if g >= self.slots and self.mutation != "no_empty_wait":
                    parity = (g // self.slots + 1) % 2
                    if self.mutation == "empty_parity":
                        parity = (g // self.slots) % 2
                    if not self.empty[slot].test_wait(parity):
                        self.hint_ahead(pc, kp, g)
                        while not self.empty[slot].test_wait(parity):
                            yield False
                assert not self.unread[slot], (
                    f"page {g} refilled slot {slot} before every consumer warp "
                    f"released page {self.content[slot][0]}"
                )
                self.content[slot] = (g, False)
                self.unread[slot] = set(range(self.consumers))
                self.full[slot].arrive(expect_tx=1)
                self.in_flight.append((slot, g))
                self.issued.append(g)
                g += 1
                yield True

    def hint_ahead(self, pc: int, kp: int, g: int) -> None:
        """As ``_hint_ahead`` and ``_walk``: pages [g, g + L2_AHEAD_PAGES),
        each once."""
        hpc, hkp, hinted = self.l2
        if hinted < g:
            hpc, hkp, hinted = pc, kp, g
        while hpc < len(self.counts) and hinted - g < L2_AHEAD_PAGES:
            if hkp < self.counts[hpc]:
                assert not self.hints or hinted > self.hints[-1], (
                    "a page hinted twice or out of order"
                )
                assert g <= hinted < g + L2_AHEAD_PAGES, "a hint not past the ring"
                self.hints.append(hinted)
                hinted, hkp = hinted + 1, hkp + 1
            else:
                hpc, hkp = hpc + 1, 0
        self.l2 = [hpc, hkp, hinted]

    def copy_engine(self):
        while True:
            if not self.in_flight:
                yield None  # idle: neither progress nor blocked
                continue
            slot, g = self.in_flight.pop(self.rng.randrange(len(self.in_flight)))
            self.content[slot] = (g, True)
            self.full[slot].complete_tx(1)
            yield True

    def consumer(self, warp: int):
        """As ``paged_gemv``: each instruction's pages from its base, wait
        for the page's full phase, read, release (each of the warp's
        threads)."""
        base = 0
        for n in self.consumer_counts:
            for g in range(base, base + n):
                slot = g % self.slots
                parity = (g // self.slots) % 2
                if self.mutation == "full_parity":
                    parity = 1 - parity
                while not self.full[slot].test_wait(parity):
                    yield False
                assert self.content[slot] == (g, True), (
                    f"warp {warp} passed its wait for page {g} but slot {slot} "
                    f"holds {self.content[slot]}"
                )
                self.unread[slot].discard(warp)
                yield True
                for _ in range(self.lanes):
                    self.empty[slot].arrive()
                yield True
            base += n

    def run(self) -> None:
        actors = {"producer": self.producer(), "copies": self.copy_engine()}
        for w in range(self.consumers):
            actors[w] = self.consumer(w)
        blocked: set = set()
        while len(actors) > 1 or self.in_flight:
            live = [a for a in actors if a != "copies" or self.in_flight]
            name = self.rng.choice(live)
            try:
                progressed = next(actors[name])
            except StopIteration:
                del actors[name]
                blocked.clear()
                continue
            if progressed:
                blocked.clear()
            elif progressed is False:
                blocked.add(name)
                waiting = {a for a in actors if a != "copies"}
                assert not (waiting <= blocked and not self.in_flight), (
                    f"deadlock: every warp waits (issued {len(self.issued)})"
                )
            if len(actors) == 1 and not self.in_flight:
                break
        total = sum(self.counts)
        assert self.issued == list(range(total)), "pages issued out of order"
        assert all(not u for u in self.unread), "a page never read"


def sm_page_counts(program, s: KernelShape) -> list[list[int]]:
    """Each SM's pages per instruction, as ``instr_pages`` counts them."""
    geo = geometry(s)
    return [
        [len(producer_pages(s, i.op, i.arg0, i.arg1)) if i.op in geo else 0
         for i in queue]
        for queue in program.queues
    ]  # fmt: skip


def busiest(counts: list[list[int]], n: int) -> list[list[int]]:
    """The ``n`` SMs with the most pages (the replay is Python: a sample)."""
    return sorted(counts, key=sum, reverse=True)[:n]


# The real programs: dense 1B and 8B at batch 1, the mixture (its dense
# projections page; ROUTE, TOPK and the experts do not), the tensor-core
# pages of the batched buckets (the smallest ring: 8B at batch 64), INT4's
# 128-row tensor-core pages at batch 1.
REPLAYS = [("llama-3.2-1b", 1), ("llama-3.1-8b", 1), ("qwen3-30b-a3b", 1),
           ("llama-3.2-1b", 16), ("llama-3.1-8b", 64),
           ("llama-3.1-8b-w4a16", 1), ("qwen3-30b-a3b-fp8", 16)]  # fmt: skip


@pytest.mark.parametrize("config, batch", REPLAYS)
def test_producer_and_consumer_warps_replay_clean(config, batch):
    program, s = real_shape(config, batch)
    slots = ring_slots(s)
    assert slots >= MIN_SLOTS
    counts = sm_page_counts(program, s)
    assert sum(map(sum, counts)) > 0
    for seed, sm in enumerate(busiest(counts, 3)):
        PipeReplay(sm, slots, seed).run()


@pytest.mark.parametrize("batch", [1, 16], ids=["rows", "mma"])
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_replay_rejects_a_broken_protocol(mutation, batch):
    program, s = real_shape("llama-3.2-1b", batch)
    sm = busiest(sm_page_counts(program, s), 1)[0]
    with pytest.raises(AssertionError):
        for seed in range(4):  # any interleaving that shows it
            PipeReplay(sm, ring_slots(s), seed, mutation).run()


@pytest.mark.parametrize("config, batch", [("llama-3.2-1b", 1), ("qwen3-30b-a3b", 1)])
def test_instruction_ring_replays_clean(config, batch):
    """The instruction ring (control.py) is the same protocol with one
    entry per instruction: the controller fills slot pc % QUEUE_SLOTS once
    the consumers freed it (``queue_empty``: one arrival, consumer thread 0
    after the consumers' barrier) and publishes it once the inputs are met
    (``queue_ready``; here the "copy" landing late is the counter wait),
    and the consumers, one actor since they pass their barrier together,
    wait on ``queue_ready``'s parity."""
    program, _ = real_shape(config, batch)
    queue = max(program.queues, key=len)
    PipeReplay([1] * len(queue), QUEUE_SLOTS, 0, consumers=1).run()
    with pytest.raises(AssertionError):
        PipeReplay([1] * len(queue), QUEUE_SLOTS, 0, "no_empty_wait", consumers=1).run()


def test_the_replay_catches_a_deadlock():
    # Consumers that expect one page more than the producer issues (the two
    # sides counting an instruction's pages differently) wait forever: the
    # replay must say so rather than spin.
    program, s = real_shape("llama-3.2-1b", 1)
    sm = busiest(sm_page_counts(program, s), 1)[0]
    last = max(i for i, n in enumerate(sm) if n)
    short = sm[:last] + [sm[last] - 1] + sm[last + 1 :]
    with pytest.raises(AssertionError, match="deadlock"):
        PipeReplay(short, ring_slots(s), 0, consumer_counts=sm).run()


def test_ring_fits_beside_the_rest_of_shared_memory():
    # On tensor cores 1B at batch 16 stages a page's k chunk, not its whole
    # normed input (64 KiB): as many slots as at batch 1. The mixture's
    # CUDA-core rows at batch 16 stage it (as wide a hidden): at least three
    # slots. The legacy control has none.
    _, small = real_shape("llama-3.2-1b", 1)
    _, mma = real_shape("llama-3.2-1b", 16)
    _, rows = real_shape("qwen3-30b-a3b", 16)
    assert mma.mma_gemv and not stages_input(mma)
    assert not rows.mma_gemv and stages_input(rows)
    assert ring_slots(small) == ring_slots(mma) > ring_slots(rows) >= MIN_SLOTS
    assert all(shared_bytes(s) <= SMEM_LIMIT for s in (small, mma, rows))
    assert not ring_slots(dataclasses.replace(small, legacy_control=True))


@pytest.mark.parametrize(
    "config, cached",
    [
        # Every paged projection of a Llama shape: 4 to 8 vectors a lane
        # (GATE_UP's gate and up rows share a page), DOWN's 28 KiB row on
        # the 8B shape 7 (a row a page, 8 warps on it).
        ("llama-3.2-1b", {Op.QKV: 8, Op.O_PROJ: 8, Op.GATE_UP: 4, Op.DOWN: 8,
                          Op.LM_HEAD: 8}),
        ("llama-3.1-8b", {Op.QKV: 8, Op.O_PROJ: 8, Op.GATE_UP: 4, Op.DOWN: 7,
                          Op.LM_HEAD: 8}),
    ],
)  # fmt: skip
def test_batch1_rows_keep_their_input_in_registers(config, cached):
    """At batch 1 each lane reads the same input vectors for every row of a
    paged instruction (``_paged_rows``): it keeps them in registers
    (``gemv.cache_input``) where they fit, as every paged projection of
    these shapes does."""
    from vllm_ext.megakernel.kernel.ops.gemv import cached_vectors

    _, shape = real_shape(config, 1)
    got = {op: cached_vectors(t.k, warps_per_row(t.per_page))
           for op, t in geometry(shape).items()}  # fmt: skip
    assert got == cached
    # The reads cover the row: each lane's vectors, over 32 lanes and the
    # warps on the row.
    for op, t in geometry(shape).items():
        assert got[op] * 32 * warps_per_row(t.per_page) * VEC >= t.k
