# SPDX-License-Identifier: Apache-2.0
"""The cost model: predicted step time of a program from the bytes each
instruction moves, and the one table of device ceilings.

A design tool, not a claim. Its assumptions, all here:

* Each SM streams its instructions' weights from HBM back to back, in
  queue order, at an equal share of the device's measured copy bandwidth,
  whatever the instruction waits for, up to ``Device.lookahead_bytes``
  ahead of what it has executed: its shared-memory pipeline plus its share
  of the L2 half that bulk L2 prefetches may fill (the kernel's producer
  warp and the controller's L2 hints, kernel/control.py).
* Except routed experts' rows (isa.py), whose addresses are data: that
  stream skips them (it never waits for a routing; it goes on with the
  next instructions' weights through the gap, within the lookahead). A
  routed EXPERT_UP's wait is met ``dependency_latency_s`` after the
  layer's ROUTE ends; once they are free, its consumers compute the
  routing (the SM's first routed tile of the layer, as long as executing
  the layer's TOPK takes; the next ones reuse it) and hint routed rows
  ``ROUTED_AHEAD`` instructions ahead (``_hinted_by``): the first tile its
  own and the next ones', each later tile the one that far after it, the
  layer's last routed tile with the EXPERT_DOWN tiles right after it in
  the queue (the planner puts them there). Those rows start streaming
  then. Another EXPERT_DOWN's start when the controller publishes it: its
  wait met (every EXPERT_UP of the layer and TOPK signalled), the
  instructions before it published, its ring slot free (instruction k -
  ``QUEUE_SLOTS`` ended). The hints are capped (ops/prefetch.py's
  PREFETCH_BYTES per matrix, expert_down.py's PREFETCH_SLOTS) and the op
  loads the rest itself when it runs; the model streams all of them from
  the hint.
* Routed rows take the SM's share of bandwidth first (they are late, and
  the next instruction needs them): an in-order transfer in flight then
  waits as long; idle time of that stream (a lookahead stall) absorbs it.
  They do not count against the lookahead (they land in L2, not in the
  ring; the model does not bound L2 beyond the lookahead), and one SM's
  routed loads follow each other. The static weights of instructions
  without pages (the router's rows, the shared expert's, the latent
  attention's) stay in the in-order stream: the controller hints them
  before their waits. A step fills the expected number of distinct
  experts under uniform routing, the slot it falls in by its fraction
  (``Program.step_cost``); the others read nothing.
* An instruction executes once its weights are in and its wait is met; the
  wait is met ``dependency_latency_s`` after the last signal it needs (a
  release/acquire round trip through L2). Executing costs
  ``instruction_overhead_s`` plus its activation and KV bytes at the SM's
  share of bandwidth, plus, for a kind of instruction that a GPU measured
  slower than the stream feeds it, ``Device.exec_s_per_byte`` of that kind
  times every byte it moves (``exec_s``; ``calibrate`` fits it from a
  report's breakdown, per case: it belongs to the kernel and batch that
  ran). No device entry has one: without it every kind keeps up with its
  weight stream.
* An attention chunk's past cache rows (ATTN's K/V, MLA_ATTN's latent
  rows) are hinted into L2 by the controller before the chunk's wait
  (kernel/ops/kv_hint.py): when it moves on to the instruction, once it has
  published the one before and the instruction's ring slot is free. They
  stream from then on like routed rows (the SM's bandwidth first), each SM
  its slice of the chunk's blocks, up to ``KV_HINT_BYTES``; the rows read
  at execution are the rest (``Cost.early_bytes``: what the SM hints).
  The controller's own time to walk the block table is not modelled.
  A chunk's rows count as the kernel reads them: ATTN a request's once a
  query row (a verify step's rows each their own); MLA_ATTN once a pass
  over the request (``planner.mla_passes``: a row's pass, or in a verify
  step's shared pass the request's rows and the group's heads together,
  up to two tiles of 16 a pass). The walk meets a request's blocks once a
  row, so a verify step's rows spend the hint budget on repeats.
* The weight-read floor is all weight bytes at the full copy bandwidth.

GPU measurements update ``DEVICES``. Its figures are predictions
(docs/predictions.md, with the model's measured error), never results.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

from vllm_ext.megakernel.isa import NO_COUNTER, Instruction, Op

# Instructions the kernel's controller may run ahead of its consumers
# (kernel/control.py's QUEUE_SLOTS; a test keeps the two equal, and this
# module free of the kernel's imports).
QUEUE_SLOTS = 4
# An attention chunk's past cache rows one SM hints into L2, at most
# (kernel/ops/kv_hint.py's KV_HINT_BYTES; the same test keeps them equal).
KV_HINT_BYTES = 96 * 1024
# Instructions a routed EXPERT_UP tile hints ahead of itself
# (kernel/ops/expert_up.py's ROUTED_AHEAD; the same test keeps them equal).
ROUTED_AHEAD = 3


@dataclass(frozen=True)
class Device:
    name: str
    arch: str
    num_sms: int
    # Achieved large device-to-device copy, bytes/s (read + write counted
    # once each, i.e. what a weight stream can reach).
    hbm_bytes_per_s: float
    smem_bytes: int  # shared memory per SM for the weight pipeline
    l2_bytes: int  # L2 cache, half of which weight prefetches may use
    dependency_latency_s: float = 1.0e-6
    instruction_overhead_s: float = 0.3e-6
    # Tensor parallel (ALL_REDUCE): the GPU's NVLink bandwidth each way,
    # bytes/s, shared by its SMs, and how much later than a local one a
    # signal from another GPU is seen (neither measured here: datasheet
    # bandwidth, an assumed latency; predictions only).
    link_bytes_per_s: float = 450e9
    peer_latency_s: float = 2.0e-6
    # (opcode name, seconds per byte): what executing an instruction of that
    # kind costs per byte it moves beyond the stream (``exec_s``); from
    # ``calibrate`` only, for the kernel and batch of the case it fitted.
    exec_s_per_byte: tuple[tuple[str, float], ...] = ()
    source: str = ""

    @property
    def sm_bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s / self.num_sms

    @property
    def lookahead_bytes(self) -> int:
        return self.smem_bytes + self.l2_bytes // 2 // self.num_sms


DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device(
            "h200", "sm_90a", 132, 4.3e12, 200 * 1024, 50 << 20,
            instruction_overhead_s=0.9e-6,
            source="copy bandwidth measured on an H200 (shared/GUIDE.md); the "
            "instruction overhead from the all-NOP program on one (2026-11-30: "
            "74 us over the 1B's longest queue, 83 instructions)",
        ),
        Device(
            "h100", "sm_90a", 132, 3.0e12, 200 * 1024, 50 << 20,
            source="not measured here: 90% of the 3.35 TB/s datasheet figure",
        ),
        Device(
            "b200", "sm_100a", 148, 7.2e12, 200 * 1024, 126 << 20,
            link_bytes_per_s=900e9,
            source="not measured here: 90% of the 8 TB/s datasheet figure",
        ),
    )
}  # fmt: skip
DEFAULT_DEVICE = {"sm_90a": "h200", "sm_100a": "b200"}


@dataclass(frozen=True)
class Cost:
    """Bytes one instruction moves: weights (prefetchable), the rest
    (activations, KV cache: read once its wait is met), and the KV cache
    rows the SM hints into L2 before the wait (``early_bytes``; not
    weights, and not in ``other_bytes``)."""

    weight_bytes: int
    other_bytes: int
    early_bytes: int = 0
    # Read from other GPUs over NVLink (an ALL_REDUCE's peers' partials).
    link_bytes: int = 0


@dataclass(frozen=True)
class Prediction:
    step_s: float
    floor_s: float
    sm_finish_s: tuple[float, ...]
    sm_weight_bytes: tuple[int, ...]
    critical_path_s: float

    @property
    def fraction_of_floor(self) -> float:
        """floor / predicted: 1.0 means the weight stream never stalls."""
        return self.floor_s / self.step_s


def exec_s(device: Device, instr, cost: Cost) -> float:
    """Executing ``instr`` (moving ``cost``) once its weights are in and its
    wait is met: the instruction overhead, its activation and KV bytes at the
    SM's share of bandwidth, and its kind's calibrated term per byte."""
    t = device.instruction_overhead_s + cost.other_bytes / device.sm_bytes_per_s
    if cost.link_bytes:
        t += cost.link_bytes / (device.link_bytes_per_s / device.num_sms)
    for name, per_byte in device.exec_s_per_byte:
        if name == instr.op.name:
            moved = cost.weight_bytes + cost.other_bytes + cost.early_bytes
            return t + per_byte * moved
    return t


def predict(
    program, device: Device | None = None, lookahead_bytes: int | None = None
) -> Prediction:
    """Simulate ``program`` (a planner.Program) under the assumptions above;
    ``lookahead_bytes``: a kernel's own lookahead per SM in place of the
    device's (``calibrate.kernel_lookahead_bytes``)."""
    device = device or program.device
    window = device.lookahead_bytes if lookahead_bytes is None else lookahead_bytes
    bw = device.sm_bytes_per_s
    queues = program.queues
    costs = [[program.step_cost(i) for i in q] for q in queues]
    # Per instruction, the routed rows a step reads (their own stream) and
    # the rest (the in-order stream).
    routed = [
        [_routed_step_bytes(program, i, c) for i, c in zip(q, cs, strict=True)]
        for q, cs in zip(queues, costs, strict=True)
    ]
    routing = [_routing_times(program, q, device) for q in queues]
    # When each instruction's in-order weights are in, per SM (the stream
    # never waits for a dependency).
    streams: list[_Stream] = []
    for sm_costs, sm_routed in zip(costs, routed, strict=True):
        total, cum = 0, []
        for c, r in zip(sm_costs, sm_routed, strict=True):
            total += c.weight_bytes - r
            cum.append(total)
        streams.append(_Stream(cum, bw))
    # The controller: when it published each SM's last instruction, and
    # when that SM's routed stream (routed rows, hinted KV rows) is free; the
    # SM's instruction ends.
    published = [0.0] * len(queues)
    routed_free = [0.0] * len(queues)
    ends: list[list[float]] = [[] for _ in queues]

    # Event simulation: an SM's next instruction is scheduled once its wait
    # is met; instructions start in time order (ends are never earlier than
    # the start of the instruction that signalled them).
    need = {i.wait_counter: i.wait_count for q in queues for i in q}
    # Counters other GPUs signal too: their waits see the last signal later.
    peer = {i.signal_counter for q in queues for i in q if i.signal_ranks}
    # Per counter: the signals so far, and when the latest arrived.
    signals: dict[int, int] = {}
    latest: dict[int, float] = {}
    blocked: dict[int, list[int]] = {}
    pos = [0] * len(queues)
    hinted: list[dict[int, float]] = [{} for _ in queues]  # routed rows in
    kv_in: list[dict[int, float]] = [{} for _ in queues]  # hinted KV rows in
    finish = [0.0] * len(queues)
    heap: list[tuple[float, int]] = []

    def schedule(sm: int) -> None:
        if pos[sm] == len(queues[sm]):
            return
        instr = queues[sm][pos[sm]]
        k = pos[sm]
        slot_free = ends[sm][k - QUEUE_SLOTS] if k >= QUEUE_SLOTS else 0.0
        early = costs[sm][k].early_bytes
        if early and k not in kv_in[sm]:
            # The controller reached it: the instruction before published,
            # its ring slot free. (The first call for k: k - 1 has ended.)
            rs = max(published[sm], slot_free, routed_free[sm])
            dt = early / bw
            routed_free[sm] = rs + dt
            streams[sm].yield_to(k, rs, dt)
            kv_in[sm][k] = rs + dt
        ready = 0.0
        if instr.wait_counter != NO_COUNTER:
            if signals.get(instr.wait_counter, 0) < need[instr.wait_counter]:
                blocked.setdefault(instr.wait_counter, []).append(sm)
                return
            ready = latest[instr.wait_counter] + device.dependency_latency_s
            if instr.wait_counter in peer:
                ready += device.peer_latency_s
        published[sm] = max(published[sm], ready, slot_free)
        weights_in = max(streams[sm].done(k), kv_in[sm].pop(k, 0.0))
        hints: list[tuple[int, float]] = []  # (instruction, hinted at)
        if _routed_up(program, instr):
            # Its consumers hint routed rows once free, after the routing if
            # this tile computes it (kernel/ops/expert_up.py).
            at = max(published[sm], finish[sm]) + routing[sm].get(k, 0.0)
            hints = [(j, at) for j in _hinted_by(program, queues[sm], k, routing[sm])]
        elif routed[sm][k] and k not in hinted[sm]:
            hints = [(k, published[sm])]  # (by the controller)
        for j, at in hints:
            rs, dt = max(at, routed_free[sm]), routed[sm][j] / bw
            routed_free[sm] = rs + dt
            streams[sm].yield_to(k, rs, dt)
            hinted[sm][j] = rs + dt
        if k in hinted[sm]:
            weights_in = max(weights_in, hinted[sm].pop(k))
        heapq.heappush(heap, (max(finish[sm], ready, weights_in), sm))

    for sm in range(len(queues)):
        schedule(sm)
    while heap:
        start, sm = heapq.heappop(heap)
        instr, cost = queues[sm][pos[sm]], costs[sm][pos[sm]]
        end = start + exec_s(device, instr, cost)
        streams[sm].stall(pos[sm], end, window)
        finish[sm] = end
        ends[sm].append(end)
        pos[sm] += 1
        schedule(sm)
        counter = instr.signal_counter
        if counter != NO_COUNTER:
            # A signal to every tensor-parallel rank: the other ranks run
            # the same program alike (one rank is modelled), so theirs
            # arrive with it.
            by = program.spec.tp_size if instr.signal_ranks else 1
            signals[counter] = signals.get(counter, 0) + by
            latest[counter] = max(latest.get(counter, end), end)
            if signals[counter] == need.get(counter):
                for waiter in blocked.pop(counter, []):
                    schedule(waiter)
    if any(p != len(q) for p, q in zip(pos, queues, strict=True)):
        raise ValueError("program deadlocks (run the verifier)")

    weight_bytes = tuple(sum(c.weight_bytes for c in q) for q in costs)
    floor = program.weight_bytes() / device.hbm_bytes_per_s
    return Prediction(
        step_s=max(finish),
        floor_s=floor,
        sm_finish_s=tuple(finish),
        sm_weight_bytes=weight_bytes,
        critical_path_s=_critical_path(program, costs, routing, device),
    )


def _routing_times(program, queue, device: Device) -> dict[int, float]:
    """Per queue index, the routing a routed EXPERT_UP tile computes before
    its rows stream: the SM's first routed tile of each layer, as long as
    the layer's TOPK instruction takes to execute (the same work); the
    next ones of the layer reuse it (kernel/ops/expert_up.py)."""
    times: dict[int, float] = {}
    seen: set[int] = set()
    for k, instr in enumerate(queue):
        if _routed_up(program, instr) and instr.layer not in seen:
            seen.add(instr.layer)
            topk = Instruction(Op.TOPK, instr.layer, 0, 0)
            times[k] = exec_s(device, topk, program.cost(topk))
    return times


class _Stream:
    """When each of one SM's in-order weight loads is in (``done(k)``).

    The loads follow each other at the SM's bandwidth (``cum``: bytes up to
    and including load k), so load k is in at ``lag(k) + cum[k] / bw``
    where the lag never falls from one load to the next. Both events raise
    the lag of a suffix of the queue to at least some value: a lookahead
    stall the loads past the window, a routed transfer the load in flight
    and those after it. So the lags are a step function, kept as its steps
    (``starts``, ``lags``): an event costs the steps it merges, not the
    rest of the queue (Kimi-K2 at batch 64 has 6,000 instructions a queue;
    walking them per event made ``predict`` quadratic)."""

    def __init__(self, cum: list[int], bw: float) -> None:
        self.cum, self.bw = cum, bw
        self.starts: list[int] = [0]
        self.lags: list[float] = [0.0]

    def _step(self, k: int) -> int:
        return bisect.bisect_right(self.starts, k) - 1

    def done(self, k: int) -> float:
        return self.lags[self._step(k)] + self.cum[k] / self.bw

    def _raise_from(self, k: int, lag: float) -> None:
        """Loads k, k + 1, .. are in no earlier than ``lag + cum / bw``."""
        i = self._step(k)
        if self.lags[i] >= lag:
            return  # (and so are the steps after it)
        end = bisect.bisect_left(self.lags, lag, lo=i)
        head = self.starts[i] < k
        self.starts[i:end] = [self.starts[i], k] if head else [k]
        self.lags[i:end] = [self.lags[i], lag] if head else [lag]

    def stall(self, executed: int, now: float, window: int) -> None:
        """Instruction ``executed`` ends at ``now`` and frees its buffer:
        bytes past ``window`` beyond everything consumed so far could not
        have arrived before ``now``."""
        past = self.cum[executed] + window
        first = max(executed + 1, bisect.bisect_right(self.cum, past))
        if first < len(self.cum):
            self._raise_from(first, now - past / self.bw)

    def yield_to(self, k: int, start: float, dt: float) -> None:
        """Routed rows take the SM's bandwidth over [start, start + dt): the
        in-order loads from ``k`` on lose that time, a transfer in flight at
        ``start`` by all of it, one that would start inside the interval
        until its end, and the loads after them follow them; idle time in
        the stream (a lookahead stall) absorbs it."""
        j = self._first_after(k, start)
        if j is None:
            return
        t, b = self.done(j), (self.cum[j] - (self.cum[j - 1] if j else 0)) / self.bw
        t = t + dt if t - b < start else max(t, start + dt + b)
        self._raise_from(j, t - self.cum[j] / self.bw)

    def _first_after(self, k: int, start: float) -> int | None:
        """The first load from k on that is in after ``start``."""
        for i in range(self._step(k), len(self.starts)):
            lo = max(k, self.starts[i])
            hi = self.starts[i + 1] if i + 1 < len(self.starts) else len(self.cum)
            lag = self.lags[i]
            j = bisect.bisect_right(
                self.cum, start, lo, hi, key=lambda c, lag=lag: lag + c / self.bw
            )
            if j < hi:
                return j
        return None


def _routed_up(program, instr) -> bool:
    """A routed expert's EXPERT_UP tile (its slot filled or not)."""
    return instr.op == Op.EXPERT_UP and instr.arg0 != program.shared_slot


def _hinted_by(program, queue, k: int, routing: dict[int, float]) -> list[int]:
    """The instructions whose routed rows routed EXPERT_UP tile k hints
    (kernel/ops/expert_up.py's hint_routed): its own and the next
    ``ROUTED_AHEAD`` if it computes the routing (``routing``), else the one
    ``ROUTED_AHEAD`` after it; each with the layer's EXPERT_DOWN tiles that
    follow it, if any."""
    layer = queue[k].layer
    first = k if k in routing else k + ROUTED_AHEAD
    out: list[int] = []
    for p in range(first, min(k + ROUTED_AHEAD + 1, len(queue))):
        if queue[p].layer != layer or not _routed_up(program, queue[p]):
            continue
        out.append(p)
        p += 1
        while p < len(queue) and queue[p].op == Op.EXPERT_DOWN:
            if queue[p].layer != layer:
                break
            out.append(p)
            p += 1
    return out


def _routed_step_bytes(program, instr, step_cost: Cost) -> int:
    """The routed rows ``instr`` reads in a step (``step_cost``: its cost
    with the expected experts filled); the rest of its weights are
    static."""
    r = program.routed_weight_bytes(instr)
    if not r:
        return 0
    return r - (program.cost(instr).weight_bytes - step_cost.weight_bytes)


def _critical_path(program, costs, routing, device: Device) -> float:
    """Longest chain of waits and queue order, counting only execution (as if
    every weight were already on chip; ``routing``: each SM's routed tiles'
    routing times, ``_routing_times``): the latency floor of the program."""
    by_counter: dict[int, float] = {}
    sm_end: dict[int, float] = {}
    done = 0.0
    # Phases appear in global order in every queue, so one pass over the
    # instructions in that order sees every signaller before its waiters.
    for sm, idx, instr in program.in_global_order():
        ready = sm_end.get(sm, 0.0)
        if instr.wait_counter != NO_COUNTER:
            ready = max(ready, by_counter.get(instr.wait_counter, 0.0)
                        + device.dependency_latency_s)  # fmt: skip
            if instr.op == Op.ALL_REDUCE:  # (its wait: on every rank's tiles)
                ready += device.peer_latency_s
        end = ready + exec_s(device, instr, costs[sm][idx])
        end += routing[sm].get(idx, 0.0)
        c = instr.signal_counter
        if c != NO_COUNTER:
            by_counter[c] = max(by_counter.get(c, 0.0), end)
        sm_end[sm] = end
        done = max(done, end)
    return done
