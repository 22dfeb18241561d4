# SPDX-License-Identifier: Apache-2.0
"""MLA_QKV_A (reference: ``ops/mla_qkv_a.py``): output columns [lo, hi) of
``RMSNorm(h) @ [Wq_a; Wkv_a].T`` (vLLM's one fused GEMM; kv_a alone without
a q LoRA), rounded to bf16. The two matrices stay two tensors (table
columns MLA_Q_A and MLA_KV_A): a tile's rows lie in one or both, so it
runs the GEMV core once per matrix on its share of [lo, hi). FP8 (a
quantized kernel's): the codes by ``gemv_quant``, its input quantized."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Uint8

from vllm_ext.megakernel.kernel.ops.common import (
    gmem,
    row_rstd,
    stage_normed,
    stages_input,
)
from vllm_ext.megakernel.kernel.ops.gemv import gemv
from vllm_ext.megakernel.kernel.ops.gemv_paged import weight_scales
from vllm_ext.megakernel.kernel.ops.gemv_quant import qgemv, staged_passes
from vllm_ext.megakernel.kernel.shape import KernelShape, LayerSlot


def _store(out: cute.Tensor, offset):
    """Epilogue: row ``row`` of a matrix is output column offset + row."""

    def epilogue(row, i, s1, _):
        out[i, offset + row] = s1.to(BFloat16)

    return epilogue


@cute.jit
def mla_qkv_a(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, lo, hi, rstd, x_stage,
              x_scales):  # fmt: skip
    shape: KernelShape = s
    if cutlass.const_expr(shape.dense_quantized):
        _quantized(shape, ptrs, layer, lo, hi, rstd, x_stage, x_scales)
    else:
        _bf16(shape, ptrs, layer, lo, hi, rstd, x_stage)


@cute.jit
def _quantized(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, lo, hi, rstd, x_stage,
               x_scales):  # fmt: skip
    """FP8: q_a's and kv_a's codes (two views of the fused layer's, their
    scales too: MLA_Q_A_SCALE, MLA_KV_A_SCALE) by ``gemv_quant.qgemv``, the
    normed input staged and quantized as vLLM's fused GEMM takes it (per
    token, or per group of 128), in passes (``staged_passes``)."""
    shape: KernelShape = s
    b, h, lora, lat = shape.batch, shape.hidden, shape.q_lora_rank, shape.latent_width
    norm = gmem(BFloat16, ptrs[layer, LayerSlot.INPUT_NORM], (h,))
    out = gmem(BFloat16, ptrs[layer, LayerSlot.QKV_A], (b, shape.mla_width))
    kv_a = gmem(Uint8, ptrs[layer, LayerSlot.MLA_KV_A], (lat, h))
    kv_s = weight_scales(shape, ptrs[layer, LayerSlot.MLA_KV_A_SCALE], lat, h)
    q_a = gmem(Uint8, ptrs[layer, LayerSlot.MLA_Q_A], (max(lora, 1), h))
    q_s = weight_scales(shape, ptrs[layer, LayerSlot.MLA_Q_A_SCALE], max(lora, 1), h)

    def body(xg, sg, j):
        def q_rows(row, i, s1, _):
            _store_row(out, j + i, b, row, s1)

        def kv_rows(row, i, s1, _):
            _store_row(out, j + i, b, lora + row, s1)

        if cutlass.const_expr(lora > 0):
            qgemv(shape, q_a, q_a, xg, sg, q_s, q_s, lo, cutlass.min(hi, lora),
                  q_rows, False)  # fmt: skip
        qgemv(shape, kv_a, kv_a, xg, sg, kv_s, kv_s, cutlass.max(lo, lora) - lora,
              hi - lora, kv_rows, False)  # fmt: skip

    staged_passes(shape, ptrs[layer, LayerSlot.H_IN], norm, None, b, rstd, x_stage,
                  x_scales, body)  # fmt: skip


@cute.jit
def _store_row(out: cute.Tensor, r, n, col, s1):
    """Request r's output column ``col`` of a staged pass (if it is one:
    ``< n``)."""
    if r < n:
        out[r, col] = s1.to(BFloat16)


@cute.jit
def _bf16(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, lo, hi, rstd, x_stage):
    shape: KernelShape = s
    b, h, lora = shape.batch, shape.hidden, shape.q_lora_rank
    x = gmem(BFloat16, ptrs[layer, LayerSlot.H_IN], (b, h))
    norm = gmem(BFloat16, ptrs[layer, LayerSlot.INPUT_NORM], (h,))
    out = gmem(BFloat16, ptrs[layer, LayerSlot.QKV_A], (b, shape.mla_width))
    kv_a = gmem(BFloat16, ptrs[layer, LayerSlot.MLA_KV_A], (shape.latent_width, h))
    row_rstd(x, rstd, shape.rms_norm_eps)
    xs, normed = x, True
    if cutlass.const_expr(stages_input(shape)):
        stage_normed(x, norm, rstd, x_stage)
        xs, normed = x_stage, False
    if cutlass.const_expr(lora > 0):
        q_a = gmem(BFloat16, ptrs[layer, LayerSlot.MLA_Q_A], (lora, h))
        q_hi = cutlass.min(hi, lora)
        gemv(q_a, q_a, xs, norm, rstd, lo, q_hi, _store(out, 0), normed, False)
    # kv_a's rows of the tile (none when it ends inside q_a: an empty range).
    kv_lo = cutlass.max(lo, lora) - lora
    gemv(kv_a, kv_a, xs, norm, rstd, kv_lo, hi - lora, _store(out, lora), normed,
         False)  # fmt: skip
