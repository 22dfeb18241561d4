# SPDX-License-Identifier: Apache-2.0
"""The persistent kernel's control: what a CTA does around each instruction
(``isa.py`` words), apart from executing it (``ops/``).

* ``queue.fetch``: the instruction's words into registers.
* ``wait_inputs`` (thread 0): poll the wait counter with a bounded spin
  until it reaches ``epoch * count``; past ``max_spins`` polls print the
  opcode, SM, pc, counter, expected and seen value, then trap (a broken
  program ends the kernel, never hangs the GPU). The polls are relaxed,
  then one acquire load once the count is met (the validated default), or
  (``stage_queue``) every poll is an acquire load, so a wait already met
  costs one L2 round trip, not two.
* ``signal_done`` (thread 0, after a CTA barrier: every thread's stores are
  issued): add 1 to the signal counter with a release atomic at GPU scope;
  with ``fused_combine`` an ATTN's atomic is acq_rel and tells whether its
  chunk completed the head, whose merge the CTA then runs (``run_tail``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.kernel.ops.combine import combine
from vllm_ext.megakernel.kernel.ops.weight_pipe import BASE, top_up
from vllm_ext.megakernel.kernel.sync import nanosleep, trap

POLL_NS = 32


@cute.jit
def wait_inputs(s: cutlass.Constexpr, counters: cute.Tensor, ins: cute.Tensor, epoch,
                sm, pc, max_spins, pipe: cutlass.Constexpr):  # fmt: skip
    """Thread 0: return once instruction ``ins``'s wait is met (at once
    without one). With the weight pipeline (``pipe``, else None), pages keep
    streaming while the inputs are awaited."""
    poll = "acquire" if s.stage_queue else "relaxed"
    if ins[4] >= 0:
        target = epoch * ins[5]
        ptr = counters.iterator + ins[4]
        seen = cute.arch.load(ptr, Int32, sem=poll, scope="gpu")
        spins = Int32(0)
        # Compared by difference: counters and targets wrap mod 2^32
        # together, so a server never overflows them.
        while seen - target < 0:
            spins = spins + 1
            if spins > max_spins:
                cute.printf(
                    "megakernel: wait timeout: opcode %d sm %d pc %d "
                    "counter %d expected %d seen %d\n",
                    ins[0], sm, pc, ins[4], target, seen,
                )  # fmt: skip
                trap()
            if cutlass.const_expr(s.weight_pipe):
                top_up(pipe, pipe.state[BASE])
            nanosleep(Int32(POLL_NS))
            seen = cute.arch.load(ptr, Int32, sem=poll, scope="gpu")
        if cutlass.const_expr(poll == "relaxed"):
            # Acquire: the producers' stores are visible from here on. (An
            # acquire load whose value is unused is dropped by the compiler.)
            seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
            if seen - target < 0:
                trap()


@cute.jit
def signal_done(s: cutlass.Constexpr, counters: cute.Tensor, ins: cute.Tensor, op,
                epoch, tail: cute.Tensor):  # fmt: skip
    """Thread 0, after the CTA barrier that ends the instruction: signal
    its counter. With ``fused_combine``, ``tail[0]`` becomes 1 when this
    ATTN chunk completed its head (its atomic returned ``epoch * chunks -
    1``), else 0."""
    if cutlass.const_expr(s.fused_combine):
        tail[0] = Int32(0)
        if op == Op.ATTN and ins[7] >= 0:
            # Acquire too: the chunk that completes the head reads the other
            # chunks' partials next.
            old = cute.arch.atomic_add(counters.iterator + ins[6], Int32(1),
                                       sem="acq_rel", scope="gpu")  # fmt: skip
            if old + 1 - epoch * s.attn_chunks == 0:
                tail[0] = Int32(1)
        elif ins[6] >= 0:
            cute.arch.atomic_add(counters.iterator + ins[6], Int32(1),
                                 sem="release", scope="gpu")  # fmt: skip
    elif ins[6] >= 0:
        cute.arch.atomic_add(
            counters.iterator + ins[6], Int32(1), sem="release", scope="gpu"
        )


@cute.jit
def run_tail(s: cutlass.Constexpr, ptrs: cute.Tensor, counters: cute.Tensor,
             ins: cute.Tensor, layer, g, tail: cute.Tensor):  # fmt: skip
    """Every thread, after an ATTN with ``fused_combine``: the chunk that
    completed kv head ``g`` merges its partials and signals ``ins[7]``."""
    tidx, _, _ = cute.arch.thread_idx()
    cute.arch.sync_threads()
    if tail[0] != 0:
        combine(s, ptrs, layer, g)
        cute.arch.sync_threads()
        if tidx == 0:
            cute.arch.atomic_add(counters.iterator + ins[7], Int32(1),
                                 sem="release", scope="gpu")  # fmt: skip
