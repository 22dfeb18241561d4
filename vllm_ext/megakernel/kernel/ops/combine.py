# SPDX-License-Identifier: Apache-2.0
"""COMBINE (reference: ``ops/combine.py``): merge kv head g's chunk
partials of its units [lo, hi) (dim parts of q heads, isa.py) by
log-sum-exp in fp32, in chunk order, into the layer's attention output
(bf16). A row with no tokens (padding) gives zeros."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from vllm_ext.megakernel.kernel.ops.common import NUM_THREADS, gmem, thread_ids
from vllm_ext.megakernel.kernel.shape import KernelShape, LayerSlot


@cute.jit
def combine(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, g, lo, hi):
    shape: KernelShape = s
    b, d, group, chunks = shape.batch, shape.head_dim, shape.group, shape.attn_chunks
    nkv = shape.kv_heads
    part_o = gmem(Float32, ptrs[layer, LayerSlot.PART_O], (chunks, nkv, b, group, d))
    part_lse = gmem(Float32, ptrs[layer, LayerSlot.PART_LSE], (chunks, nkv, b, group))
    attn = gmem(BFloat16, ptrs[layer, LayerSlot.ATTN], (b, shape.q_heads, d))
    parts = shape.combine_parts
    dims = d // parts
    tidx, _, _ = thread_ids()
    n = hi - lo
    for idx in cutlass.range(tidx, b * n * dims, NUM_THREADS):
        i, gi, dim = unit_element(idx, lo, n, dims, parts)
        top = Float32(float("-inf"))
        for c in cutlass.range_constexpr(chunks):
            top = cute.math.max(top, part_lse[c, g, i, gi])
        if top == Float32(float("-inf")):
            top = Float32(0.0)
        num, den = Float32(0.0), Float32(0.0)
        for c in cutlass.range_constexpr(chunks):
            wgt = cute.math.exp(part_lse[c, g, i, gi] - top)
            num = num + wgt * part_o[c, g, i, gi, dim]
            den = den + wgt
        if den == Float32(0.0):
            den = Float32(1.0)
        attn[i, g * group + gi, dim] = (num / den).to(BFloat16)


def unit_element(idx, lo, n, dims, parts):
    """Thread-strided element ``idx`` of units [lo, lo + n) (``dims`` dims
    each, ``parts`` per q head) -> (request, q head in the group, dim). Plain
    arithmetic, so tests/megakernel/test_combine_parts_mapping.py runs it on
    Python ints."""
    i, rest = idx // (n * dims), idx % (n * dims)
    u = lo + rest // dims
    return i, u // parts, (u % parts) * dims + rest % dims
