# SPDX-License-Identifier: Apache-2.0
"""ROUTE (reference: ``ops/route.py``): logits[:, lo:hi] = RMSNorm(hmid) @
Wr[lo:hi].T, fp32 accumulation, stored bf16: GATE_UP's normed GEMV on the
router's rows, with one matrix."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16

from vllm_ext.megakernel.kernel.ops.common import (
    gmem,
    row_rstd,
    stage_normed,
    stages_input,
)
from vllm_ext.megakernel.kernel.ops.gemv import gemv
from vllm_ext.megakernel.kernel.shape import KernelShape, LayerSlot


@cute.jit
def route(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, lo, hi, rstd, x_stage):
    shape: KernelShape = s
    b, h = shape.batch, shape.hidden
    w = gmem(BFloat16, ptrs[layer, LayerSlot.ROUTER], (shape.num_experts, h))
    x = gmem(BFloat16, ptrs[layer, LayerSlot.HMID], (b, h))
    norm = gmem(BFloat16, ptrs[layer, LayerSlot.POST_NORM], (h,))
    logits = gmem(BFloat16, ptrs[layer, LayerSlot.ROUTER_LOGITS],
                  (b, shape.router_stride))  # fmt: skip
    row_rstd(x, rstd, shape.rms_norm_eps)

    def epilogue(row, i, s1, _):
        logits[i, row] = s1.to(BFloat16)

    if cutlass.const_expr(stages_input(shape)):
        stage_normed(x, norm, rstd, x_stage)
        gemv(w, w, x_stage, norm, rstd, lo, hi, epilogue, False, False)
    else:
        gemv(w, w, x, norm, rstd, lo, hi, epilogue, True, False)
