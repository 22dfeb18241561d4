# SPDX-License-Identifier: Apache-2.0
"""PTX the DSL has no wrapper for: ``nanosleep`` (back off between polls of
a counter) and a bulk L2 prefetch (start a weight stream before
its instruction may run); the one bounded mbarrier wait every ring of the
kernel uses (``wait_mbarrier``); and the abort record a wait writes when
its bound expires (``record_abort``, ``abort_set``).

A wait past its bound never traps (a trap kills the CUDA context, and vLLM
with it): it records where it waited, if no wait did before it, and stops
waiting. The other CTAs' waits on counters see the record and stop waiting
too (control.wait_inputs), and so do the waits inside a CTA (its rings,
``wait_mbarrier``), so every CTA runs through its queue without waiting
and leaves. The host reads the record after the step (the backend's
``step_status``) and fails the step: its results are garbage."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from vllm_ext.megakernel.kernel.shape import (
    ABORT_WORDS,
    AbortWhat,
    AbortWord,
    GlobalSlot,
)


@dsl_user_op
def nanosleep(ns: Int32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None, [Int32(ns).ir_value(loc=loc, ip=ip)], "nanosleep.u32 $0;", "r",
        has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def prefetch_l2(addr: Int64, size: Int32, *, loc=None, ip=None) -> None:
    """``cp.async.bulk.prefetch.L2``: ``size`` bytes (a multiple of 16) from
    ``addr`` into L2, asynchronously, no completion to wait for (sm_90+)."""
    llvm.inline_asm(
        None,
        [Int64(addr).ir_value(loc=loc, ip=ip), Int32(size).ir_value(loc=loc, ip=ip)],
        "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r",
        has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )  # fmt: skip


# Between non-blocking tests of an mbarrier (as between counter polls).
MBAR_POLL_NS = 32
# Polls of a wait between two reads of the abort record: a wait that lasts
# this long (about 2 us) is rare; a read on every poll would put every
# waiting CTA on one L2 line.
ABORT_POLL = 64


def abort_record(ptrs: cute.Tensor, glob) -> cute.Tensor:
    """The abort record (``shape.AbortWord``), its address read from the
    table where it is needed: the waits' cold paths, so no register holds
    it while the kernel runs."""
    ptr = cute.make_ptr(Int32, ptrs[glob, GlobalSlot.ABORT], cute.AddressSpace.gmem,
                        assumed_align=16)  # fmt: skip
    return cute.make_tensor(ptr, cute.make_layout(ABORT_WORDS))


def abort_set(ptrs: cute.Tensor, glob):
    """Whether a wait of this step (or of an earlier one) expired."""
    flag = abort_record(ptrs, glob).iterator + AbortWord.FLAG
    return cute.arch.load(flag, Int32, sem="relaxed", scope="gpu") != 0


@cute.jit
def record_abort(ptrs: cute.Tensor, glob, what: cutlass.Constexpr, sm, index,
                 counter, expected, seen, batch: cutlass.Constexpr):  # fmt: skip
    """One thread whose wait expired: claim the record, unless a wait claimed
    it before, and say where it waited. The host reads it once the kernel
    has ended (which orders these plain stores before the read)."""
    rec = abort_record(ptrs, glob)
    old = cute.arch.atomic_cas(rec.iterator + AbortWord.FLAG, cmp=Int32(0),
                               val=Int32(1), sem="relaxed", scope="gpu")  # fmt: skip
    if old == 0:
        rec[AbortWord.SM] = sm
        rec[AbortWord.INDEX] = index
        rec[AbortWord.COUNTER] = counter
        rec[AbortWord.EXPECTED] = expected
        rec[AbortWord.SEEN] = seen
        rec[AbortWord.WHAT] = Int32(AbortWhat[what].value)
        rec[AbortWord.BATCH] = Int32(batch)


@cute.jit
def wait_mbarrier(mbar, parity, max_spins, speak, what: cutlass.Constexpr, sm, idx,
                  ptrs: cute.Tensor, glob, batch: cutlass.Constexpr):  # fmt: skip
    """Return once the phase of parity ``parity`` of the mbarrier at
    ``mbar`` has completed, or the wait expired. Bounded like the counter
    waits: non-blocking tests ``MBAR_POLL_NS`` apart (``try_wait`` may
    suspend for a system-dependent time, which would leave the bound
    unknown; and cutlass.pipeline's waits have no bound at all). Past
    ``max_spins`` the thread with ``speak`` records the abort (``what``: an
    ``AbortWhat`` name, the SM and index); every thread stops waiting. It
    stops too once another wait's abort is recorded (read every
    ``ABORT_POLL`` polls): a CTA whose consumers wait on a hung counter
    holds its producer's waits for free pages, and without the read each
    of those would run to its own bound in turn. Nothing prints: the host
    reads the record, and the kernel keeps no call (a printf's ABI call
    kept loop values in the stack)."""
    spins = Int32(0)
    done = cute.arch.mbarrier_test_wait(mbar, parity)
    while not done:
        spins = spins + 1
        if spins > max_spins:
            if speak:
                record_abort(ptrs, glob, what, sm, idx, Int32(-1), parity,
                             Int32(0), batch)  # fmt: skip
            done = cutlass.Boolean(True)
        else:
            nanosleep(Int32(MBAR_POLL_NS))
            done = cute.arch.mbarrier_test_wait(mbar, parity)
            if (not done) & (spins % ABORT_POLL == 0):
                done = abort_set(ptrs, glob)
