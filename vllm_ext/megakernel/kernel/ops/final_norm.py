# SPDX-License-Identifier: Apache-2.0
"""FINAL_NORM (reference: ``ops/final_norm.py``): out[:, lo:hi] =
RMSNorm(h_last)[:, lo:hi]; every tile recomputes the row statistic."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from vllm_ext.megakernel.kernel.ops.common import (
    NUM_THREADS,
    gmem,
    row_rstd,
    thread_ids,
)
from vllm_ext.megakernel.kernel.shape import GlobalSlot, KernelShape


@cute.jit
def final_norm(s: cutlass.Constexpr, ptrs: cute.Tensor, glob, lo, hi, rstd):
    shape: KernelShape = s
    b, h = shape.batch, shape.hidden
    x = gmem(BFloat16, ptrs[glob, GlobalSlot.H_LAST], (b, h))
    w = gmem(BFloat16, ptrs[glob, GlobalSlot.FINAL_NORM], (h,))
    out = gmem(BFloat16, ptrs[glob, GlobalSlot.OUT], (b, h))
    row_rstd(x, rstd, shape.rms_norm_eps)
    tidx, _, _ = thread_ids()
    width = hi - lo
    for idx in cutlass.range(tidx, b * width, NUM_THREADS):
        i, col = idx // width, lo + idx % width
        y = x[i, col].to(Float32) * rstd[i] * w[col].to(Float32)
        out[i, col] = y.to(BFloat16)
        if cutlass.const_expr(shape.planted_bug == "oob-store"):
            # Planted for the GPU check: the last row is written one element
            # too long, so one bf16 lands just past the end of ``out``; every
            # in-bounds value stays right (only a guard or memcheck sees it).
            if i == b - 1 and col == h - 1:
                out[i, col + 1] = y.to(BFloat16)
