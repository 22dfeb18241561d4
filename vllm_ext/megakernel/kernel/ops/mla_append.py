# SPDX-License-Identifier: Apache-2.0
"""MLA_APPEND (reference: ``ops/mla_append.py``): each request's new latent
row ``[kv_a_layernorm(kv_c) | RoPE(k_pe)]`` from kv_a's output, both
rounded to bf16, stored at the request's slot of the layer's latent cache
``[blocks, block_size, latent_width]`` (a padded row, slot -1, writes
nothing). One small instruction: the norm needs the whole kv_c row."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from vllm_ext.megakernel.kernel.ops.common import (
    MAX_POSITIONS,
    NUM_THREADS,
    gmem,
    row_rstd,
    thread_ids,
)
from vllm_ext.megakernel.kernel.ops.kv import latent_row
from vllm_ext.megakernel.kernel.ops.mla_q import rope_gptj_pair
from vllm_ext.megakernel.kernel.shape import GlobalSlot, KernelShape, LayerSlot


@cute.jit
def mla_append(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, glob,
               kv_block_stride, rstd):  # fmt: skip
    shape: KernelShape = s
    b, rank, rope = shape.batch, shape.kv_lora_rank, shape.qk_rope
    width, lora, bs = shape.latent_width, shape.q_lora_rank, shape.block_size
    half = rope // 2
    qkv_a = ptrs[layer, LayerSlot.QKV_A] + lora * 2  # bytes: kv_a's columns
    kv_c = gmem(BFloat16, qkv_a, (b, rank), (shape.mla_width, 1))
    kv = gmem(BFloat16, qkv_a, (b, width), (shape.mla_width, 1))
    norm = gmem(BFloat16, ptrs[layer, LayerSlot.MLA_KV_A_NORM], (rank,))
    slots = gmem(Int32, ptrs[glob, GlobalSlot.SLOT_MAPPING], (b,))
    positions = gmem(Int32, ptrs[glob, GlobalSlot.POSITIONS], (b,))
    cos_sin = gmem(Float32, ptrs[glob, GlobalSlot.COS_SIN], (MAX_POSITIONS, rope))
    cache = ptrs[layer, LayerSlot.KV_CACHE]
    row_rstd(kv_c, rstd, shape.rms_norm_eps)
    tidx, _, _ = thread_ids()
    # kv_c element by element, then k_pe pair by pair (a tiny instruction:
    # B x 576 values, scalar stores suffice).
    per_row = rank + half
    for idx in cutlass.range(tidx, b * per_row, NUM_THREADS):
        i, j = idx // per_row, idx % per_row
        slot = slots[i]
        if slot >= 0:
            dst = latent_row(shape, cache, slot // bs, slot % bs, kv_block_stride)
            if j < rank:
                v = kv[i, j].to(Float32) * rstd[i] * norm[j].to(Float32)
                dst[j] = v.to(BFloat16)
            else:
                p = j - rank
                pos = positions[i]
                y1, y2 = rope_gptj_pair(
                    kv[i, rank + 2 * p].to(Float32),
                    kv[i, rank + 2 * p + 1].to(Float32),
                    cos_sin[pos, p], cos_sin[pos, half + p],
                )  # fmt: skip
                dst[rank + 2 * p] = y1.to(BFloat16)
                dst[rank + 2 * p + 1] = y2.to(BFloat16)
