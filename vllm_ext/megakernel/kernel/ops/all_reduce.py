# SPDX-License-Identifier: Apache-2.0
"""ALL_REDUCE (reference: ``ops/all_reduce.py``): hidden columns [lo, hi)
of a tensor-parallel point, the ranks' partial sums added in rank order in
fp32, rounded to bf16, then the residual added and rounded; written to the
point's destination on this rank (h0, hmid[l] or h[l + 1]).

One-shot pull, as vLLM's custom all-reduce below 256 KB: the ranks' O_PROJ,
DOWN, EXPERT_DOWN and EMBED tiles write their partial sums to their own
memory and signal this rank's counter at system scope (control.signal_done);
the controller's acquire at system scope meets the wait (control.wait_inputs);
then every consumer reads its columns of every rank's partials, a 128-bit
vector at a time, through the addresses PEERS holds (symmetric memory on a
TP deployment; the same GPU's memory in the check's one-launch ranks). Pull
keeps the producing ops' stores local and unchanged but for their
destination; every rank reads the same values in the same order, so every
rank gets the same bits.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from vllm_ext.megakernel.isa import Point
from vllm_ext.megakernel.kernel.ops.common import (
    NUM_THREADS,
    VEC,
    gmem,
    load_f32,
    thread_ids,
    vectors,
)
from vllm_ext.megakernel.kernel.shape import GlobalSlot, KernelShape, LayerSlot


def partial_address(shape: KernelShape, base, point, layer):
    """Where ``point`` of ``layer`` starts in a rank's partial sums at
    ``base``: shape.partial_row without a branch ((point + 1) // 2 is 0 for
    EMBED, 1 for ATTN and MLP)."""
    row = (Int32(2) * layer + point) * ((point + 1) // 2)
    return base + Int64(row) * (shape.batch * shape.hidden * 2)


def own_partials(shape: KernelShape, ptrs: cute.Tensor, glob, point, layer):
    """This rank's partial sums of ``point`` in ``layer``, ``[B, hidden]``:
    where its O_PROJ, DOWN, EXPERT_DOWN or EMBED tiles write."""
    base = partial_address(shape, ptrs[glob, GlobalSlot.PARTIALS], point, layer)
    return gmem(BFloat16, base, (shape.batch, shape.hidden))


@cute.jit
def all_reduce(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, glob, point, lo, hi):
    if point == Int32(Point.EMBED):
        _reduce(s, ptrs, layer, glob, point, lo, hi, GlobalSlot.H0, None)
    elif point == Int32(Point.ATTN):
        _reduce(s, ptrs, layer, glob, point, lo, hi, LayerSlot.HMID, LayerSlot.H_IN)
    else:
        _reduce(s, ptrs, layer, glob, point, lo, hi, LayerSlot.H_OUT, LayerSlot.HMID)


@cute.jit
def _reduce(s: cutlass.Constexpr, ptrs: cute.Tensor, layer, glob, point, lo, hi,
            out: cutlass.Constexpr, res: cutlass.Constexpr):  # fmt: skip
    """``out``: the destination's slot (of the model-wide row without a
    residual, else of the layer's); ``res``: the residual's, or None."""
    shape: KernelShape = s
    b, h, tp = shape.batch, shape.hidden, shape.tp_size
    peers = gmem(Int64, ptrs[glob, GlobalSlot.PEERS], (2, tp))
    if cutlass.const_expr(res is None):
        dst = gmem(BFloat16, ptrs[glob, out], (b, h))
    else:
        dst = gmem(BFloat16, ptrs[layer, out], (b, h))
        residual = gmem(BFloat16, ptrs[layer, res], (b, h))
    tidx, _, _ = thread_ids()
    # Tiles are multiples of 16 columns (planner.COL_MULTIPLE), so of VEC.
    n_vec = (hi - lo) // VEC
    for idx in cutlass.range(tidx, b * n_vec, NUM_THREADS):
        i, j = idx // n_vec, lo // VEC + idx % n_vec
        total = cute.make_rmem_tensor((VEC,), Float32)
        total.fill(0.0)
        for r in cutlass.range_constexpr(tp):
            part = gmem(BFloat16, partial_address(shape, peers[1, r], point, layer),
                        (b, h))  # fmt: skip
            total.store(total.load() + load_f32(vectors(part[i, None]), j))
        y = total.load().to(BFloat16)
        if cutlass.const_expr(res is not None):
            y = (y.to(Float32) + load_f32(vectors(residual[i, None]), j)).to(BFloat16)
        o = cute.make_rmem_tensor((VEC,), BFloat16)
        o.store(y)
        cute.autovec_copy(o, vectors(dst[i, None])[None, j])
