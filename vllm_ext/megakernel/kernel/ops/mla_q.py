# SPDX-License-Identifier: Apache-2.0
"""MLA_Q (reference: ``ops/mla_q.py``): heads [lo, hi)'s queries in the
latent space. Per instruction, the q input once: q_a_layernorm of the q_a
row (or, without a q LoRA, RMSNorm(h)), staged in shared memory as bf16.
Per head: its q_b (q_proj) rows by the GEMV core into shared memory
(rounded to bf16); GPT-J RoPE on the q_pe dims (rounded as
``reference.rope_gptj``: cos/sin, each product, then the sum, in bf16);
then ``q_nope @ W_UK`` (the head's ``[nope, rank]`` view of kv_b_proj).

W_UK is read along its rows, so that product is not a row GEMV: each
thread owns one 128-bit vector of latent columns (8 accumulators per
request) over a slice of the nope rows, and the slices' partial sums meet
in shared memory, ``WUK_GROUP`` requests per pass over the head's W_UK."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8

from vllm_ext.megakernel.kernel.ops.common import (
    MAX_POSITIONS,
    NUM_THREADS,
    STAGE_BYTES,
    VEC,
    consumer_sync,
    gmem,
    load_f32,
    round_bf16,
    row_rstd,
    stage_normed,
    thread_ids,
    vectors,
)
from vllm_ext.megakernel.kernel.ops.gemv import gemv
from vllm_ext.megakernel.kernel.ops.gemv_paged import weight_scales
from vllm_ext.megakernel.kernel.ops.gemv_quant import (
    input_groups,
    qgemv,
    quantize_rows,
)
from vllm_ext.megakernel.kernel.shape import (
    WUK_GROUP,
    GlobalSlot,
    KernelShape,
    LayerSlot,
)


def q_input_width(shape: KernelShape) -> int:
    """K of the q_b (or q_proj) GEMV."""
    return shape.q_lora_rank or shape.hidden


def q_scale_floats(shape: KernelShape) -> int:
    """FP8: the fp32 input scales of q_b's GEMV past q_buf (0 otherwise)."""
    if not shape.fp8:
        return 0
    return shape.batch * input_groups(q_input_width(shape), shape.fp8_block)


def stages_q_input(shape: KernelShape) -> bool:
    """Whether MLA_Q's normed input fits its shared-memory stage."""
    return shape.batch * q_input_width(shape) * 2 <= STAGE_BYTES


def wuk_group(batch: int) -> int:
    """Requests per pass over W_UK: a divisor of the batch, at most
    WUK_GROUP (the accumulators are 8 x that many per thread)."""
    return next(g for g in (WUK_GROUP, 2, 1) if batch % g == 0)


def wuk_scratch_floats() -> int:
    """fp32 partial sums of one pass: every thread's 8 columns x requests."""
    return NUM_THREADS * VEC * WUK_GROUP


def rope_gptj_pair(x1, x2, c, sn):
    """GPT-J RoPE of the pair (x1, x2) (fp32 holding bf16 values) by cos
    ``c`` and sin ``sn`` (fp32, from the cache), rounded as vLLM rounds in
    bf16: cos/sin, each product, then the sum or difference."""
    c, sn = round_bf16(c), round_bf16(sn)
    y1 = round_bf16(round_bf16(x1 * c) - round_bf16(x2 * sn))
    y2 = round_bf16(round_bf16(x2 * c) + round_bf16(x1 * sn))
    return y1, y2


def _store_q(q_buf: cute.Tensor, first):
    """Epilogue: the head's q_b output, rounded to bf16 as vLLM's GEMV."""

    def epilogue(row, i, s1, _):
        q_buf[i, row - first] = round_bf16(s1)

    return epilogue


@cute.jit
def mla_q(
    s: cutlass.Constexpr,
    ptrs: cute.Tensor,
    layer,
    glob,
    lo,
    hi,
    rstd: cute.Tensor,  # smem [B]
    q_stage: cute.Tensor,  # smem [B, q_input_width] bf16 (stages_q_input)
    q_buf: cute.Tensor,  # smem [B, qk_head_dim] fp32
    red: cute.Tensor,  # smem fp32 [wuk_scratch_floats()]
):
    shape: KernelShape = s
    b, h, lora = shape.batch, shape.hidden, shape.q_lora_rank
    heads, nope, rope = shape.mla_heads, shape.qk_nope, shape.qk_rope
    d, k, half = shape.qk_head_dim, q_input_width(shape), shape.qk_rope // 2
    if cutlass.const_expr(lora > 0):
        x = gmem(BFloat16, ptrs[layer, LayerSlot.QKV_A], (b, lora),
                 (shape.mla_width, 1))  # fmt: skip
        norm = gmem(BFloat16, ptrs[layer, LayerSlot.MLA_Q_A_NORM], (lora,))
    else:
        x = gmem(BFloat16, ptrs[layer, LayerSlot.H_IN], (b, h))
        norm = gmem(BFloat16, ptrs[layer, LayerSlot.INPUT_NORM], (h,))
    w_q = gmem(BFloat16, ptrs[layer, LayerSlot.MLA_Q_B], (heads * d, k))
    q_pe = gmem(BFloat16, ptrs[layer, LayerSlot.Q_PE], (b, heads, rope))
    positions = gmem(Int32, ptrs[glob, GlobalSlot.POSITIONS], (b,))
    cos_sin = gmem(Float32, ptrs[glob, GlobalSlot.COS_SIN], (MAX_POSITIONS, rope))
    tidx, _, _ = thread_ids()

    row_rstd(x, rstd, shape.rms_norm_eps)
    xs, normed = x, True
    if cutlass.const_expr(stages_q_input(shape)):
        stage_normed(x, norm, rstd, q_stage)
        xs, normed = q_stage, False
    # FP8: q_b's codes (``gemv_quant``), the staged input quantized in place
    # (per token, or per group of 128) with its scales past q_buf
    # (``q_scale_floats``); shape.py has every quantized batch stage it.
    codes = ws = qs = None
    if cutlass.const_expr(shape.dense_quantized):
        codes = gmem(Uint8, ptrs[layer, LayerSlot.MLA_Q_B], (heads * d, k))
        ws = weight_scales(shape, ptrs[layer, LayerSlot.MLA_Q_B_SCALE], heads * d, k)
        groups = input_groups(k, shape.fp8_block)
        at = q_buf.iterator + b * d
        qs = cute.make_tensor(at, cute.make_layout((b, groups), stride=(groups, 1)))
        quantize_rows(q_stage, q_stage, qs, b, shape.fp8_block)
        consumer_sync()
    for head in cutlass.range(lo, hi):
        first = head * d
        if cutlass.const_expr(shape.dense_quantized):
            qgemv(shape, codes, codes, q_stage, qs, ws, ws, first, first + d,
                  _store_q(q_buf, first), False)  # fmt: skip
        else:
            gemv(w_q, w_q, xs, norm, rstd, first, first + d, _store_q(q_buf, first),
                 normed, False)  # fmt: skip
        consumer_sync()
        for idx in cutlass.range(tidx, b * half, NUM_THREADS):
            i, p = idx // half, idx % half
            pos = positions[i]
            y1, y2 = rope_gptj_pair(q_buf[i, nope + 2 * p],
                                    q_buf[i, nope + 2 * p + 1], cos_sin[pos, p],
                                    cos_sin[pos, half + p])  # fmt: skip
            q_pe[i, head, 2 * p] = y1.to(BFloat16)
            q_pe[i, head, 2 * p + 1] = y2.to(BFloat16)
        _absorb(shape, ptrs, layer, head, q_buf, red)
        consumer_sync()  # q_buf and red are reused by the next head


@cute.jit
def _absorb(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, head, q_buf, red):
    """q_lat[:, head] = bf16(q_nope @ W_UK[head]) in fp32; q_nope is
    q_buf's first nope columns."""
    shape: KernelShape = s
    b, heads, rank, nope = (shape.batch, shape.mla_heads, shape.kv_lora_rank,
                            shape.qk_nope)  # fmt: skip
    n_cv = rank // VEC  # 128-bit column vectors of a W_UK row
    slices = NUM_THREADS // n_cv
    rows = nope // slices
    group = wuk_group(b)
    head_elems = (nope + shape.v_head_dim) * rank  # kv_b_proj rows of a head
    w_uk = gmem(BFloat16, ptrs[layer, LayerSlot.MLA_W_UK]
                + Int64(head * head_elems) * 2, (nope, rank))  # fmt: skip
    q_lat = gmem(BFloat16, ptrs[layer, LayerSlot.Q_LAT], (b, heads, rank))
    part = cute.make_tensor(red.iterator, cute.make_layout(
        (slices, group, rank), stride=(group * rank, rank, 1)))  # fmt: skip
    tidx, _, _ = thread_ids()
    cv, sl = tidx % n_cv, tidx // n_cv
    for b0 in cutlass.range(0, b, group):
        acc = cute.make_rmem_tensor((group, VEC), Float32)
        acc.fill(0.0)
        for p in cutlass.range(sl * rows, (sl + 1) * rows, unroll=4):
            wf = load_f32(vectors(w_uk[p, None]), cv)
            for i in cutlass.range_constexpr(group):
                qn = q_buf[b0 + i, p]
                for e in cutlass.range_constexpr(VEC):
                    acc[i, e] = acc[i, e] + qn * wf[e]
        for i in cutlass.range_constexpr(group):
            for e in cutlass.range_constexpr(VEC):
                part[sl, i, cv * VEC + e] = acc[i, e]
        consumer_sync()
        for idx in cutlass.range(tidx, group * rank, NUM_THREADS):
            i, col = idx // rank, idx % rank
            total = Float32(0.0)
            for j in cutlass.range_constexpr(slices):
                total = total + part[j, i, col]
            q_lat[b0 + i, head, col] = total.to(BFloat16)
        consumer_sync()  # the partials are reused by the next pass
