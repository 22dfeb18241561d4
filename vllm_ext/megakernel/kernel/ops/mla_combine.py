# SPDX-License-Identifier: Apache-2.0
"""MLA_COMBINE (reference: ``ops/mla_combine.py``): one head's latent
partials merged by log-sum-exp in chunk order (COMBINE's arithmetic),
rounded to bf16 into shared memory, then value columns [p * cols, (p+1) *
cols) of the head by the GEMV core on its W_UV rows (the head's ``[v,
rank]`` view of kv_b_proj), rounded to bf16 into o_proj's input."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int64

from vllm_ext.megakernel.kernel.ops.attn import NEG_INF
from vllm_ext.megakernel.kernel.ops.common import (
    NUM_THREADS,
    consumer_sync,
    gmem,
    thread_ids,
)
from vllm_ext.megakernel.kernel.ops.gemv import gemv
from vllm_ext.megakernel.kernel.shape import KernelShape, LayerSlot


@cute.jit
def mla_combine(
    s: cutlass.Constexpr,
    ptrs: cute.Tensor,
    layer,
    head,
    part,
    rstd: cute.Tensor,  # smem [B] (unread: the GEMV is not normed)
    latent: cute.Tensor,  # smem [B, kv_lora_rank] bf16
    red: cute.Tensor,  # smem fp32, at least B * (chunks + 1)
):
    shape: KernelShape = s
    b, rank, chunks = shape.batch, shape.kv_lora_rank, shape.attn_chunks
    per, groups, v = shape.mla_per_group, shape.mla_groups, shape.v_head_dim
    cols = v // shape.mla_v_parts
    g, j = head // per, head % per
    part_o = gmem(Float32, ptrs[layer, LayerSlot.PART_O],
                  (chunks, groups, b, per, rank))  # fmt: skip
    part_lse = gmem(Float32, ptrs[layer, LayerSlot.PART_LSE],
                    (chunks, groups, b, per))  # fmt: skip
    # The head's W_UV rows: kv_b_proj rows [nope, nope + v) of the head.
    head_elems = (shape.qk_nope + v) * rank
    w_uv = gmem(BFloat16, ptrs[layer, LayerSlot.MLA_W_UV]
                + Int64(head * head_elems) * 2, (v, rank))  # fmt: skip
    attn = gmem(BFloat16, ptrs[layer, LayerSlot.ATTN], (b, shape.mla_heads, v))
    wgt = cute.make_tensor(
        red.iterator, cute.make_layout((b, chunks + 1), stride=(chunks + 1, 1))
    )
    tidx, _, _ = thread_ids()
    # Each request's chunk weights exp(lse - max) and their sum, once.
    for i in cutlass.range(tidx, b, NUM_THREADS):
        top = Float32(NEG_INF)
        for c in cutlass.range_constexpr(chunks):
            top = cute.math.max(top, part_lse[c, g, i, j])
        if top == Float32(NEG_INF):  # a padded row: no tokens
            top = Float32(0.0)
        den = Float32(0.0)
        for c in cutlass.range_constexpr(chunks):
            w = cute.math.exp(part_lse[c, g, i, j] - top)
            wgt[i, c] = w
            den = den + w
        if den == Float32(0.0):
            den = Float32(1.0)
        wgt[i, chunks] = den
    consumer_sync()
    for idx in cutlass.range(tidx, b * rank, NUM_THREADS):
        i, col = idx // rank, idx % rank
        num = Float32(0.0)
        for c in cutlass.range_constexpr(chunks):
            num = num + wgt[i, c] * part_o[c, g, i, j, col]
        latent[i, col] = (num / wgt[i, chunks]).to(BFloat16)
    consumer_sync()

    def epilogue(row, i, s1, _):
        attn[i, head, row] = s1.to(BFloat16)

    gemv(w_uv, w_uv, latent, latent[0, None], rstd, part * cols, part * cols + cols,
         epilogue, False, False)  # fmt: skip
