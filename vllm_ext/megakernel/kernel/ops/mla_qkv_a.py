# SPDX-License-Identifier: Apache-2.0
"""MLA_QKV_A (reference: ``ops/mla_qkv_a.py``): output columns [lo, hi) of
``RMSNorm(h) @ [Wq_a; Wkv_a].T`` (vLLM's one fused GEMM; kv_a alone without
a q LoRA), rounded to bf16. The two matrices stay two tensors (table
columns MLA_Q_A and MLA_KV_A): a tile's rows lie in one or both, so it
runs the GEMV core once per matrix on its share of [lo, hi)."""

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


def _store(out: cute.Tensor, offset):
    """Epilogue: row ``row`` of a matrix is output column offset + row."""

    def epilogue(row, i, s1, _):
        out[i, offset + row] = s1.to(BFloat16)

    return epilogue


@cute.jit
def mla_qkv_a(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, lo, hi, rstd, x_stage):
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
