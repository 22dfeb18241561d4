# SPDX-License-Identifier: Apache-2.0
"""Attention's past tokens into L2 before its wait (no reference: a hint
with no effect on results).

Of the cache rows an ATTN or MLA_ATTN chunk reads, only the new token's
depends on this step (QKV or MLA_APPEND writes it; with
``shape.qk_in_attn`` ATTN then finishes its K in place); the others are in place
before the step starts, at addresses the step's block table gives. So the
controller hints them into L2 before it waits for the instruction's inputs,
as it hints the weights of an instruction without pages (ops/prefetch.py),
and they stream while the instructions before it run.

A chunk's tokens are read by as many SMs as share the chunk: one per kv
head (ATTN), or per head group (MLA_ATTN). A block of the cache holds all
heads of its tokens side by side, contiguously, so the SM of sharer ``g``
hints the ``g``-th of ``sharers`` equal 16-byte-aligned slices of each of
the chunk's blocks: one bulk prefetch per block, and the sharers together
hint each block once. At most ``KV_HINT_BYTES`` per instruction (requests
in order, their blocks in order): the hints of all SMs then hold at most
132 x 96 KiB = 12 MiB of the H200's L2, beside the weights' lookahead
(ops/weight_pipe.py). The cost model mirrors this budget
(``cost.KV_HINT_BYTES``)."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from vllm_ext.megakernel.kernel.ops.attn import MAX_BLOCKS, chunk_span
from vllm_ext.megakernel.kernel.ops.common import gmem
from vllm_ext.megakernel.kernel.shape import GlobalSlot, KernelShape, LayerSlot
from vllm_ext.megakernel.kernel.sync import prefetch_l2

KV_HINT_BYTES = 96 * 1024


def block_bytes(shape: KernelShape) -> int:
    """Bytes of one cache block's entries: ``block_size`` tokens of every kv
    head's K|V, or of the latent row."""
    if shape.mla:
        return shape.block_size * shape.latent_width * 2
    return shape.block_size * shape.kv_heads * 2 * shape.head_dim * 2


def slice_bytes(sharers: int, nbytes: int) -> int:
    """A sharer's slice of an ``nbytes`` block: an equal share, rounded up
    to 16 bytes (a bulk prefetch's granule)."""
    return -(-nbytes // (16 * sharers)) * 16


def block_slice(sharer, sharers: int, nbytes: int):
    """Bytes ``[offset, offset + size)`` of an ``nbytes`` block that sharer
    ``sharer`` of ``sharers`` hints; ``size <= 0``: none (plain ints or
    trace-time values)."""
    part = slice_bytes(sharers, nbytes)
    offset = sharer * part
    return offset, cutlass.min(part, nbytes - offset)


def hint_blocks(sharers: int, nbytes: int) -> int:
    """Blocks an instruction hints at most: ``KV_HINT_BYTES`` of slices."""
    return max(1, KV_HINT_BYTES // slice_bytes(sharers, nbytes))


def chunk_blocks(lo, hi, block_size: int):
    """Blocks ``[first, end)`` of a sequence that hold its tokens ``[lo,
    hi)``, for ``hi > lo``."""
    return lo // block_size, (hi + block_size - 1) // block_size


@cute.jit
def hint_kv(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, glob, sharer,
            sharers: cutlass.Constexpr, chunk, kv_block_stride,
            block_table_stride):  # fmt: skip
    """The controller lane, before it waits for ATTN (kv head ``sharer``) or
    MLA_ATTN (head group ``sharer``) of chunk ``chunk``: its slice of the
    chunk's blocks into L2, up to ``KV_HINT_BYTES``."""
    shape: KernelShape = s
    b, bs = shape.batch, shape.block_size
    seq_lens = gmem(Int32, ptrs[glob, GlobalSlot.SEQ_LENS], (b,))
    table = gmem(Int32, ptrs[glob, GlobalSlot.BLOCK_TABLE], (b, MAX_BLOCKS),
                 (block_table_stride, 1))  # fmt: skip
    cache = ptrs[layer, LayerSlot.KV_CACHE]
    offset, size = block_slice(sharer, sharers, block_bytes(shape))
    if size > 0:
        left = Int32(hint_blocks(sharers, block_bytes(shape)))
        i = Int32(0)
        while (i < b) & (left > 0):
            lo, hi = chunk_span(seq_lens[i], chunk, shape.attn_chunks)
            if hi > lo:
                first, end = chunk_blocks(lo, hi, bs)
                end = cutlass.min(end, first + left)
                left = left - (end - first)
                # (The table loads are independent: unrolled, they overlap.)
                for j in cutlass.range(first, end, unroll=4):
                    block = Int64(table[i, j]) * Int64(kv_block_stride)
                    prefetch_l2(cache + block * 2 + Int64(offset), size)
            i = i + 1
