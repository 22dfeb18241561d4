# SPDX-License-Identifier: Apache-2.0
"""PTX the DSL has no wrapper for: ``trap`` (end a hung wait loudly),
``nanosleep`` (back off between polls of a counter) and a bulk L2 prefetch
(start a weight stream before its instruction may run); and the one bounded
mbarrier wait every ring of the kernel uses (``wait_mbarrier``)."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None, [], "trap;", "", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )  # fmt: skip


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


@cute.jit
def wait_mbarrier(mbar, parity, max_spins, speak, what: cutlass.Constexpr, sm, idx):
    """Return once the phase of parity ``parity`` of the mbarrier at
    ``mbar`` has completed. Bounded like the counter waits: non-blocking
    tests ``MBAR_POLL_NS`` apart (``try_wait`` may suspend for a
    system-dependent time, which would leave the bound unknown; and
    cutlass.pipeline's waits have no bound at all); past ``max_spins`` the
    threads with ``speak`` print ``what`` with the SM and index, then all
    trap: a broken schedule ends the kernel, never hangs the GPU."""
    spins = Int32(0)
    while not cute.arch.mbarrier_test_wait(mbar, parity):
        spins = spins + 1
        if spins > max_spins:
            if speak:
                cute.printf("megakernel: " + what + " timeout: sm %d index %d\n",
                            sm, idx)  # fmt: skip
            trap()
        nanosleep(Int32(MBAR_POLL_NS))
