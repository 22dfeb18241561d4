# SPDX-License-Identifier: Apache-2.0
"""Addressing vLLM's paged KV cache in place (reference: ``paged_kv.py``).

A layer's cache is LBNHC: memory ``[block, token, kv_head, K|V]``. Offsets
are computed in 64 bits: a layer's view of a large cache passes 2^31
elements. Token and head strides follow from the shape; the block stride
is a launch argument (the host checks the view against it)."""

import cutlass.cute as cute
from cutlass import BFloat16, Int64

from vllm_ext.megakernel.kernel.ops.common import gmem
from vllm_ext.megakernel.kernel.shape import KernelShape


def kv_entry(
    shape: KernelShape, cache: Int64, block, offset, kv_head, block_stride
) -> cute.Tensor:
    """The ``[2 * head_dim]`` K|V entry of (block, offset, kv_head)."""
    d2 = 2 * shape.head_dim
    elem = (
        Int64(block) * Int64(block_stride)
        + Int64(offset * (shape.kv_heads * d2))
        + Int64(kv_head * d2)
    )
    return gmem(BFloat16, cache + elem * 2, (d2,))


def kv_slot_entry(shape: KernelShape, cache: Int64, slot, kv_head, block_stride):
    """The entry of flat slot ``slot`` (``block * block_size + offset``,
    what vLLM's slot mapping holds). Only the KV append addresses by slot
    (QKV's, and ATTN's finishing of the new K: ``shape.qk_in_attn``)."""
    bs = shape.block_size
    if shape.planted_bug == "kv-slot":  # (trace time: a test-only build)
        # Planted for the GPU check: the neighbouring token of the same block
        # (block_size is even), so the stray write always lands inside the
        # cache and only the KV checks can see it.
        slot = slot ^ 1
    return kv_entry(shape, cache, slot // bs, slot % bs, kv_head, block_stride)


def latent_row(
    shape: KernelShape, cache: Int64, block, offset, block_stride
) -> cute.Tensor:
    """The ``[latent_width]`` row ``[kv_c | k_pe]`` of (block, offset) in an
    MLA layer's cache ``[blocks, block_size, latent_width]`` (one kv head;
    block starts 16-byte aligned, rows too: latent_width % 8 == 0)."""
    width = shape.latent_width
    elem = Int64(block) * Int64(block_stride) + Int64(offset * width)
    return gmem(BFloat16, cache + elem * 2, (width,))
