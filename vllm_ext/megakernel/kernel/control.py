# SPDX-License-Identifier: Apache-2.0
"""The persistent kernel's control: what a CTA does around each instruction
(``isa.py`` words), apart from executing it (``ops/``) and streaming its
weights (``ops/weight_pipe.py``).

Roles (the default kernel; ``persistent.py`` assigns the warps):

* The controller (one lane of the producer warpgroup, ``controller``):
  walks the queue ahead of the consumers. Per instruction it waits for a
  free slot of the instruction ring (``queue_empty``), copies the words into
  it, hints the weights of an instruction without pages and an attention
  chunk's past cache rows into L2 (``ops/kv_hint.py``), waits for
  the instruction's inputs (``wait_inputs``), hints an EXPERT_DOWN tile's
  rows into L2 (``prefetch_routed``: their addresses are known only now)
  unless a routed EXPERT_UP's consumers did, then arrives on the slot's
  ``queue_ready`` mbarrier. So the fetch and the poll of the next
  instruction's counter, and an EXPERT_DOWN tile's stream, run while the
  consumers execute the current one.
* The consumers (``NUM_THREADS`` threads): wait for ``queue_ready``
  (``wait_instruction``), execute, meet at their named barrier (every
  store issued), then thread 0 signals (``signal_done``) and frees the
  slot (``release_instruction``).

Memory model of a dependency: the producing SM's stores, its consumers'
named barrier, its release atomic at GPU scope; this CTA's controller's
acquire load at GPU scope that reads the count (it invalidates the SM's
L1, so no stale line survives); program order to the controller's
``mbarrier.arrive`` (release, CTA scope); the consumers' ``mbarrier``
test-wait that sees the phase (acquire, CTA scope); their loads. PTX's
causality order is transitive through release/acquire pairs of any scope
that includes both threads, so the producer's stores happen before the
consumers' loads without a further fence.

* ``wait_inputs`` (one thread): poll the wait counter with a bounded spin
  until it reaches ``epoch * count``; past ``max_spins`` polls record the
  abort (``sync.record_abort``: SM, pc, counter, expected and seen value;
  the host prints it) and stop waiting; every ``ABORT_POLL`` polls,
  stop waiting too if another wait recorded one. So a broken schedule ends
  the step, every CTA leaving (the host fails the step), never hangs the
  GPU nor kills its context. Relaxed polls, then one acquire load once the
  count is met.
* ``signal_done`` (thread 0, after the consumers' barrier: every
  consumer's stores are issued): add 1 to the signal counter with a release
  atomic at GPU scope; a tensor-parallel partial sum's to every rank's
  counter at system scope, which ALL_REDUCE's wait acquires at system scope
  (ops/all_reduce.py).

The legacy control (``KernelShape.legacy_control``) has no roles: thread 0
fetches, waits and signals between CTA barriers (the consumers' barrier is
then the whole CTA's).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from vllm_ext.megakernel.isa import WORDS, Op
from vllm_ext.megakernel.kernel.ops.common import gmem
from vllm_ext.megakernel.kernel.ops.expert_down import (
    prefetch_routed as prefetch_routed_down,
)
from vllm_ext.megakernel.kernel.ops.expert_down import routing_table_experts
from vllm_ext.megakernel.kernel.ops.kv_hint import hint_kv
from vllm_ext.megakernel.kernel.ops.prefetch import prefetch_weights
from vllm_ext.megakernel.kernel.ops.weight_pipe import instr_pages
from vllm_ext.megakernel.kernel.queue import downs_end, fetch
from vllm_ext.megakernel.kernel.shape import GlobalSlot
from vllm_ext.megakernel.kernel.sync import (
    ABORT_POLL,
    abort_set,
    nanosleep,
    record_abort,
    wait_mbarrier,
)

POLL_NS = 32
# Instructions the controller may run ahead of the consumers (one being
# executed, the next ones fetched and awaited).
QUEUE_SLOTS = 4


@dataclass(frozen=True)
class InstrRing:
    """The instruction ring in shared memory: slot ``pc % QUEUE_SLOTS``
    holds instruction ``pc``'s words once its ``queue_ready`` phase of
    parity ``(pc // QUEUE_SLOTS) % 2`` has completed; its ``queue_empty``
    phase of the same parity completes when the consumers are done with it.
    A trace-time bundle."""

    words: cute.Tensor  # [QUEUE_SLOTS, WORDS] int32
    ready: cute.Tensor  # [QUEUE_SLOTS] int64: queue_ready (the controller)
    empty: cute.Tensor  # [QUEUE_SLOTS] int64: queue_empty (consumer thread 0)
    length: cute.Tensor  # [1] int32: the queue's length (the consumers' bound)

    @classmethod
    def allocate(cls, smem) -> InstrRing:
        return cls(
            smem.allocate_tensor(
                Int32, cute.make_layout((QUEUE_SLOTS, WORDS), stride=(WORDS, 1)), 32
            ),
            smem.allocate_tensor(Int64, cute.make_layout(QUEUE_SLOTS), 8),
            smem.allocate_tensor(Int64, cute.make_layout(QUEUE_SLOTS), 8),
            smem.allocate_tensor(Int32, cute.make_layout(1), 4),
        )


def ring_bytes() -> list[int]:
    return [4 * QUEUE_SLOTS * WORDS, 8 * QUEUE_SLOTS, 8 * QUEUE_SLOTS, 4]


@cute.jit
def ring_init(r: cutlass.Constexpr, length):
    """Thread 0, before the start-up CTA barrier: one arrival each, and the
    queue's length."""
    r.length[0] = length
    for i in cutlass.range_constexpr(QUEUE_SLOTS):
        cute.arch.mbarrier_init(r.ready.iterator + i, 1)
        cute.arch.mbarrier_init(r.empty.iterator + i, 1)
    cute.arch.mbarrier_init_fence()


@cute.jit
def controller(s: cutlass.Constexpr, r: cutlass.Constexpr, q: cutlass.Constexpr,
               length, counters: cute.Tensor, epoch, max_spins, ptrs: cute.Tensor,
               glob, paged: cutlass.Constexpr, kv_block_stride,
               block_table_stride):  # fmt: skip
    """The controller lane: every instruction of the queue into the ring,
    published once its inputs are ready. ``paged``: the kernel has a weight
    ring (whose producer streams the paged instructions' weights)."""
    ins = cute.make_rmem_tensor((WORDS,), Int32)
    hinted = Int32(0)  # the routed rows of instructions below it are hinted
    for pc in cutlass.range(length):
        slot = pc % QUEUE_SLOTS
        if pc >= QUEUE_SLOTS:
            wait_mbarrier(r.empty.iterator + slot, (pc // QUEUE_SLOTS + 1) % 2,
                          max_spins, True, "INSTRUCTION_SLOT", q.sm, pc,
                          ptrs, glob, s.batch)  # fmt: skip
        fetch(q, pc, ins)
        for w in cutlass.range_constexpr(WORDS):
            r.words[slot, w] = ins[w]
        # Weight streams start before the wait (see ops/prefetch.py); the
        # producer streams those of instructions with pages.
        if cutlass.const_expr(paged):
            if instr_pages(s, ins[0], ins[2], ins[3]) == 0:
                prefetch_weights(s, ptrs, glob, ins[0], ins[1], ins[2], ins[3])
        else:
            prefetch_weights(s, ptrs, glob, ins[0], ins[1], ins[2], ins[3])
        # So do the past tokens' cache rows of an attention chunk.
        if cutlass.const_expr(s.mla):
            if ins[0] == Op.MLA_ATTN:
                hint_kv(s, ptrs, ins[1], glob, ins[2], s.mla_groups, ins[3],
                        kv_block_stride, block_table_stride)  # fmt: skip
        elif ins[0] == Op.ATTN:
            hint_kv(s, ptrs, ins[1], glob, ins[2], s.kv_heads, ins[3],
                    kv_block_stride, block_table_stride)  # fmt: skip
        wait_inputs(s, counters, ins, epoch, q.sm, pc, max_spins, ptrs, glob)
        hinted = prefetch_routed(s, q, ptrs, ins, pc, length, hinted)
        # Release at CTA scope: the words above and (through the acquire in
        # wait_inputs) the producers' stores, to the consumers' wait.
        cute.arch.mbarrier_arrive(r.ready.iterator + slot)


@cute.jit
def prefetch_routed(s: cutlass.Constexpr, q: cutlass.Constexpr, ptrs: cute.Tensor,
                    ins: cute.Tensor, pc, length, hinted):  # fmt: skip
    """The control's thread, right after ``wait_inputs`` met the wait of
    instruction ``pc``: an EXPERT_DOWN's expert rows into L2, unless hinted
    already (``pc < hinted``). Their addresses are TOPK's output, read here
    after the acquire load that met the wait (on EXPERT_UP's counter, which
    TOPK signals too), never earlier: so they are this step's, and they
    stream while the consumers finish the instructions before this one. A
    routed EXPERT_UP's consumers compute the routing themselves and hint
    its rows and those of the layer's EXPERT_DOWN tiles right behind it
    (``expert_up.hint_routed``): past one, those count as hinted. Returns
    the new ``hinted``."""
    if cutlass.const_expr(s.moe):
        op, layer = ins[0], ins[1]
        if pc >= hinted:
            if op == Op.EXPERT_DOWN:
                prefetch_routed_down(s, ptrs, layer, ins[2], ins[3],
                                     routing_table_experts(s, ptrs, layer))  # fmt: skip
        if op == Op.EXPERT_UP and ins[2] < s.num_slots:
            hinted = downs_end(q, layer, pc + 1, length)
    return hinted


@cute.jit
def wait_instruction(s: cutlass.Constexpr, r: cutlass.Constexpr, pc, ins: cute.Tensor,
                     max_spins, sm, ptrs: cute.Tensor, glob):  # fmt: skip
    """Every consumer thread: wait until instruction ``pc`` is published,
    then its words into ``ins``."""
    tidx, _, _ = cute.arch.thread_idx()
    slot = pc % QUEUE_SLOTS
    wait_mbarrier(r.ready.iterator + slot, (pc // QUEUE_SLOTS) % 2, max_spins,
                  tidx == 0, "INSTRUCTION", sm, pc, ptrs, glob,
                  s.batch)  # fmt: skip
    cute.autovec_copy(r.words[slot, None], ins)


@cute.jit
def release_instruction(r: cutlass.Constexpr, pc):
    """Consumer thread 0, after the consumers' barrier that ends
    instruction ``pc`` (every consumer has read its words)."""
    cute.arch.mbarrier_arrive(r.empty.iterator + pc % QUEUE_SLOTS)


@cute.jit
def wait_inputs(s: cutlass.Constexpr, counters: cute.Tensor, ins: cute.Tensor, epoch,
                sm, pc, max_spins, ptrs: cute.Tensor, glob):  # fmt: skip
    """One thread: return once instruction ``ins``'s wait is met (at once
    without one), or expired (recorded), or another wait's abort is seen."""
    if ins[4] >= 0:
        target = epoch * ins[5]
        ptr = counters.iterator + ins[4]
        seen = cute.arch.load(ptr, Int32, sem="relaxed", scope="gpu")
        spins = Int32(0)
        # Compared by difference: counters and targets wrap mod 2^32
        # together, so a server never overflows them.
        waiting = seen - target < 0
        while waiting:
            spins = spins + 1
            if spins > max_spins:
                record_abort(ptrs, glob, "INPUTS", sm, pc, ins[4], target,
                             seen, s.batch)  # fmt: skip
                waiting = cutlass.Boolean(False)
            else:
                nanosleep(Int32(POLL_NS))
                seen = cute.arch.load(ptr, Int32, sem="relaxed", scope="gpu")
                waiting = seen - target < 0
                if waiting & (spins % ABORT_POLL == 0):
                    waiting = not abort_set(ptrs, glob)
        if seen - target >= 0:
            # Acquire: the producers' stores are visible from here on. (An
            # acquire load whose value is unused is dropped by the
            # compiler; a counter never goes back, so this one is met too.)
            # ALL_REDUCE's producers are every rank's: system scope, as
            # their release.
            if cutlass.const_expr(s.tp_size > 1):
                if ins[0] == Op.ALL_REDUCE:
                    seen = cute.arch.load(ptr, Int32, sem="acquire", scope="sys")
                else:
                    seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
            else:
                seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
            if seen - target < 0:
                record_abort(ptrs, glob, "INPUTS", sm, pc, ins[4], target,
                             seen, s.batch)  # fmt: skip


@cute.jit
def signal_done(s: cutlass.Constexpr, counters: cute.Tensor, ins: cute.Tensor,
                ptrs: cute.Tensor, glob):  # fmt: skip
    """Thread 0, after the consumers' barrier that ends the instruction:
    signal its counter; a tensor-parallel partial sum's, on every rank
    (isa.signal_ranks), in rank order, at system scope: the ranks'
    ALL_REDUCE tiles read this rank's stores."""
    if ins[6] >= 0:
        if cutlass.const_expr(s.tp_size > 1):
            if ins[7] != 0:
                # One fence for all the ranks' adds (a release pattern
                # each), not a release fence an add, which would wait for the
                # previous rank's add to complete.
                peers = gmem(Int64, ptrs[glob, GlobalSlot.PEERS], (2, s.tp_size))
                cute.arch.fence_acq_rel_sys()
                for r in cutlass.range_constexpr(s.tp_size):
                    ctr = cute.make_ptr(Int32, peers[0, r], cute.AddressSpace.gmem,
                                        assumed_align=4)  # fmt: skip
                    cute.arch.atomic_add(ctr + ins[6], Int32(1), sem="relaxed",
                                         scope="sys")  # fmt: skip
            else:
                _signal_local(counters, ins)
        else:
            _signal_local(counters, ins)


@cute.jit
def _signal_local(counters: cute.Tensor, ins: cute.Tensor):
    cute.arch.atomic_add(
        counters.iterator + ins[6], Int32(1), sem="release", scope="gpu"
    )
