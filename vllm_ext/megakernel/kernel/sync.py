# SPDX-License-Identifier: Apache-2.0
"""PTX the DSL has no wrapper for: ``trap`` (end a hung wait loudly) and
``nanosleep`` (back off between polls of a counter)."""

from cutlass import Int32
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
