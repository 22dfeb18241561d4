# SPDX-License-Identifier: Apache-2.0
"""Proofs over a program: no deadlock, every read after its writers, no
buffer unit written twice in a step.

The argument, checked here rather than assumed:

1. *Counting.* Every wait names a counter and a count; the count must equal
   the number of instructions that signal that counter. A wait that is met
   therefore means every one of those signallers has finished (and, on the
   GPU, released its stores), for any interleaving.
2. *No deadlock.* With all CTAs co-resident, each SM runs its queue in order
   and a met wait stays met (counters only grow). The system is monotone, so
   if one maximal run completes every instruction, every run does: the
   verifier simulates one, and names the stuck SMs otherwise.
3. *Happens-before.* Queue order and "signaller -> waiter" edges give a
   partial order. Every read of a buffer unit must come after every
   instruction that writes that unit (or be by the writer itself).
4. *Single assignment.* No buffer unit is written by two instructions, and
   every unit read is written by some instruction (activations are per-layer
   buffers, so a step has no write-after-read hazards to order).

A tensor-parallel program (``spec.tp_size`` ranks, isa.py) is proven as the
set of its ranks: ``tp_size`` copies of its queues, each rank's counters and
buffers its own, except the counters its partial sums signal on every rank
(one counter here: each rank's copy gets every signal) and the partials an
ALL_REDUCE reads of every rank. A missing or short wait of an ALL_REDUCE is
then a read before another rank's writer, found like any other. A pipeline
stage past the first reads its ``h[0]`` as an input, written before the
step.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from vllm_ext.megakernel.isa import (
    NO_COUNTER,
    Instruction,
    Op,
    Point,
    unpack_cols,
)


class VerificationError(ValueError):
    """The program is wrong; the message says where."""


@dataclass(frozen=True)
class Region:
    """Units [lo, hi) of one buffer of one layer (units: columns, heads,
    or attention partials, depending on the buffer)."""

    buffer: str
    layer: int
    lo: int
    hi: int
    # Tensor parallel: the region on every rank (else the instruction's own).
    every_rank: bool = False


# The buffer of each point's partial sums, and where its sum goes: (buffer,
# layer offset) of the destination and of the residual (None: none).
_PARTIAL = {Point.EMBED: "partial.embed", Point.ATTN: "partial.attn",
            Point.MLP: "partial.mlp"}  # fmt: skip
_SUM_TO = {Point.EMBED: ("h", 0), Point.ATTN: ("hmid", 0), Point.MLP: ("h", 1)}
_RESIDUAL = {Point.EMBED: None, Point.ATTN: ("h", 0), Point.MLP: ("hmid", 0)}


def accesses(program, instr: Instruction) -> tuple[list[Region], list[Region]]:
    """(reads, writes) of ``instr``: what the ISA says each opcode touches."""
    s, ly = program.spec, instr.layer
    a, b = instr.arg0, instr.arg1
    nq, nkv = s.num_q_heads, s.num_kv_heads
    group, chunks = nq // nkv, program.attn_chunks
    h, L = s.hidden_size, s.num_layers
    op = instr.op
    tp = s.tp_size > 1
    if op == Op.NOP:  # waits and signals only (timing probes)
        return [], []
    if op == Op.EMBED:
        return [], [Region(_PARTIAL[Point.EMBED] if tp else "h", 0, a, b)]
    if op == Op.ALL_REDUCE:
        point = Point(a)
        lo, hi = unpack_cols(b)
        reads = [Region(_PARTIAL[point], ly, lo, hi, every_rank=True)]
        if _RESIDUAL[point] is not None:
            name, offset = _RESIDUAL[point]
            reads.append(Region(name, ly + offset, lo, hi))
        name, offset = _SUM_TO[point]
        return reads, [Region(name, ly + offset, lo, hi)]
    parts = program.qkv_parts  # q, k and v units: parts of heads (isa.py)
    if op == Op.QKV:
        writes = []
        for name, base, n in (("q", 0, nq), ("k", nq, nkv), ("v", nq + nkv, nkv)):
            base, n = base * parts, n * parts
            lo, hi = max(a, base) - base, min(b, base + n) - base
            if lo < hi:
                writes.append(Region(name, ly, lo, hi))
        return [Region("h", ly, 0, h)], writes
    if op == Op.ATTN:
        # With Program.qk_in_attn the chunk holding a request's newest token
        # also finishes that token's K in place (isa.py). Not a region
        # write: which chunk is data (the length), and no other instruction
        # reads that row in the step, so it orders nothing here.
        reads = [
            Region("q", ly, a * group * parts, (a + 1) * group * parts),
            Region("k", ly, a * parts, (a + 1) * parts),
            Region("v", ly, a * parts, (a + 1) * parts),
        ]
        return reads, [Region("part", ly, a * chunks + b, a * chunks + b + 1)]
    if op == Op.COMBINE:
        # attn units: (q head, dim part) pairs (isa.py).
        lo, hi = unpack_cols(b)
        if hi > group * program.combine_parts:
            raise VerificationError(
                f"{instr}: units [{lo}, {hi}) beyond kv head {a}'s "
                f"{group * program.combine_parts}"
            )
        base = a * group * program.combine_parts
        reads = [Region("part", ly, a * chunks, (a + 1) * chunks)]
        return reads, [Region("attn", ly, base + lo, base + hi)]
    if op == Op.O_PROJ:
        # attn units: (q head, dim part) pairs, MLA's (head, v part) pairs
        # (MLA_COMBINE's tiles).
        parts = program.mla_v_parts if s.mla is not None else program.combine_parts
        units = nq * parts
        if tp:  # the residual is ALL_REDUCE's
            partial = Region(_PARTIAL[Point.ATTN], ly, a, b)
            return [Region("attn", ly, 0, units)], [partial]
        reads = [Region("attn", ly, 0, units), Region("h", ly, a, b)]
        return reads, [Region("hmid", ly, a, b)]
    if op == Op.GATE_UP:
        return [Region("hmid", ly, 0, h)], [Region("act", ly, a, b)]
    if op == Op.DOWN:
        if tp:
            reads = [Region("act", ly, 0, s.intermediate_size)]
            return reads, [Region(_PARTIAL[Point.MLP], ly, a, b)]
        reads = [Region("act", ly, 0, s.intermediate_size), Region("hmid", ly, a, b)]
        return reads, [Region("h", ly + 1, a, b)]
    if op == Op.FINAL_NORM:
        return [Region("h", L, 0, h)], [Region("out", L, a, b)]
    if op == Op.LM_HEAD:
        return [Region("out", L, 0, h)], [Region("logits", L, a, b)]
    # Multi-head latent attention (isa.py). The latent cache rows a step
    # appends are one unit: MLA_ATTN reads every new row (any request's
    # chunk may hold its newest token).
    mla = s.mla
    if op == Op.MLA_QKV_A and mla is not None:
        return [Region("h", ly, 0, h)], [Region("qkv_a", ly, a, b)]
    if op == Op.MLA_Q and mla is not None:
        lora = mla.q_lora_rank
        reads = [Region("qkv_a", ly, 0, lora) if lora else Region("h", ly, 0, h)]
        return reads, [Region("q", ly, a, b)]
    if op == Op.MLA_APPEND and mla is not None:
        lora = mla.q_lora_rank or 0
        reads = [Region("qkv_a", ly, lora, lora + mla.latent_width)]
        return reads, [Region("latent", ly, 0, 1)]
    if op == Op.MLA_ATTN and mla is not None:
        per_group = mla.num_heads // program.mla_head_groups
        reads = [
            Region("q", ly, a * per_group, (a + 1) * per_group),
            Region("latent", ly, 0, 1),
        ]
        return reads, [Region("part", ly, a * chunks + b, a * chunks + b + 1)]
    if op == Op.MLA_COMBINE and mla is not None:
        g = a // (mla.num_heads // program.mla_head_groups)
        reads = [Region("part", ly, g * chunks, (g + 1) * chunks)]
        unit = a * program.mla_v_parts + b
        return reads, [Region("attn", ly, unit, unit + 1)]
    # A sparse layer's mixture (isa.py). The routing table is one unit: the
    # experts' weight addresses depend on it like any activation read.
    moe = s.moe
    if op == Op.ROUTE:
        return [Region("hmid", ly, 0, h)], [Region("router", ly, a, b)]
    if op == Op.TOPK and moe is not None:
        reads = [Region("router", ly, 0, moe.num_experts)]
        return reads, [Region("route", ly, 0, 1)]
    if op == Op.EXPERT_UP and moe is not None:
        lo, hi = unpack_cols(b)
        if a == program.shared_slot:  # routing-free (planner.py)
            return [Region("hmid", ly, 0, h)], [Region("xact_shared", ly, lo, hi)]
        # A routed tile computes the routing from the logits (isa.py).
        base = a * moe.expert_intermediate
        reads = [Region("hmid", ly, 0, h), Region("router", ly, 0, moe.num_experts)]
        return reads, [Region("xact", ly, base + lo, base + hi)]
    if op == Op.EXPERT_DOWN and moe is not None:
        reads = [
            Region("xact", ly, 0, program.num_slots * moe.expert_intermediate),
            Region("route", ly, 0, 1),
        ]
        if program.shared_slot is not None:
            reads.append(Region("xact_shared", ly, 0, moe.shared_intermediate))
        if tp:
            return reads, [Region(_PARTIAL[Point.MLP], ly, a, b)]
        reads.append(Region("hmid", ly, a, b))
        return reads, [Region("h", ly + 1, a, b)]
    raise VerificationError(f"unknown opcode in {instr}")


@dataclass(frozen=True)
class Report:
    num_sms: int
    num_instructions: int
    num_counters: int
    # A valid execution order: (sm, index) pairs.
    schedule: tuple[tuple[int, int], ...]


def verify(program) -> Report:
    """Raise VerificationError naming the first fault (of any rank's, for a
    tensor-parallel program)."""
    ranks = _RankSet(program)
    queues = ranks.queues
    _check_counting(ranks, queues)
    schedule = _simulate(queues, ranks.where)
    _check_data(ranks, queues, schedule, _Clocks(queues, schedule))
    return Report(
        num_sms=len(program.queues),
        num_instructions=sum(len(q) for q in program.queues),
        num_counters=program.num_counters,
        schedule=tuple(schedule),
    )


class _RankSet:
    """The queues every rank runs, as one program: rank r's SM s is queue
    ``r * num_sms + s``; a counter signalled on every rank is one counter,
    a rank's own counters and buffers are its own (one rank: the program
    itself)."""

    def __init__(self, program) -> None:
        self.program = program
        tp, n = program.spec.tp_size, program.num_counters
        self.num_sms = len(program.queues)
        if tp == 1:
            self.queues = program.queues
            self.num_counters, self.names = n, program.counter_names
            return
        shared = {i.signal_counter for q in program.queues for i in q
                  if i.signal_ranks}  # fmt: skip

        def of_rank(c: int, r: int) -> int:
            return c if c == NO_COUNTER or c in shared else n * (r + 1) + c

        self.queues = tuple(
            tuple(
                dataclasses.replace(
                    i,
                    wait_counter=of_rank(i.wait_counter, r),
                    signal_counter=of_rank(i.signal_counter, r),
                )
                for i in q
            )
            for r in range(tp)
            for q in program.queues
        )
        self.num_counters = n * (tp + 1)
        self.names = tuple(
            program.counter_names[c % n] + ("" if c < n else f"@rank{c // n - 1}")
            for c in range(self.num_counters)
        )

    def is_input(self, region: Region) -> bool:
        """Written before the step: a later pipeline stage's ``h[0]``, the
        previous stage's hidden states."""
        name = region.buffer.split("@")[0]
        return not self.program.spec.pp_first and (name, region.layer) == ("h", 0)

    def where(self, queue: int) -> str:
        r, sm = divmod(queue, self.num_sms)
        return f"rank {r} SM {sm}" if self.program.spec.tp_size > 1 else f"SM {sm}"

    def accesses(self, queue: int, idx: int) -> tuple[list[Region], list[Region]]:
        r, sm = divmod(queue, self.num_sms)
        reads, writes = accesses(self.program, self.program.queues[sm][idx])
        if self.program.spec.tp_size == 1:
            return reads, writes

        def own(regions):
            out = []
            for g in regions:
                ranks = range(self.program.spec.tp_size) if g.every_rank else [r]
                for k in ranks:
                    out.append(
                        dataclasses.replace(
                            g, buffer=f"{g.buffer}@{k}", every_rank=False
                        )
                    )
            return out

        return own(reads), own(writes)


def _check_counting(ranks: _RankSet, queues) -> None:
    signallers: dict[int, int] = defaultdict(int)
    for q in queues:
        for instr in q:
            if instr.signal_counter != NO_COUNTER:
                if not 0 <= instr.signal_counter < ranks.num_counters:
                    raise VerificationError(f"{instr}: no such counter")
                signallers[instr.signal_counter] += 1
    for sm, q in enumerate(queues):
        for idx, instr in enumerate(q):
            c = instr.wait_counter
            if c == NO_COUNTER:
                continue
            if not 0 <= c < ranks.num_counters:
                raise VerificationError(
                    f"{ranks.where(sm)} #{idx} {instr}: no such counter"
                )
            if instr.wait_count != signallers[c]:
                raise VerificationError(
                    f"{ranks.where(sm)} #{idx} {instr}: waits for "
                    f"{instr.wait_count} signals of counter {c} "
                    f"({ranks.names[c]}), but {signallers[c]} instructions "
                    "signal it"
                )


def _run(queues):
    """One maximal run of the queues, every instruction as soon as its wait
    is met: the order they ran in, where each queue stopped, and the counts
    reached."""
    count: dict[int, int] = defaultdict(int)
    pos = [0] * len(queues)
    blocked: dict[int, list[int]] = defaultdict(list)
    ready = list(range(len(queues)))
    schedule = []
    while ready:
        sm = ready.pop()
        while pos[sm] < len(queues[sm]):
            instr = queues[sm][pos[sm]]
            c = instr.wait_counter
            if c != NO_COUNTER and count[c] < instr.wait_count:
                blocked[c].append(sm)
                break
            schedule.append((sm, pos[sm]))
            pos[sm] += 1
            s = instr.signal_counter
            if s != NO_COUNTER:
                count[s] += 1
                woken = [w for w in blocked[s]
                         if count[s] >= queues[w][pos[w]].wait_count]  # fmt: skip
                if woken:
                    blocked[s] = [w for w in blocked[s] if w not in woken]
                    ready.extend(woken)
    return schedule, pos, count


def stuck_heads(queues) -> dict[int, int]:
    """Each queue that cannot finish, and the instruction whose wait holds
    it: {queue: index}. Empty for a program that runs through. The GPU
    check's abort case uses it to tell which waits a planted hang starves
    (any of them may be the first whose bounded wait expires)."""
    _, pos, _ = _run(queues)
    return {sm: p for sm, p in enumerate(pos) if p < len(queues[sm])}


def _simulate(queues, where=lambda sm: f"SM {sm}") -> list[tuple[int, int]]:
    """One maximal run; raise if it gets stuck."""
    schedule, pos, count = _run(queues)
    stuck = [
        f"{where(sm)} #{pos[sm]} {queues[sm][pos[sm]]} (counter at "
        f"{count[queues[sm][pos[sm]].wait_counter]})"
        for sm in range(len(queues))
        if pos[sm] < len(queues[sm])
    ]
    if stuck:
        shown = "; ".join(stuck[:4]) + (" ..." if len(stuck) > 4 else "")
        raise VerificationError(f"deadlock: {len(stuck)} SMs stuck: {shown}")
    return schedule


class _Clocks:
    """Happens-before as vector clocks: for an instruction, how many of each
    queue's instructions must finish before it starts. Such a set is closed
    downwards along each queue (queue order is an edge), so one count per
    queue holds it exactly; and a clock only grows at a wait, so a queue
    keeps one clock per wait that teaches it something. (Bitmasks over the
    schedule took N^2 bits: Kimi-K2 at batch 64, 790 k instructions, ran
    out of memory.)"""

    def __init__(self, queues, schedule) -> None:
        n = len(queues)
        empty = np.zeros(n, np.int64)
        self._starts: list[list[int]] = [[0] for _ in queues]
        self._clocks: list[list[np.ndarray]] = [[empty] for _ in queues]
        of_counter: dict[int, np.ndarray] = {}
        for sm, idx in schedule:
            instr = queues[sm][idx]
            now = self._clocks[sm][-1]
            if instr.wait_counter != NO_COUNTER:
                # Counting (checked first) makes a met wait imply that every
                # signaller finished; they all precede this in the schedule.
                signalled = of_counter[instr.wait_counter]
                if (signalled > now).any():
                    now = np.maximum(now, signalled)
                    self._starts[sm].append(idx)
                    self._clocks[sm].append(now)
            if instr.signal_counter != NO_COUNTER:
                known = of_counter.get(instr.signal_counter)
                if known is None:
                    known = of_counter[instr.signal_counter] = now.copy()
                else:
                    np.maximum(known, now, out=known)
                known[sm] = max(known[sm], idx + 1)

    def before(self, sm: int, idx: int) -> np.ndarray:
        """Per queue, the count of its instructions known to finish before
        (sm, idx) starts, counting (sm, idx) itself."""
        seg = bisect.bisect_right(self._starts[sm], idx) - 1
        clock = self._clocks[sm][seg].copy()
        clock[sm] = idx + 1
        return clock


def _check_data(ranks: _RankSet, queues, schedule, clocks: _Clocks) -> None:
    writers: dict[tuple[str, int], list[tuple[int, int, tuple[int, int]]]] = (
        defaultdict(list)
    )
    reads = []
    where = ranks.where
    for sm, idx in schedule:
        r, w = ranks.accesses(sm, idx)
        for region in w:
            writers[(region.buffer, region.layer)].append(
                (region.lo, region.hi, (sm, idx))
            )
        reads.extend((region, (sm, idx)) for region in r)

    for (buffer, layer), spans in writers.items():
        spans.sort()
        for (_, hi0, k0), (lo1, hi1, k1) in zip(spans, spans[1:], strict=False):
            if lo1 < hi0:
                raise VerificationError(
                    f"{buffer}[layer {layer}] units [{lo1}, {min(hi0, hi1)}) "
                    f"written twice: {where(k0[0])} #{k0[1]} and {where(k1[0])} "
                    f"#{k1[1]}"
                )

    # The spans of a buffer are disjoint (checked above), so sorted by lo
    # they are sorted by hi too: a read's writers are a contiguous run. As
    # arrays, with each writer's queue and place in it, so that a read's
    # run is checked at once (DeepSeek-V3: 7 M reader-writer pairs).
    table = {
        name: tuple(np.array(col, dtype=np.int64) for col in zip(*(
            (lo, hi, w[0], w[1]) for lo, hi, w in spans), strict=True))
        for name, spans in writers.items()
    }  # fmt: skip
    none = (np.zeros(0, np.int64),) * 4
    known_key = None
    for region, key in reads:
        if ranks.is_input(region):
            continue
        if key != known_key:
            known = clocks.before(*key)
            known_key = key
        los, his, queue, place = table.get((region.buffer, region.layer), none)
        a = int(np.searchsorted(his, region.lo, side="right"))
        b = int(np.searchsorted(los, region.hi, side="left"))
        covered = int(
            (np.minimum(his[a:b], region.hi) - np.maximum(los[a:b], region.lo)).sum()
        )
        late = np.flatnonzero(place[a:b] >= known[queue[a:b]])
        if late.size:
            writer = (int(queue[a + late[0]]), int(place[a + late[0]]))
            instr, w_instr = queues[key[0]][key[1]], queues[writer[0]][writer[1]]
            raise VerificationError(
                f"{where(key[0])} #{key[1]} {instr} reads {region.buffer}"
                f"[layer {region.layer}] before {where(writer[0])} #{writer[1]} "
                f"{w_instr} is known to have written it"
            )
        if covered != region.hi - region.lo:
            raise VerificationError(
                f"{where(key[0])} #{key[1]} reads {region.buffer}[layer "
                f"{region.layer}] units [{region.lo}, {region.hi}) that no "
                "instruction writes"
            )
