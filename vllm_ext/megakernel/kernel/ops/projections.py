# SPDX-License-Identifier: Apache-2.0
"""O_PROJ, GATE_UP, DOWN and LM_HEAD: the GEMV core with their epilogues
(references: ``ops/o_proj.py``, ``ops/gate_up.py``, ``ops/down.py``,
``ops/lm_head.py``). They differ only in operands and the epilogue, so they
share one module rather than four copies of the same call."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from vllm_ext.megakernel.isa import Op, Point
from vllm_ext.megakernel.kernel.ops.all_reduce import own_partials
from vllm_ext.megakernel.kernel.ops.common import (
    gmem,
    round_bf16,
    row_rstd,
    stage_normed,
    stages_input,
)
from vllm_ext.megakernel.kernel.ops.gemv import gemv
from vllm_ext.megakernel.kernel.ops.gemv_paged import (
    fp8_input_scales,
    paged_gemv,
    weight_scales,
)
from vllm_ext.megakernel.kernel.ops.weight_pipe import reads_pages
from vllm_ext.megakernel.kernel.shape import GlobalSlot, KernelShape, LayerSlot


@cute.jit
def _residual_projection(
    s: cutlass.Constexpr, ptrs: cute.Tensor, layer, glob, lo, hi, rstd, w_stage,
    weight: cutlass.Constexpr, x: cutlass.Constexpr, k: cutlass.Constexpr,
    res: cutlass.Constexpr, out: cutlass.Constexpr, op: cutlass.Constexpr,
    point: cutlass.Constexpr, scale: cutlass.Constexpr,
):  # fmt: skip
    """table[out][:, lo:hi] = table[res][:, lo:hi] + table[x] @ W[lo:hi].T,
    W = table[weight] ``[hidden, k]``; the projection rounds to bf16, then
    the add does. With tensor parallel, the rank's partial sum of ``point``
    instead, rounded, no residual (ALL_REDUCE adds the ranks' and it)."""
    shape: KernelShape = s
    b, h = shape.batch, shape.hidden
    w = gmem(BFloat16, ptrs[layer, weight], (h, k))
    xs = gmem(BFloat16, ptrs[layer, x], (b, k))
    if cutlass.const_expr(shape.tp_size > 1):
        dst = own_partials(shape, ptrs, glob, Int32(point), layer)

        def epilogue(row, i, s1, _):
            dst[i, row] = s1.to(BFloat16)

    else:
        residual = gmem(BFloat16, ptrs[layer, res], (b, h))
        dst = gmem(BFloat16, ptrs[layer, out], (b, h))

        def epilogue(row, i, s1, _):
            y = round_bf16(s1) + residual[i, row].to(Float32)
            dst[i, row] = y.to(BFloat16)

    wscale = None
    if cutlass.const_expr(shape.dense_quantized):
        wscale = weight_scales(shape, ptrs[layer, scale], h, k)
    _plain_gemv(shape, w, xs, rstd, lo, hi, epilogue, w_stage, op, wscale)


@cute.jit
def _plain_gemv(
    s: cutlass.Constexpr, w, x, rstd, lo, hi, epilogue: cutlass.Constexpr, w_stage,
    op: cutlass.Constexpr, wscale=None,
):  # fmt: skip
    """The GEMV of a projection with no norm and one matrix: from the
    weight pipeline's pages, or (legacy control, rows wider than a page)
    from global memory. ``wscale``: a quantized projection's scales."""
    if cutlass.const_expr(reads_pages(w_stage, op)):
        if cutlass.const_expr(s.fp8 and wscale is not None):  # (not the LM head)
            fp8_input_scales(w_stage, x, x[0, None], rstd, False)
        paged_gemv(w_stage, op, 0, lo, hi, x, x[0, None], rstd, epilogue, False,
                   wscale)  # fmt: skip
    else:
        gemv(w, w, x, x[0, None], rstd, lo, hi, epilogue, False, False)


@cute.jit
def o_proj(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, glob, lo, hi, rstd,
           w_stage):  # fmt: skip
    """hmid[:, lo:hi] = h[:, lo:hi] + attn @ Wo[lo:hi].T"""
    _residual_projection(s, ptrs, layer, glob, lo, hi, rstd, w_stage,
                         LayerSlot.O_PROJ, LayerSlot.ATTN, s.q_size, LayerSlot.H_IN,
                         LayerSlot.HMID, Op.O_PROJ, Point.ATTN,
                         LayerSlot.O_PROJ_SCALE)  # fmt: skip


@cute.jit
def down(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, glob, lo, hi, rstd,
         w_stage):  # fmt: skip
    """h_out[:, lo:hi] = hmid[:, lo:hi] + act @ Wd[lo:hi].T"""
    _residual_projection(s, ptrs, layer, glob, lo, hi, rstd, w_stage, LayerSlot.DOWN,
                         LayerSlot.ACT, s.intermediate, LayerSlot.HMID,
                         LayerSlot.H_OUT, Op.DOWN, Point.MLP,
                         LayerSlot.DOWN_SCALE)  # fmt: skip


@cute.jit
def gate_up(
    s: cutlass.Constexpr, ptrs: cute.Tensor, layer, lo, hi, rstd, x_stage, w_stage
):
    """act[:, lo:hi] = SiLU(x @ Wg[lo:hi].T) * (x @ Wu[lo:hi].T),
    x = RMSNorm(hmid): gate row r and up row I + r share a warp."""
    shape: KernelShape = s
    b, h, inter = shape.batch, shape.hidden, shape.intermediate
    base = ptrs[layer, LayerSlot.GATE_UP]
    gate = gmem(BFloat16, base, (inter, h))
    up = gmem(BFloat16, base + inter * h * 2, (inter, h))  # bytes
    x = gmem(BFloat16, ptrs[layer, LayerSlot.HMID], (b, h))
    norm = gmem(BFloat16, ptrs[layer, LayerSlot.POST_NORM], (h,))
    act = gmem(BFloat16, ptrs[layer, LayerSlot.ACT], (b, inter))
    row_rstd(x, rstd, shape.rms_norm_eps)

    def epilogue(row, i, sg, su):
        g = round_bf16(sg)
        silu = g / (Float32(1.0) + cute.math.exp(-g))
        act[i, row] = (silu * round_bf16(su)).to(BFloat16)

    if cutlass.const_expr(reads_pages(w_stage, Op.GATE_UP)):
        ws, ws2 = None, None
        if cutlass.const_expr(shape.dense_quantized):
            scales = ptrs[layer, LayerSlot.GATE_UP_SCALE]
            ws = weight_scales(shape, scales, inter, h)
            # The up rows' scales (bytes; with blocks, whole blocks of gate;
            # INT4's bf16).
            size = 2 if shape.int4_group else 4
            ws2 = weight_scales(shape, scales + cute.size(ws) * size, inter, h)
        if cutlass.const_expr(stages_input(shape)):
            stage_normed(x, norm, rstd, x_stage)
            if cutlass.const_expr(shape.fp8):
                fp8_input_scales(w_stage, x_stage, norm, rstd, False)
            paged_gemv(w_stage, Op.GATE_UP, 0, lo, hi, x_stage, norm, rstd, epilogue,
                       False, ws, ws2)  # fmt: skip
        else:
            if cutlass.const_expr(shape.fp8):
                fp8_input_scales(w_stage, x, norm, rstd, True)
            paged_gemv(w_stage, Op.GATE_UP, 0, lo, hi, x, norm, rstd, epilogue, True,
                       ws, ws2)  # fmt: skip
    elif cutlass.const_expr(stages_input(shape)):
        stage_normed(x, norm, rstd, x_stage)
        gemv(gate, up, x_stage, norm, rstd, lo, hi, epilogue, False, True)
    else:
        gemv(gate, up, x, norm, rstd, lo, hi, epilogue, True, True)


@cute.jit
def lm_head(s: cutlass.Constexpr, ptrs: cute.Tensor, glob, lo, hi, rstd, w_stage):
    """logits[:, lo:hi] = out @ Wlm[lo:hi].T in fp32."""
    shape: KernelShape = s
    b, h, v = shape.batch, shape.hidden, shape.vocab
    w = gmem(BFloat16, ptrs[glob, GlobalSlot.LM_HEAD], (v, h))
    x = gmem(BFloat16, ptrs[glob, GlobalSlot.OUT], (b, h))
    logits = gmem(Float32, ptrs[glob, GlobalSlot.LOGITS], (b, v))

    def epilogue(row, i, s1, _):
        logits[i, row] = s1

    _plain_gemv(shape, w, x, rstd, lo, hi, epilogue, w_stage, Op.LM_HEAD)
